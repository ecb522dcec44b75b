"""What the ALiBi families (Bloom, MPT, Falcon) share on relpos attention.

These models have no attention-function hook: their attention modules compute scores inline.
An adapter therefore replaces the ``forward`` of each attention module *instance* (never the
class) and switches the model's masks to 2-D key padding masks ``(B, Lk)``:

1. ``config._attn_implementation`` becomes ``"relpos_alibi"``, registered in transformers'
   ``AttentionMaskInterface`` only, with :func:`key_padding_mask`. transformers then hands every
   layer the padding mask ``(B, Lk)`` instead of building ``(B, 1, Lq, Lk)`` (Falcon even merged its
   ALiBi into a ``(B, H, Lq, Lk)`` mask). Nothing else in these models reads that name.
2. Each attention instance gets a ``forward`` that calls :func:`alibi_attention`: causal
   :func:`relpos.attention` with the ALiBi per offset (:class:`relpos.ALiBi` with the model's own
   slopes) or, where the model's ALiBi is not a function of the offset, its per-key values folded
   into one extra query/key channel (:func:`per_key_channel`). Neither builds ``(B, H, Lq, Lk)``.
   Each instance forward reads the config's implementation at every call: under any other name it
   runs the class's forward (transformers' own dense path, with the masks transformers then builds).
   Each reads the cache's length before updating it (:func:`cache_position`): with a static cache the
   queries sit at that position, not at the end of the keys, and the bias is built there
   (:mod:`relpos.hf._positioned`: a tensor position, no recompilation per step).
3. Each ``PreTrainedModel`` of the model gets an instance ``set_attn_implementation`` (transformers'
   own ignores the call for these families: they have no attention interface) that switches the
   config between ``"eager"``, ``"sdpa"`` (where the family has it) and ``"relpos_alibi"``.

:func:`patch_instances` returns the undo: the instance forwards and ``set_attn_implementation``
deleted (the class's show through) and every config's (and sub-config's) attention implementation
set back. The model gets its own copy of its config first: models built from one config object
share it, and the others must keep transformers' masks. Parameters, buffers and the state dict are
untouched.

Equalities this rests on (tested in tests/hf/test_hf_alibi.py against the unmodified models):

* ALiBi written per key position (``m * pos_j``, Bloom and MPT) and per offset (``m * (j - i)``)
  differ by ``m * pos_i``, a constant along each query row, which softmax cancels. With padding
  it holds as long as each example's kept keys are one contiguous run (left or right padding):
  Bloom counts positions from each example's first real token, ``pos_j = j - first``.
* A query row with no visible key (a left-padding position) gets, in transformers' eager code,
  the dtype's minimum on every score, hence uniform weights over all ``Lk`` keys: the mean of the
  values. :func:`alibi_attention` returns exactly that (relpos itself returns zeros there). Eagerly
  only when some row is dead; under ``torch.compile`` always (``torch.where``: no data-dependent branch).
"""

from __future__ import annotations

import copy
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .._checks import check_choice
from .._reuse import KeptResult, may_reuse, storage_key
from ..core.bias import OffsetBias
from ..encodings.alibi import ALiBi
from ..backends._head_dim import fused_head_dim
from ..backends._masks import branch_free
from ..backends.dispatch import attention, key_bias_attention, key_bias_unavailable
from ._positioned import future_keys, positioned_offsets

__all__ = [
    "MASK_NAME", "PER_KEY_KERNEL_DEVICES", "PER_KEY_ROWS", "PerKey", "alibi_attention", "cache_position", "check_fits",
    "contiguous", "key_padding_mask", "keys_of_cache", "patch_instances", "per_key_channel", "per_key_kernel",
]

MASK_NAME = "relpos_alibi"


def key_padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                     attention_mask=None, **kwargs) -> torch.Tensor:
    """transformers mask function: the ``(B, kv_length)`` key padding mask (``True`` = a real token), always a tensor."""
    if attention_mask is None:
        return torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))  # (B, Lk)
    mask = attention_mask[:, -kv_length:].bool()  # (B, <= Lk)
    if mask.shape[-1] < kv_length:  # a static cache's unseen tail (a mask of the tokens seen): hidden
        mask = nn.functional.pad(mask, (0, kv_length - mask.shape[-1]), value=False)
    return mask


