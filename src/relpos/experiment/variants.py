"""The models a run compares: one per encoding, T5 in two settings, ablations, and RoPE scalings.

Every encoding's range covers the distances it is trained on (the largest is ``train_len - 1``):

* ``t5``: T5's bias with ``max_distance = train_len``, just above the largest trained distance, so
  every trained distance falls below the shared far bucket (which no training distance reaches:
  it keeps its initial value, as T5's own setting does for distances past 128);
* ``t5_md128``: T5's own default ``max_distance=128``;
* the clipped bias and Shaw's vectors clip at ``R = train_len``: no trained offset is clipped;
* a bucket ablation uses one ``max_distance`` for every bucket count (``ablation_max_distance``),
  the smallest that is above both the largest trained distance and every count's exact range.

RoPE scaling rows are not trained: the trained ``rope`` model is evaluated with a scaled rotary
embedding, as users extend a model's context without fine-tuning (Chen et al. 2023's position
interpolation fine-tunes; these rows do not). ``L0`` is the training length.

* ``linear``, ``yarn``, ``llama3``: one factor ``s`` fixed before any evaluation, from the run's
  configuration (the longest evaluation length over ``L0``), and used at every length, 1x included;
* ``linear-oracle``, ``yarn-oracle``, ``llama3-oracle``: the factor ``max(1, L / L0)`` for inputs
  of ``L`` tokens, i.e. chosen knowing the test length (an oracle, shown apart from the fixed rows);
* ``dynamic`` (dynamic NTK): ``factor = 1``, ``original_max_position_embeddings = L0``, computed per
  token position as transformers does while decoding: position ``p`` is rotated with the base
  for a length of ``p + 1`` (:class:`PerPositionDynamicRotary`);
* yarn keeps transformers' default betas and attention factor ``0.1 ln(s) + 1``; llama3 uses Llama
  3.1's ``low_freq_factor = 1``, ``high_freq_factor = 4``.
"""

from __future__ import annotations

from .. import registry
from ..encodings.rotary import RotaryEmbedding
from .model import DEFAULT_ENCODINGS, ENCODINGS, LMConfig

import torch

__all__ = ["MODELS", "ALL_MODELS", "ROPE_SCALING_ROWS", "models", "ablation_max_distance", "rope_scaling",
           "PerPositionDynamicRotary", "describe"]

#: the models of the default run: the nine classic encodings and T5 at max_distance 128
MODELS: tuple[str, ...] = (*DEFAULT_ENCODINGS[:4], "t5_md128", *DEFAULT_ENCODINGS[4:])
#: every model name ``--encodings`` accepts: those and the other encodings of relpos.registry
#: (Kerple, Sandwich, FIRE, xPos, forgetting gates, CoPE)
ALL_MODELS: tuple[str, ...] = MODELS + tuple(e for e in ENCODINGS if e not in MODELS) + ("rope_randomized",)

#: the RoPE scalings evaluated on the trained RoPE model (transformers' rope_type names)
ROPE_SCALING_ROWS: tuple[str, ...] = ("linear", "dynamic", "yarn", "llama3", "linear-oracle", "yarn-oracle", "llama3-oracle")


