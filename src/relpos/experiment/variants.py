"""The models a run compares: one per encoding, T5 in two settings, ablations, and RoPE scalings.

* ``t5``: T5's bias with ``max_distance`` at the training length, so that its far bucket is trained;
* ``t5_md128``: T5's own default ``max_distance=128`` (at short training lengths its far buckets
  never see a distance and keep their initial values);
* RoPE scaling rows (``rope + linear`` ...) are not trained: the trained ``rope`` model is evaluated
  with a scaled rotary embedding, as users extend a model's context without fine-tuning. At an
  input of ``L`` tokens, after training at ``L0``, the factor is ``s = max(1, L / L0)``:

  - ``linear`` (position interpolation): ``factor = s``;
  - ``dynamic`` (dynamic NTK): ``factor = 1`` and ``original_max_position_embeddings = L0``, so the
    base grows as ``(L / L0) ** (d / (d - 2))`` with each input's length (the NTK-aware rule; a
    larger factor would stretch it twice);
  - ``yarn``: ``factor = s``, ``original_max_position_embeddings = L0``, default betas and attention
    factor ``0.1 ln(s) + 1``;
  - ``llama3``: ``factor = s``, ``original_max_position_embeddings = L0``, Llama 3.1's
    ``low_freq_factor = 1``, ``high_freq_factor = 4``.
"""

from __future__ import annotations

from .. import registry
from ..rotary import RotaryEmbedding
from .model import DEFAULT_ENCODINGS, ENCODINGS, LMConfig

__all__ = ["MODELS", "ALL_MODELS", "ROPE_SCALING_ROWS", "models", "rope_scaling", "describe"]

#: the models of the default run: the nine classic encodings and T5 at max_distance 128
MODELS: tuple[str, ...] = (*DEFAULT_ENCODINGS[:4], "t5_md128", *DEFAULT_ENCODINGS[4:])
#: every model name ``--encodings`` accepts: those and the other encodings of relpos.registry
#: (Kerple, Sandwich, FIRE, xPos, forgetting gates, CoPE)
ALL_MODELS: tuple[str, ...] = MODELS + tuple(e for e in ENCODINGS if e not in MODELS)

#: the RoPE scalings evaluated on the trained RoPE model (transformers' rope_type names)
ROPE_SCALING_ROWS: tuple[str, ...] = ("linear", "dynamic", "yarn", "llama3")


def models(
    names: tuple[str, ...], *, dim: int, layers: int, heads: int, train_len: int, vocab: int,
    buckets: tuple[int, ...] = (), bucketing: tuple[str, ...] = (),
) -> list[tuple[str, LMConfig]]:
    """(name, model config) of every model a run trains; an ablation replaces the encodings."""
    base = LMConfig(dim=dim, layers=layers, heads=heads, train_len=train_len, vocab=vocab,
                    clip_distance=max(1, train_len // 2))

    def t5(num_buckets: int = 32, strategy: str = "log", max_distance: int | None = None) -> LMConfig:
        # by default the far bucket starts at the training length, so that it is trained; it must lie
        # above the causal exact range (num_buckets // 2)
        max_distance = max_distance or max(train_len, num_buckets // 2 + 1)
        return base.with_(encoding="t5", num_buckets=num_buckets, strategy=strategy, max_distance=max_distance)

    runs = [(f"t5 {n} buckets", t5(num_buckets=n)) for n in buckets]
    runs += [(f"t5 {s}", t5(strategy=s)) for s in bucketing]
    if runs:
        return runs
    special = {"t5": t5, "t5_md128": lambda: t5(max_distance=128)}
    return [(name, special[name]() if name in special else base.with_(encoding=name)) for name in names]


def rope_scaling(kind: str, head_dim: int, length: int, train_len: int) -> RotaryEmbedding:
    """The rotary embedding the ``rope + kind`` row uses for inputs of ``length`` tokens."""
    factor = max(1.0, length / train_len)
    if kind == "dynamic":
        scaling = {"rope_type": "dynamic", "factor": 1.0, "original_max_position_embeddings": train_len}
    elif factor == 1.0:
        scaling = None  # within the training length every scaling is the identity
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": train_len}
    elif kind == "llama3":
        scaling = {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": train_len,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    else:
        raise ValueError(f"rope scaling must be one of {', '.join(ROPE_SCALING_ROWS)}; got {kind!r}")
    return RotaryEmbedding(head_dim, scaling=scaling)


_LABELS = {"t5": "T5 bias (max_distance = train length)", "t5_md128": "T5 bias (max_distance 128)",
           "log_decay": "log-decay (fixed)"}


def describe(name: str) -> str:
    """A readable label for a model name (``rope + yarn`` -> ``RoPE + yarn (no fine-tuning)``)."""
    if name.startswith("rope + "):
        return f"RoPE + {name[7:]} (eval only)"
    if name in _LABELS:
        return _LABELS[name]
    return registry.get(name).label if name in registry.ENCODINGS else name