def _register_masks() -> None:
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(MASK_NAME, key_padding_mask)


def _own_configs(model: nn.Module) -> list:
    """Give the model its own copy of each config object it holds; return the copies.

    Models built from one config object share it; switching the masks on a shared config would
    switch them in an unaccelerated model too (which would then get 2-D masks it cannot read).
    """
    copies: dict[int, object] = {}
    for module in model.modules():
        config = vars(module).get("config")
        if config is not None and hasattr(config, "_attn_implementation"):
            if id(config) not in copies:
                copies[id(config)] = copy.deepcopy(config)
            module.config = copies[id(config)]
    return list(copies.values())


def _on_relpos_only(module: nn.Module, forward: Callable, config) -> Callable:
    """``forward`` while ``config`` names relpos's implementation; the class's own forward under any other."""

    def switched(*args, **kwargs):
        if config._attn_implementation != MASK_NAME:  # set_attn_implementation("eager" | "sdpa"): transformers' path
            return type(module).forward(module, *args, **kwargs)
        return forward(*args, **kwargs)

    return switched


def _set_attn_implementation(model: nn.Module, configs: list) -> Callable:
    """An instance ``set_attn_implementation``: ``"eager"``, ``"sdpa"`` (where the family has it) or relpos's name."""
    choices = ("eager", "sdpa", MASK_NAME) if getattr(model, "_supports_sdpa", False) else ("eager", MASK_NAME)

    def set_attn_implementation(attn_implementation: str, allow_all_kernels: bool = False) -> None:
        check_choice(f"attn_implementation of an accelerated {type(model).__name__}", attn_implementation, choices)
        for config in configs:
            config._attn_implementation = attn_implementation  # sub-configs too (transformers' setter)

    return set_attn_implementation


def _implementations(config) -> dict:
    """The attention implementation of ``config`` (key ``""``) and of each sub-config (MPT's ``attn_config``), in the
    form transformers' setter takes back (its setter also sets every sub-config, to one name)."""
    subs = {key: getattr(config, key)._attn_implementation for key in config.sub_configs if getattr(config, key, None)}
    return {"": config._attn_implementation, **subs}


def patch_instances(model: nn.Module, forwards: dict[nn.Module, Callable]) -> Callable[[], None]:
    """Give each module its forward (an instance attribute) and the model 2-D padding masks; return the undo."""
    _register_masks()
    configs = _own_configs(model)
    previous = [_implementations(config) for config in configs]
    for module, forward in forwards.items():
        module.forward = _on_relpos_only(module, forward, model.config)  # this model only, the class is untouched
    models = [m for m in model.modules() if hasattr(type(m), "set_attn_implementation")]  # the PreTrainedModels
    for sub in models:
        sub.set_attn_implementation = _set_attn_implementation(sub, configs)
    for config in configs:
        config._attn_implementation = MASK_NAME

    def undo() -> None:
        for module in forwards:
            del module.forward  # the class's forward shows through again
        for sub in models:
            del sub.set_attn_implementation
        for config, names in zip(configs, previous):
            config._attn_implementation = names  # the model keeps its own copy of the config

    return undo


def model_alibi(num_heads: int, slopes: list[float]) -> ALiBi:
    """The model's ALiBi with its own slopes, built on the CPU whatever the default device: a model that
    transformers builds on the meta device (``from_pretrained``) and accelerates there keeps real slopes;
    :func:`alibi_attention` moves them to the queries' device at the first call."""
    return ALiBi(num_heads, slopes=slopes, device="cpu")


#: the transformers releases relpos.hf is tested with (pyproject.toml's dev extra; docs/integrations/index.md)
TESTED_TRANSFORMERS = ">= 5.15, < 5.25 (CI runs the newest; docs/integrations/index.md says what each older release lacks)"