def ablation_max_distance(train_len: int, buckets: tuple[int, ...]) -> int:
    """The one ``max_distance`` of a bucket ablation: above the largest trained distance
    (``train_len - 1``) and above every bucket count's exact range (``num_buckets // 2`` causal).

    >>> ablation_max_distance(64, (8, 32, 128)), ablation_max_distance(64, (8, 32))
    (65, 64)
    """
    return max([train_len] + [n // 2 + 1 for n in buckets])


def models(
    names: tuple[str, ...], *, dim: int, layers: int, heads: int, train_len: int, vocab: int,
    buckets: tuple[int, ...] = (), bucketing: tuple[str, ...] = (), max_positions: int | None = None,
) -> list[tuple[str, LMConfig]]:
    """(name, model config) of every model a run trains; an ablation replaces the encodings.

    ``train_len`` is the longest input trained on: distances ``0 .. train_len - 1`` are trained;
    ``max_positions`` (the longest evaluation input) is the range ``rope_randomized`` draws from.
    """
    base = LMConfig(dim=dim, layers=layers, heads=heads, train_len=train_len, vocab=vocab, clip_distance=train_len)
    far = ablation_max_distance(train_len, buckets or (32,))

    def t5(num_buckets: int = 32, strategy: str = "log", max_distance: int | None = None) -> LMConfig:
        return base.with_(encoding="t5", num_buckets=num_buckets, strategy=strategy, max_distance=max_distance or far)

    runs = [(f"t5 {n} buckets", t5(num_buckets=n)) for n in buckets]
    runs += [(f"t5 {s}", t5(strategy=s)) for s in bucketing]
    if runs:
        return runs
    special = {"t5": t5, "t5_md128": lambda: t5(max_distance=max(128, far)),
               "rope_randomized": lambda: base.with_(encoding="rope", randomized_positions=max_positions or train_len)}
    return [(name, special[name]() if name in special else base.with_(encoding=name)) for name in names]


class PerPositionDynamicRotary(RotaryEmbedding):
    """Dynamic NTK computed per token position, as transformers applies it while decoding one token
    at a time: position ``p`` is rotated with the frequencies for a length of ``p + 1``
    (:meth:`RotaryEmbedding.frequencies`), so a token's rotation never depends on later tokens.
    The rows are cached and grow with the longest position seen."""

    def __init__(self, head_dim: int, train_len: int) -> None:
        super().__init__(head_dim, scaling={"rope_type": "dynamic", "factor": 1.0, "original_max_position_embeddings": train_len})
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, *, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``length`` does not matter here: position ``p`` always takes the frequencies of length ``p + 1``."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if self._rows is None or self._rows[0].shape[0] < needed:
            rows = [super(PerPositionDynamicRotary, self).cos_sin(torch.tensor([p], device=self.inv_freq.device))
                    for p in range(needed)]  # the whole-input rule at length p + 1, for position p alone
            self._rows = (torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows]))  # (P, d) each
        cos, sin = self._rows
        return cos[positions], sin[positions]  # (L, d) each


def rope_scaling(kind: str, head_dim: int, length: int, train_len: int, fixed_factor: float) -> RotaryEmbedding:
    """The rotary embedding the ``rope + kind`` row uses for inputs of ``length`` tokens.

    ``fixed_factor`` is the factor the fixed rows use at every length (set once per run);
    the ``-oracle`` rows use ``max(1, length / train_len)`` instead.
    """
    if kind not in ROPE_SCALING_ROWS:
        raise ValueError(f"rope scaling must be one of {', '.join(ROPE_SCALING_ROWS)}; got {kind!r}")
    if kind == "dynamic":
        return PerPositionDynamicRotary(head_dim, train_len)
    rope_type, oracle = kind.removesuffix("-oracle"), kind.endswith("-oracle")
    factor = max(1.0, length / train_len) if oracle else float(fixed_factor)
    if factor == 1.0:
        return RotaryEmbedding(head_dim)  # a factor of 1 is the identity for every scaling
    scaling = {"rope_type": rope_type, "factor": factor}
    if rope_type in ("yarn", "llama3"):
        scaling["original_max_position_embeddings"] = train_len
    if rope_type == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return RotaryEmbedding(head_dim, scaling=scaling)


_LABELS = {"t5": "T5 bias (max_distance = train length)", "t5_md128": "T5 bias (max_distance 128)",
           "rope_randomized": "RoPE, randomized positions (Ruoss et al. 2023)",
           "log_decay": "log-decay (fixed)"}


def describe(name: str) -> str:
    """A readable label for a model name (``rope + yarn`` -> ``RoPE + yarn (no fine-tuning)``)."""
    if name.startswith("rope + "):
        kind = name[7:]
        if kind.endswith("-oracle"):
            return f"RoPE + {kind.removesuffix('-oracle')}, oracle factor L/L0 (eval only)"
        return f"RoPE + {kind}" + (" per position" if kind == "dynamic" else ", fixed factor") + " (eval only)"
    if name in _LABELS:
        return _LABELS[name]
    return registry.get(name).label if name in registry.ENCODINGS else name