def check_fits(module: nn.Module, family: str, *, parameters: list[str] | tuple[list[str], ...],
               attributes: tuple[str, ...], children: set[str], helpers: tuple[str, ...] = ()) -> None:
    """The installed transformers' attention module has what the instance forward relies on (else RuntimeError).

    ``parameters``: the forward's parameter names, or a tuple of the signatures known to fit (one per
    transformers release that renamed one).
    """
    import transformers

    known = parameters if isinstance(parameters, tuple) else (parameters,)
    got = list(inspect.signature(type(module).forward).parameters)
    missing = [a for a in attributes if not hasattr(module, a)]
    source = sys.modules[type(module).__module__]
    missing += [f"{source.__name__}.{h}" for h in helpers if not hasattr(source, h)]
    extra = {name for name, _ in module.named_children()} - children
    problems = []
    if got not in [list(p) for p in known]:
        needs = " or ".join(f"forward{tuple(p[1:])}" for p in known)
        problems.append(f"its forward is forward{tuple(got[1:])}, relpos needs {needs}")
    if missing:
        problems.append(f"it lacks {', '.join(missing)}")
    if extra:
        problems.append(f"it has sub-modules relpos does not know ({', '.join(sorted(extra))}; expected only "
                        f"{', '.join(sorted(children))})")
    if problems:
        raise RuntimeError(
            f"relpos.hf.accelerate ({family}) does not fit {type(module).__name__} of the installed transformers "
            f"{transformers.__version__}: {'; '.join(problems)}. relpos is tested with transformers {TESTED_TRANSFORMERS}; "
            "install one of those, or run the model unaccelerated"
        )


def cache_position(cache, layer_idx: int) -> torch.Tensor | int | None:
    """The tokens ``cache`` held before this call's keys (read it before ``cache.update``): the position of the
    call's first query. A static cache's is a 0-d tensor (cloned: ``update`` adds to it in place); None without
    a cache."""
    if cache is None:
        return None
    seen = cache.get_seq_length(layer_idx)
    return seen.clone() if isinstance(seen, torch.Tensor) else int(seen)


_last_checked = KeptResult()  # contiguous()'s last mask and answer


def contiguous(key_mask: torch.Tensor) -> bool:
    """True when each row of ``key_mask`` (B, Lk) keeps one contiguous run of keys (or none).

    >>> contiguous(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]]).bool())
    True
    >>> contiguous(torch.tensor([[1, 0, 1, 1]]).bool())
    False
    """
    key = storage_key(key_mask)
    answer = _last_checked.get(key, key_mask.device)  # every layer of a forward checks the one mask: read once
    if answer is not None:
        return answer
    kept = key_mask.sum(-1)  # (B,)
    first = key_mask.int().argmax(-1)  # (B,) first kept key (0 when none)
    last = key_mask.shape[-1] - 1 - key_mask.flip(-1).int().argmax(-1)  # (B,) last kept key
    answer = bool(((kept == 0) | (last - first + 1 == kept)).all())
    _last_checked.keep(key, key_mask.device, (key_mask,), answer)
    return answer


def keys_of_cache(per_key: torch.Tensor, key_length: int) -> torch.Tensor:
    """A model's per-key ALiBi ``(B, H, <= Lk)`` over all ``key_length`` keys: built from a padding mask of the
    tokens seen, it misses a static cache's unseen tail, which the mask hides; zeros there."""
    missing = key_length - per_key.shape[-1]
    return nn.functional.pad(per_key, (0, missing)) if missing > 0 else per_key  # (B, H, Lk)


def per_key_channel(query, key, value, per_key: torch.Tensor):
    """Fold an additive per-key term into one extra channel: ``[q, 1] . [k, b_j] = q . k + b_j``.

    ``per_key`` is ``(B, H, Lk)``, added to ``q . k`` *before* the logit scale. Key and value heads
    are repeated to the query's ``H`` (the term is per query head); the value gets a zero channel so
    that query, key and value share one head dimension (CPU SDPA's fused kernel wants that). On CUDA
    zero channels pad the head dimension to a multiple of 8 (:func:`relpos.backends._head_dim.fused_head_dim`).
    Returns ``(q, k, v)`` with ``d + 1`` channels or more; keep the output's first ``d``.
    """
    heads, dim = query.shape[1], query.shape[-1]
    zeros = fused_head_dim(dim + 1, query.device) - dim - 1  # padding channels after the extra one
    per_key = keys_of_cache(per_key, key.shape[2])  # (B, H, Lk)
    if key.shape[1] != heads:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)  # (B, H, Lk, d)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)  # (B, H, Lk, d)
    ones = nn.functional.pad(query.new_ones(*query.shape[:3], 1), (0, zeros))  # (B, H, Lq, 1 + zeros)
    query = torch.cat([query, ones], dim=-1)  # (B, H, Lq, d + 1 + zeros)
    per_key = nn.functional.pad(per_key.to(key.dtype)[..., None], (0, zeros))  # (B, H, Lk, 1 + zeros)
    key = torch.cat([key, per_key], dim=-1)  # (B, H, Lk, d + 1 + zeros)
    value = nn.functional.pad(value, (0, 1 + zeros))  # (B, H, Lk, d + 1 + zeros)
    return query, key, value


#: query rows up to which Bloom and Falcon take their own per-key ALiBi as a dense (B, H, Lq, Lk) term (:class:`PerKey`):
#: as small as the per-offset path's values there, exact for any padding, built once per step for every layer.
#: Falcon otherwise folds it into an extra channel, which would copy the whole key/value cache every layer (Falcon-RW
#: generation at L = 512: 224 against transformers' sdpa 187 ms, 18% of it in those copies); Bloom otherwise builds
#: its per-offset values, checks the padding's shape and finds the rows that see no key every step (its 2-layer
#: decoding step at 0.77x transformers' speed on the CPU, docs/benchmarks/gpu/decoding-step.md)
PER_KEY_ROWS = 16


@dataclass(frozen=True)
class PerKey:
    """A model's own per-key ALiBi ``values`` ``(B, H, <= Lk)``, added to the scores times ``factor`` after the logit
    scale: the exact term of a few query rows (a decoding step), with the model's own rounding (Bloom and Falcon build
    it in the model's dtype). For those rows a ``(B, H, Lq, Lk)`` term is small and needs none of the per-offset
    path's work per step (offsets, the padding's shape, rows that see no key)."""

    values: torch.Tensor
    factor: float

    def dense(self, query_length: int, key_length: int, dtype: torch.dtype) -> torch.Tensor:
        """``(B, H, Lq, Lk)`` in ``dtype``: the term each query row adds (zeros on a static cache's unseen keys)."""
        per_key = keys_of_cache(self.values, key_length)  # (B, H, Lk)
        return (per_key[:, :, None, :] * self.factor).to(dtype).expand(-1, -1, query_length, -1)


_last_terms = KeptResult()  # _decoding_terms()'s last inputs and terms


def _decoding_terms(bias: PerKey | torch.Tensor, key_mask: torch.Tensor | None, query_length: int, key_length: int,
                    position: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, Lq, Lk)``: ``bias`` with the padding and the causal mask folded in as the dtype's minimum, as
    transformers' sdpa path does (a row that sees no key gets uniform weights, as there).

    A :class:`PerKey`'s are kept: every layer of a decoding step passes the model's one per-key tensor and one mask,
    so the step builds them once (a dense tensor is the caller's own, built per call: never kept)."""
    named = () if not isinstance(bias, PerKey) else (bias.values,) if key_mask is None else (bias.values, key_mask)
    reusable = bool(named) and not torch.is_tensor(position) and may_reuse(bias.values.device)
    key = (tuple(map(storage_key, named)), bias.factor, query_length, key_length, position, dtype) if reusable else None
    kept = None if key is None else _last_terms.get(key, bias.values.device)
    if kept is not None:
        return kept
    dense = bias.dense(query_length, key_length, dtype) if isinstance(bias, PerKey) else bias  # (B, H, Lq, Lk)
    hidden = future_keys(query_length, key_length, position, device=dense.device)  # (Lq, Lk)
    if key_mask is not None:
        hidden = hidden | ~key_mask.bool()[:, None, None, :]  # (B, 1, Lq, Lk)
    terms = dense.masked_fill(hidden, torch.finfo(dense.dtype).min)  # (B, H, Lq, Lk)
    if key is not None:
        _last_terms.keep(key, bias.values.device, named, terms)
    return terms


def _decoding_rows(query, key, value, bias: PerKey | torch.Tensor, key_mask: torch.Tensor | None, scale: float,
                   position: torch.Tensor | int) -> torch.Tensor:
    """A few query rows without gradients (a decoding step): one SDPA call with the ``(B, H, Lq, Lk)``
    additive term (:func:`_decoding_terms`); none of the general path's per-call work, which costs more than
    these rows' attention."""
    terms = _decoding_terms(bias, key_mask, query.shape[2], key.shape[2], position, query.dtype)  # (B, H, Lq, Lk)
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=terms, scale=scale, **gqa)


#: devices whose long calls take a model's own per-key ALiBi (:class:`PerKey`) in the Triton kernel
#: (:func:`relpos.backends.dispatch.key_bias_attention`); tests add "cpu" to run it under Triton's interpreter
PER_KEY_KERNEL_DEVICES = ("cuda",)


def per_key_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   position: torch.Tensor | int | None, output_attentions: bool = False) -> bool:
    """Whether a call takes the model's own per-key ALiBi (:class:`PerKey`) in the Triton kernel, added to every
    tile's scores: on a GPU with triton, for the dtypes and head dimensions the kernel takes, with a 2-D padding mask
    or none, the queries the last keys (not a static cache's, at a tensor position), unless the weights are asked
    for or it is a decoding step (a few rows without gradients: one SDPA call with the dense term, which needs no
    launch of the kernel). Exact for any padding (Bloom's positions skip a mask's holes), with no ``(B, H, Lq, Lk)``
    term, no extra channel (Falcon's fold copied q, k and v and doubled the kernel's head dimension) and nothing
    read back to the CPU (Bloom checked whether its padding is one run of keys, every forward)."""
    query_length, key_length = query.shape[2], key.shape[2]
    at_end = position is None or (not torch.is_tensor(position) and position == key_length - query_length)
    decoding = query_length <= PER_KEY_ROWS and not torch.is_grad_enabled()
    return (query.device.type in PER_KEY_KERNEL_DEVICES and at_end and not decoding and not output_attentions
            and (mask is None or mask.dim() == 2) and key_bias_unavailable(query, value) is None)


_last_scaled = KeptResult()  # _scaled_per_key()'s last values and result


def _scaled_per_key(bias: PerKey, key_length: int) -> torch.Tensor:
    """(B, H, Lk) fp32: ``bias``'s values times its factor, detached; kept, so the layers of a forward that share the
    model's one per-key tensor hand the kernel one tensor (whose terms the kernel's wrapper keeps in turn)."""
    key = (storage_key(bias.values), bias.factor, key_length) if may_reuse(bias.values.device) else None
    kept = None if key is None else _last_scaled.get(key, bias.values.device)
    if kept is None:
        kept = (keys_of_cache(bias.values, key_length).detach().float() * bias.factor)  # (B, H, Lk)
        if key is not None:
            _last_scaled.keep(key, bias.values.device, (bias.values,), kept)
    return kept


def _per_key_in_kernel(query, key, value, bias: PerKey, mask: torch.Tensor | None, scale: float, dropout_p: float,
                       scores_learn: bool) -> torch.Tensor:
    """(B, H, Lq, dv): causal attention with ``bias``'s per-key values in the kernel; a row that sees no real key
    (left padding) gets the mean of the values, as in transformers."""
    query_length, key_length = query.shape[2], key.shape[2]
    out = key_bias_attention(query, key, value, key_bias=_scaled_per_key(bias, key_length), key_mask=mask,
                             causal=True, scale=scale, dropout_p=dropout_p, q_offset=key_length - query_length)
    if mask is None:
        return out
    dead, any_dead = _dead_rows(mask, query_length, key_length - query_length)  # (B, 1, Lq, 1)
    if any_dead:
        out = torch.where(dead, _uniform_rows(query, key, value, scale, scores_learn), out)  # (B, H, Lq, dv)
    return out


_last_dead = KeptResult()  # _dead_rows()'s last mask, query rows and answer


def _dead_rows(key_mask: torch.Tensor, query_length: int, position: torch.Tensor | int) -> tuple[torch.Tensor, bool]:
    """(B, 1, Lq, 1): queries that see no real key under the causal mask (left-padding positions); and whether any
    does (True, unread, where reading it back makes the CPU wait: on a GPU, under compile).

    The last is kept: every layer of a forward or a decoding step asks for the same mask's (five operators and a
    read back per layer, otherwise)."""
    reusable = not torch.is_tensor(position) and may_reuse(key_mask.device)  # never under compile (storage_key)
    key = (storage_key(key_mask), query_length, position) if reusable else None
    kept = None if key is None else _last_dead.get(key, key_mask.device)
    if kept is not None:
        return kept
    first = torch.where(key_mask.any(-1), key_mask.int().argmax(-1), key_mask.shape[-1])  # (B,)
    rows = torch.arange(query_length, device=key_mask.device) + position  # (Lq,)
    dead = (rows[None, :] < first[:, None])[:, None, :, None]  # (B, 1, Lq, 1)
    result = dead, branch_free(key_mask) or bool(dead.any())
    if key is not None:
        _last_dead.keep(key, key_mask.device, (key_mask,), result)
    return result


def _uniform_rows(query, key, value, scale: float, scores_learn: bool) -> torch.Tensor:
    """(B, H, Lq, dv): what transformers gives a query row whose every score holds the dtype's minimum.

    Forward: uniform weights over all ``Lk`` keys, the mean of the values. Backward, when the
    minimum was *added* to the scores (``scores_learn``): the gradient softmax has at uniform
    weights, ``d out_i / d s_ij = (v_j - mean v) / Lk``, reaching the queries and keys, computed
    through ``K^T V`` (``(d, dv)`` per head) instead of the ``(Lq, Lk)`` scores. When the minimum
    was *filled* in (``masked_fill``), no gradient reaches the scores.
    """
    heads, acc = query.shape[1], torch.promote_types(query.dtype, torch.float32)
    key = key.repeat_interleave(heads // key.shape[1], dim=1).to(acc)  # (B, H, Lk, d)
    value = value.repeat_interleave(heads // value.shape[1], dim=1).to(acc)  # (B, H, Lk, dv)
    mean = value.mean(dim=-2, keepdim=True)  # (B, H, 1, dv)
    if not scores_learn:
        return mean.to(query.dtype).expand(-1, -1, query.shape[2], -1)  # (B, H, Lq, dv)
    q = query.to(acc) * scale  # (B, H, Lq, d)
    weighted = q @ (key.transpose(-2, -1) @ value.detach()) / key.shape[2]  # (B, H, Lq, dv): mean_j s_ij v_j
    centre = q @ key.mean(dim=-2, keepdim=True).transpose(-2, -1)  # (B, H, Lq, 1): mean_j s_ij
    zero = (weighted - weighted.detach()) - (centre - centre.detach()) * mean.detach()  # value 0, gradient above
    return (mean + zero).to(query.dtype)  # (B, H, Lq, dv)


def _positioned(bias: ALiBi | torch.Tensor | None, heads: int, query_length: int, key_length: int,
                position: torch.Tensor | int, device) -> OffsetBias | torch.Tensor:
    """``bias`` for queries at a static cache's ``position``, every later key at ``-inf`` (attention then runs
    with ``causal=False``): an ALiBi or no bias (a caller's extra channel) per offset, a dense term masked."""
    if torch.is_tensor(bias):  # (B, H, Lq, Lk)
        return bias.masked_fill(future_keys(query_length, key_length, position, device=device), float("-inf"))
    if bias is None:
        return positioned_offsets(lambda rel: torch.zeros(heads, rel.numel(), device=device), query_length,
                                  key_length, position, device=device)
    return positioned_offsets(bias.bias_at, query_length, key_length, position, device=device)


def alibi_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: ALiBi | PerKey | torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    output_attentions: bool = False,
    scores_learn: bool = True,
    position: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of ``Lq`` queries over ``Lk`` keys, as the ALiBi families compute it.

    ``query`` ``(B, H, Lq, d)``, ``key``/``value`` ``(B, Hkv, Lk, d)``; ``bias`` a per-offset ALiBi, a
    model's per-key term (:class:`PerKey`) or a dense additive ``(B, H, Lq, Lk)`` one for a few query rows
    (decoding), or ``None`` when the caller
    folded its bias into the channels; ``mask`` the key padding mask ``(B, Lk)``
    or a boolean ``(B, 1, Lq, Lk)`` mask (``True`` = attend), causal or not (the causal mask is applied).
    ``position``: the cache position of the first query (:func:`cache_position`); None or ``Lk - Lq``:
    the queries are the last ``Lq`` keys. A static cache's (a tensor, or fewer than ``Lk - Lq``) takes
    the bias at that position with the keys after it hidden (:mod:`relpos.hf._positioned`).
    Returns ``(out (B, H, Lq, dv), weights (B, H, Lq, Lk) or None)``; rows that see no real key get
    the mean of the values (uniform weights), as in transformers, with its gradient
    (``scores_learn``: the model adds its mask, so those rows' scores still get gradients).
    """
    if isinstance(bias, PerKey) and per_key_kernel(query, key, value, mask, position, output_attentions):
        return _per_key_in_kernel(query, key, value, bias, mask, scale, dropout_p, scores_learn), None
    query_length, key_length = query.shape[2], key.shape[2]
    q_offset = key_length - query_length
    static = position is not None and (torch.is_tensor(position) or position != q_offset)
    position = position if static else q_offset
    dense_term = torch.is_tensor(bias) or isinstance(bias, PerKey)
    if dense_term and not output_attentions and not torch.is_grad_enabled() and (mask is None or mask.dim() == 2):
        return _decoding_rows(query, key, value, bias, mask, scale, position), None
    if isinstance(bias, PerKey):  # gradients, weights or a 4-D mask: the general path with the dense term
        bias = bias.dense(query_length, key_length, query.dtype)  # (B, H, Lq, Lk)
    if isinstance(bias, ALiBi) and bias.slopes.device != query.device:  # built on the CPU (or the model moved): once
        bias.to(query.device)
    if static:  # the causal mask at the cache position, in the bias
        bias = _positioned(bias, query.shape[1], query_length, key_length, position, query.device)
    masks = {} if mask is None else {"key_mask": mask} if mask.dim() == 2 else {"attn_mask": mask}
    common = dict(bias=bias, causal=not static, scale=scale, dropout_p=dropout_p, q_offset=0 if static else q_offset,
                  **masks)
    dead, any_dead = None, False
    if mask is not None and mask.dim() == 2:
        dead, any_dead = _dead_rows(mask, query_length, position)  # (B, 1, Lq, 1)
    elif mask is not None:
        future = future_keys(query_length, key_length, position, device=mask.device)  # (Lq, Lk)
        dead = ~(mask & ~future).any(-1, keepdim=True)  # (B, 1|H, Lq, 1)
        any_dead = branch_free(query) or bool(dead.any())
    if output_attentions:  # the eager reference, with an identity "value" so one call returns the weights
        eye = torch.eye(key_length, dtype=query.dtype, device=query.device)
        eye = eye.expand(query.shape[0], key.shape[1], -1, -1)  # (B, Hkv, Lk, Lk)
        weights = attention(query, key, eye, backend="eager", **common)  # (B, H, Lq, Lk)
        if dead is not None:
            weights = torch.where(dead, torch.full_like(weights, 1.0 / key_length), weights)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)  # (B, H, Lk, dv)
        return weights @ value, weights
    out = attention(query, key, value, **common)  # (B, H, Lq, dv)
    if any_dead:
        out = torch.where(dead, _uniform_rows(query, key, value, scale, scores_learn), out)  # (B, H, Lq, dv)
    return out, None
