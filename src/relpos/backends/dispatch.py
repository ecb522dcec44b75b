"""Scaled dot-product attention with any relpos bias, on several backends.

``attention(q, k, v, bias=...)`` takes a relpos bias module, an :class:`OffsetBias`, or a
dense tensor. Backends:

* ``"eager"``: the readable reference (matmul, + bias, mask, softmax, matmul); the oracle.
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``. A relative bias enters as
  a zero-copy Hankel view of its per-offset values with the queries reversed (and the output
  reversed back): no (H, Lq, Lk) bias is allocated. With a bias that requires grad, SDPA runs
  its math kernel (it holds (B, H, Lq, Lk)).
* ``"fused"`` (CPU): the same forward on SDPA's fused kernel, and a backward that computes the
  bias-table gradient blockwise (:mod:`relpos.backends._fused`): training with a learnable table at
  about the cost of a frozen one.
* ``"flex"``: compiled ``flex_attention`` with a ``score_mod`` reading the per-offset vector.
  On CPU torch supports it for inference only; on GPU it trains (gradients into the table).

``"auto"`` picks one by device, dtype, whether gradients are needed, and the bias kind;
:func:`select_backend` returns the choice and why each other backend was not picked.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Literal, Union

import torch
import torch.nn.functional as F

from .._checks import check_bias_heads, check_bool, check_choice, check_device, check_int, check_scale, check_tensor
from ._denormals import flushing
from ._dropout import check_dropout_p, draw_seed, draw_seed_tensor, drop_weights
from ._fused import accumulate_dtype, flash_attention, fused_attention, fused_available, tiled_sdpa
from .._reuse import KeptResult, may_reuse, storage_key
from ._masks import KeyRanges, branch_free, check_attn_mask, check_key_mask, fold_key_mask, key_ranges
from . import _tiles
from ._tiles import Tile, plan_tiles
from ..core.bias import AdditiveBias, OffsetBias, hankel_view
from ..core.offsets import relative_positions

__all__ = ["Backend", "BiasLike", "BackendChoice", "attention", "resolve_bias", "select_backend"]

Backend = Literal["auto", "eager", "sdpa", "fused", "flex", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "eager", "sdpa", "fused", "flex", "triton")
BiasLike = Union[AdditiveBias, OffsetBias, torch.Tensor, None]
_FUSED_MIN_SCORES = 1 << 21  # B*H*Lq*Lk below which the math kernel beats the fused path (docs/benchmarks/attention/index.md)
_FLEX_MIN_HEAD_DIM = 16  # torch 2.11's flex lowering on CUDA: "embedding dimension ... must be at least 16"


def resolve_bias(
    bias: BiasLike, query_length: int, key_length: int, *, num_heads: int, q_offset: int = 0, device=None
) -> OffsetBias | torch.Tensor | None:
    """Turn any accepted ``bias`` into an :class:`OffsetBias`, a dense tensor, or ``None``."""
    query_length = check_int("query_length", query_length, minimum=0)  # 0: an empty call (zeros)
    key_length = check_int("key_length", key_length, minimum=0)
    num_heads = check_int("num_heads", num_heads, minimum=1)
    q_offset = check_int("q_offset", q_offset, minimum=0)
    return _resolve_bias(bias, query_length, key_length, num_heads, q_offset, check_device("device", device))


def _resolve_bias(bias: BiasLike, query_length: int, key_length: int, num_heads: int, q_offset: int, device):
    """:func:`resolve_bias` for arguments already checked (the attention call's own shapes)."""
    if bias is None:
        return None
    if isinstance(bias, AdditiveBias):
        check_bias_heads("bias", bias.num_heads, num_heads, query_length=query_length)
        return bias.resolve(query_length, key_length, q_offset=q_offset, device=device)
    if isinstance(bias, OffsetBias):
        got = (bias.query_length, bias.key_length, bias.q_offset)
        if got != (query_length, key_length, q_offset):
            raise ValueError(
                "bias (an OffsetBias) was built for (query_length, key_length, q_offset)="
                f"{got}, but the attention call has {(query_length, key_length, q_offset)}"
            )
        check_bias_heads("bias", bias.num_heads, num_heads, query_length=query_length)
        return bias
    if isinstance(bias, torch.Tensor):
        return bias
    raise TypeError(f"bias must be a relpos bias module, an OffsetBias, a tensor or None; got {type(bias).__name__}")


def check_defines_future(bias: BiasLike, causal: bool, key_length: int, q_offset: int, attn_mask) -> None:
    """Refuse a bias that defines nothing for future keys (causal ALiBi) where queries can see them."""
    future_visible = not causal and key_length - 1 > q_offset
    if isinstance(bias, AdditiveBias) and not bias.defines_future and future_visible and attn_mask is None:
        raise ValueError(
            f"{type(bias).__name__}({getattr(bias, 'mode', '')!r} mode) defines no bias for future keys, but this "
            "attention lets queries see them (causal=False): pass causal=True, or use the bidirectional form "
            "(ALiBi(mode='symmetric'))"
        )


@dataclass(frozen=True)
class BackendChoice:
    """The backend ``auto`` picks, and for every other backend why it was not picked."""

    backend: str
    reason: str
    rejected: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{self.backend}: {self.reason}"]
        lines += [f"  not {name}: {why}" for name, why in self.rejected.items()]
        return "\n".join(lines)


@dataclass(slots=True)
class _Call:
    """One attention call, validated and normalized once (what every backend reads; never changed after).

    Not ``frozen``: a frozen dataclass sets each field through ``object.__setattr__``, 1.2 us more per attention
    call (measured on the CPU machine of docs/benchmarks/gpu/decoding-step.md), which every decoding step pays per layer.
    """

    query: torch.Tensor  # (B, H, Lq, d)
    key: torch.Tensor  # (B, Hkv, Lk, d): Hkv divides H (grouped-query attention)
    value: torch.Tensor  # (B, Hkv, Lk, dv)
    bias: OffsetBias | torch.Tensor | None
    causal: bool  # the flag, or a causal mask recognised inside attn_mask
    attn_mask: torch.Tensor | None  # what stays a dense mask (None when reduced to key ranges)
    ranges: KeyRanges | None  # per-example kept keys; None: every key
    dropout_p: float
    scale: float
    q_offset: int
    dense_reason: str | None  # why only a dense (B, H, Lq, Lk) mask can express this call
    key_mask: torch.Tensor | None = None  # (B, Lk), when it is the only mask and no key ranges express it (holes)
    small: bool = False  # fewer scores than the per-offset machinery pays off for (_is_small)

    @property
    def key_length(self) -> int:
        return self.key.shape[2]

    @property
    def grouped(self) -> bool:
        return self.key.shape[1] != self.query.shape[1]

    def repeated_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v with each key/value head repeated for its query group (the paths that need equal heads)."""
        if not self.grouped:
            return self.key, self.value
        group = self.query.shape[1] // self.key.shape[1]
        return self.key.repeat_interleave(group, dim=1), self.value.repeat_interleave(group, dim=1)  # (B, H, Lk, d)

    def tiles(self) -> list[Tile]:
        ranges = None if self.ranges is None else tuple(zip(self.ranges.starts, self.ranges.ends))
        batch, _, query_length, _ = self.query.shape
        return plan_tiles(
            batch, query_length, self.key_length, q_offset=self.q_offset, causal=self.causal, key_ranges=ranges
        )

    def offset_values(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(Hb, Lq + Lk - 1) per-offset bias in ``dtype`` (default: the accumulation dtype), the causal mask
        folded in."""
        offsets = self.bias
        query_length = self.query.shape[2]
        if offsets is None:  # no bias: zeros carry the causal mask
            zeros = torch.zeros(1, query_length + self.key_length - 1, device=self.query.device)
            offsets = OffsetBias(zeros, query_length, self.key_length, self.q_offset)
        offsets = offsets.mask_future() if self.causal else offsets
        return offsets.values.to(dtype or accumulate_dtype(self.query.dtype))


def _is_small(batch: int, heads: int, query_length: int, key_length: int) -> bool:
    """Fewer scores than the per-offset machinery (tiles, blockwise backward) pays off for."""
    return batch * heads * query_length * key_length < _FUSED_MIN_SCORES


def _check_qkv(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, shape="(B, H, L, d)")
        if t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, L, d), got shape {tuple(t.shape)}")
    (batch, heads, query_length, dim), k_shape, v_shape = query.shape, key.shape, value.shape  # read once each
    if k_shape[0] != batch or v_shape[:3] != k_shape[:3]:
        raise ValueError(f"key and value must be (B={batch}, Hkv, Lk, d) alike, got key {tuple(k_shape)}, value {tuple(v_shape)}")
    if heads % k_shape[1]:
        hint = ""
        if query_length % k_shape[2] == 0:  # dims 1 and 2 swapped would be valid: (B, L, H, d) inputs
            hint = ("; if your tensors are laid out (B, L, H, d), pass query.transpose(1, 2) and the same for key and "
                    "value: relpos takes (B, H, L, d)")
        raise ValueError(f"key/value heads ({k_shape[1]}) must divide query heads ({heads}) for grouped-query attention{hint}")
    if k_shape[3] != dim:
        raise ValueError(f"key's last dimension must equal query's d={dim}, got {k_shape[3]}")
    if dim == 0 or v_shape[3] == 0:
        raise ValueError(f"the head dimension must be positive, got query d={dim} and value dv={v_shape[3]}")
    dtype, device = query.dtype, query.device
    if not dtype.is_floating_point or key.dtype != dtype or value.dtype != dtype:
        raise TypeError(
            "query, key and value must share one floating dtype (float16, bfloat16, float32 or float64), got "
            f"{dtype}, {key.dtype}, {value.dtype}; cast them with .to(dtype)"
        )
    if key.device != device or value.device != device:
        raise ValueError(
            f"query, key and value must be on one device, got {device}, {key.device}, {value.device}; "
            "move them with .to(device)"
        )


def _prepare(query, key, value, bias, causal, attn_mask, key_mask, dropout_p, scale, q_offset, *, backend="auto") -> _Call:
    """Validate once and normalize; key padding is recognised only where a backend can use it."""
    _check_qkv(query, key, value)
    batch, heads, query_length, dim = query.shape
    key_length = key.shape[2]
    causal = check_bool("causal", causal)
    q_offset = check_int("q_offset", q_offset, minimum=0)
    dropout_p = check_dropout_p("dropout_p", dropout_p)
    scale = check_scale("scale", scale)
    attn_mask = check_attn_mask(attn_mask, (batch, heads, query_length, key_length), device=query.device)
    key_mask = check_key_mask(key_mask, batch, key_length, device=query.device)
    resolved = _resolve_bias(bias, query_length, key_length, heads, q_offset, query.device)
    if isinstance(resolved, torch.Tensor):  # a dense bias: an additive float tensor like a float mask
        if not resolved.dtype.is_floating_point:
            raise TypeError(
                f"bias has dtype {resolved.dtype}: a dense bias is added to the logits and must be floating; "
                "a boolean or 0/1 mask belongs in attn_mask= (True = attend) or key_mask="
            )
        check_attn_mask(resolved, (batch, heads, query_length, key_length), name="bias", device=query.device)
    check_defines_future(bias, causal, key_length, q_offset, attn_mask)
    if causal and key_length - 1 <= q_offset:  # no query has a later key (a decoding row): nothing to hide
        causal = False
    ranges, dense_reason = None, None
    masked = attn_mask is not None or key_mask is not None
    only_keys = key_mask if attn_mask is None else None  # the Triton kernel takes it per key, any pattern
    compiling = torch.compiler.is_compiling()  # key ranges are data (tolist): a graph break under fullgraph
    small = _is_small(batch, heads, query_length, key_length)
    if masked and _key_mask_stays_on_device(query, value, resolved, attn_mask, key_mask, backend, compiling):
        # the Triton kernel takes the mask per key, and its key range from the mask on the device: reading the
        # runs back to the CPU (key_ranges) would stall the GPU twice per call, every layer of a padded batch
        dense_reason = "a key padding mask on the GPU: per key, read on the device (its runs are not read back to the CPU)"
        attn_mask = fold_key_mask(None, key_mask)
    elif masked and ((compiling and backend not in ("fused", "flex")) or (small and backend not in ("fused", "flex", "triton"))):
        dense_reason = (
            "under torch.compile a mask is one dense SDPA mask (key ranges would be a data-dependent branch)"
            if compiling
            else f"fewer than {_FUSED_MIN_SCORES} scores: one SDPA call with a small dense mask"
        )
        if key_mask is not None:
            attn_mask = fold_key_mask(attn_mask, key_mask)
    elif masked:
        ranges = key_ranges(attn_mask, key_mask, batch, query_length, key_length, q_offset=q_offset)
        if ranges is None:
            dense_reason = "the mask is not a key padding mask (one contiguous run of kept keys per example, optionally with a causal mask)"
            if key_mask is not None:
                attn_mask = fold_key_mask(attn_mask, key_mask)
        else:
            attn_mask, causal = None, causal or ranges.causal
            if ranges.covers_all(key_length):
                ranges = None
    if isinstance(resolved, torch.Tensor):
        dense_reason = "the bias is a dense tensor, not per-offset"
    return _Call(
        query, key, value, resolved, causal, attn_mask, ranges, dropout_p,
        1.0 / math.sqrt(dim) if scale is None else scale, q_offset, dense_reason,
        key_mask=only_keys if dense_reason else None, small=small,
    )


#: Devices whose key padding masks stay there (:func:`_key_mask_stays_on_device`); tests add "cpu" to run the
#: same path under Triton's interpreter.
_DEVICE_KEY_MASKS = ("cuda",)


def _key_mask_stays_on_device(query, value, bias, attn_mask, key_mask, backend, compiling: bool) -> bool:
    """A key padding mask alone on a GPU, where reading its runs back to the CPU would make the CPU wait: the
    Triton kernel reads it per key (``-inf`` on hidden keys) and skips the blocks outside each example's first to
    last kept key, both from the mask on the device; with no position term ``auto`` hands SDPA the mask as one
    ``(B, 1, 1, Lk)`` boolean mask, as transformers does, instead of one SDPA call per example."""
    if (key_mask is None or attn_mask is not None or compiling or isinstance(bias, torch.Tensor)
            or query.device.type not in _DEVICE_KEY_MASKS):
        return False
    triton_can = _TRITON_INSTALLED and _triton_refuses_inputs(query, value) is None
    return (backend == "auto" and (bias is None or triton_can)) or (backend == "triton" and triton_can)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _bias_grad(call: _Call) -> bool:
    return isinstance(call.bias, OffsetBias) and _needs_grad(call.bias.values)


def _flex_unavailable(call: _Call) -> str | None:
    if call.dense_reason:
        return f"flex reads a per-offset bias and key ranges; {call.dense_reason}"
    if call.dropout_p:
        return "flex_attention has no dropout"
    if call.query.device.type == "cpu" and (_bias_grad(call) or _needs_grad(call.query, call.key, call.value)):
        return "torch's FlexAttention has no backward on CPU"
    dims = (call.query.shape[-1], call.value.shape[-1])
    if call.query.device.type != "cpu" and min(dims) < _FLEX_MIN_HEAD_DIM:
        return f"FlexAttention's GPU kernel needs head dimensions of at least {_FLEX_MIN_HEAD_DIM}, got d={dims[0]}, dv={dims[1]}"
    return None


def _fused_unavailable(call: _Call) -> str | None:
    if call.dense_reason:
        return f"needs a per-offset bias and a key padding mask at most; {call.dense_reason}"
    if not fused_available(call.query):
        return f"needs torch's CPU flash kernel; query is {call.query.dtype} on {call.query.device.type}"
    return None


def _choose(call: _Call) -> BackendChoice:
    q = call.query
    bias_grad = _bias_grad(call)
    rejected = {"eager": "the reference path: materializes (B, H, Lq, Lk) scores; never chosen automatically"}
    flex_no, fused_no = _flex_unavailable(call), _fused_unavailable(call)
    if q.device.type != "cuda":
        triton_no = "a CUDA kernel (CPU tensors run it only under Triton's interpreter, for tests)"
    else:
        triton_no = _triton_unavailable(call)
    if triton_no is None and call.small:
        triton_no = f"fewer than {_FUSED_MIN_SCORES} scores: one SDPA call costs less than compiling the kernel's variant"
    elif triton_no is None and call.bias is None:
        triton_no = "no position term: SDPA's own flash/cuDNN kernels are faster"
    if triton_no is None:  # measured on an H100 (docs/benchmarks/gpu/kernel.md): the fastest route for a position term
        rejected.update(
            sdpa="SDPA reads the bias as an (Lq, Lk) view or copy, and its math kernel holds (B, H, Lq, Lk) for a table gradient",
            flex=flex_no or "FlexAttention gathers the bias per score and trains the table with per-score atomics",
            fused=fused_no or "fused is the CPU path",
        )
        return BackendChoice("triton", "position term on a CUDA GPU: the Triton kernel computes it inside each tile", rejected)
    rejected["triton"] = triton_no
    if call.dense_reason:
        rejected.update(fused=fused_no, flex=flex_no)
        return BackendChoice("sdpa", f"dense (B, H, Lq, Lk) mask: {call.dense_reason}", rejected)
    small = call.small
    small_why = f"fewer than {_FUSED_MIN_SCORES} scores: SDPA's math kernel is faster at this size and holds little memory"
    if call.dropout_p:
        if fused_no is None and small:
            rejected.update(fused=small_why, flex=flex_no)
            return BackendChoice("sdpa", "dropout on a small problem: one SDPA call (math kernel)", rejected)
        if fused_no is None:
            rejected.update(sdpa="SDPA's fused CPU kernels have no dropout: its math kernel holds (B, H, Lq, Lk)", flex=flex_no)
            return BackendChoice("fused", "dropout on CPU: blockwise forward and backward, no (B, H, Lq, Lk)", rejected)
        rejected.update(fused=fused_no, flex=flex_no)
        return BackendChoice("sdpa", f"dropout on {q.device.type}: SDPA's own kernels draw it", rejected)
    if bias_grad and fused_no is None and small:
        fused_no = small_why
    if bias_grad and fused_no is None:
        rejected.update(sdpa="the bias table needs a gradient: SDPA would fall back to its math kernel (B, H, Lq, Lk)")
        rejected.update(flex=flex_no or "fused is the CPU training path")
        return BackendChoice("fused", "learnable per-offset bias on CPU: fused forward, blockwise bias gradient", rejected)
    if bias_grad and q.device.type != "cpu" and flex_no is None and small:
        flex_no = f"fewer than {_FUSED_MIN_SCORES} scores: SDPA's math kernel holds little memory; flex compiles per shape"
    if bias_grad and q.device.type != "cpu" and flex_no is None:
        rejected.update(sdpa="the bias table needs a gradient: SDPA would hold a (B, H, Lq, Lk) bias gradient")
        rejected.update(fused=fused_no or "fused is the CPU path")
        return BackendChoice("flex", "learnable per-offset bias on GPU: flex trains captured tables", rejected)
    cuda_copies = _cuda_sdpa_copies(call)
    if cuda_copies and flex_no is None and not small:
        rejected.update(sdpa=cuda_copies, fused=fused_no or "fused is the CPU path")
        return BackendChoice("flex", "per-offset bias on GPU where SDPA would copy it: flex reads it per score", rejected)
    if call.bias is not None and fused_no is None and not small and _needs_grad(q, call.key, call.value):
        rejected.update(sdpa="torch runs SDPA's backward outside relpos, where denormal probabilities stay slow")
        rejected.update(flex=flex_no or "fused is the CPU training path")
        return BackendChoice("fused", "training on CPU: SDPA's flash kernel per tile, its backward with denormals flushed", rejected)
    rejected.update(fused=fused_no or "no gradient into the bias table: plain SDPA already runs fused")
    rejected.update(flex=flex_no or "compiles per shape (seconds); sdpa with a zero-copy view is as fast here")
    if bias_grad:
        return BackendChoice("sdpa", "no training path applies here, so SDPA's math kernel computes the bias gradient", rejected)
    what = "fused kernel, bias as a zero-copy view"
    if call.ranges is not None or call.causal:
        what += "; padding and the causal triangle skipped by tiles"
    return BackendChoice("sdpa", what, rejected)


def _cuda_sdpa_copies(call: _Call) -> str | None:
    """Why SDPA on CUDA would copy the bias view into a dense ``(B, H, Lq, Lk)`` tensor, or None.

    Measured on an H100 (torch 2.11, docs/benchmarks/gpu/index.md): cuDNN reads the view in place for bf16/fp16
    when the key range is whole; otherwise SDPA lands in its memory-efficient kernel, which copies the
    bias to align it (fp32 queries; padded tiles, whose key ranges end anywhere).
    """
    if call.bias is None or call.query.device.type != "cuda":
        return None
    if call.query.dtype not in (torch.bfloat16, torch.float16):
        return "in fp32 only SDPA's memory-efficient CUDA kernel takes a bias, and it copies the view to align it"
    if call.ranges is not None:
        return "padded tiles end at any key; SDPA's CUDA kernels then copy the view into an aligned dense bias"
    return None


def select_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: BiasLike = None,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    q_offset: int = 0,
) -> BackendChoice:
    """What ``attention(..., backend="auto")`` runs for these arguments, and why not the others.

    Takes the arguments :func:`attention` takes and refuses what it refuses. Rules: on a CUDA GPU,
    a per-offset bias (frozen or learnable, with causal, any key padding mask, grouped heads, dropout;
    eager or compiled) past 2**21 scores: ``triton`` (the position term computed inside each tile; needs
    triton).
    A dense bias, or a mask that is not key padding: ``sdpa`` with a dense mask. Other dropout:
    ``fused`` on CPU, ``sdpa`` elsewhere. A learnable per-offset bias: ``fused`` on CPU, ``flex`` on GPU
    without triton (both train the table without (B, H, L, L) memory). Otherwise ``sdpa`` on
    tiles with a zero-copy view. ``eager`` is the reference, never auto.
    """
    return _choose(_prepare(query, key, value, bias, causal, attn_mask, key_mask, dropout_p, scale, q_offset))


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: BiasLike = None,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    q_offset: int = 0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Attention ``softmax(q k^T * scale + bias + mask) v``.

    Args:
        query: ``(B, H, Lq, d)``; its queries are positions ``q_offset .. q_offset + Lq - 1``.
        key, value: ``(B, Hkv, Lk, d)`` and ``(B, Hkv, Lk, dv)``; ``Hkv`` divides ``H``
            (grouped-query attention: query head ``h`` reads key/value head ``h // (H / Hkv)``).
        bias: relpos bias module, :class:`OffsetBias`, or a tensor broadcastable to ``(B, H, Lq, Lk)``.
        causal: keys after the query's position are masked (``j > q_offset + i``).
        attn_mask: boolean (``True`` = attend) or floating (added), broadcastable to
            ``(B, H, Lq, Lk)``; integer masks are refused. A key padding mask ``(B, 1, 1, Lk)``, or
            transformers' ``(B, 1, Lq, Lk)`` padding + causal mask, is recognised and costs no
            ``(B, H, Lq, Lk)`` memory.
        key_mask: boolean ``(B, Lk)``, ``True`` where the key is a real token (transformers'
            ``attention_mask.bool()``): right or left padding at no (B, H, Lq, Lk) cost.
        dropout_p: probability of dropping each attention weight (applied whenever > 0, as in
            SDPA; modules pass it only in training). Seeded by torch's RNG.
        scale: logit scale; ``None`` means ``1/sqrt(d)`` (T5 uses ``1.0``).
        q_offset: cached tokens before the first query (decoding) or the query-to-key alignment.
        backend: ``"auto"``, ``"eager"``, ``"sdpa"``, ``"fused"``, ``"flex"`` or ``"triton"`` (CUDA;
            its bias gradient sums in a fixed order under ``torch.use_deterministic_algorithms(True)``).

    Returns ``(B, H, Lq, dv)`` in the query's dtype; bias, masks and softmax are computed in
    fp32 (fp64 for fp64 inputs) on every backend. A query row whose keys are all masked returns
    zeros (and zero gradients).
    """
    backend = check_choice("backend", backend, BACKENDS)
    call = _prepare(query, key, value, bias, causal, attn_mask, key_mask, dropout_p, scale, q_offset, backend=backend)
    chosen = _choose(call).backend if backend == "auto" else backend
    impl = _IMPLEMENTATIONS[chosen]
    why = impl.unavailable(call)
    if why:
        raise ValueError(
            f"backend={chosen!r} cannot run this call ({why}); use backend='auto' "
            "(relpos.select_backend says what it picks and why)"
        )
    return impl.run(call)


def _dense_mask(
    query: torch.Tensor,
    key_length: int,
    bias: OffsetBias | torch.Tensor | None,
    causal: bool,
    attn_mask: torch.Tensor | None,
    q_offset: int,
    key_keep: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Bias, causal mask, ``attn_mask`` and kept keys (B, Lk) summed into one additive tensor (or None): in
    ``dtype`` when nothing is added to the bias but ``-inf`` (no floating ``attn_mask``: hiding rounds nothing), else
    in fp32 (fp64 for fp64 queries)."""
    query_length = query.shape[2]
    if dtype is None or (attn_mask is not None and attn_mask.dtype != torch.bool):
        dtype = accumulate_dtype(query.dtype)
    total = None
    if bias is not None:
        total = (_dense_bias(bias) if isinstance(bias, OffsetBias) else bias).to(dtype)  # (1|B, H, Lq, Lk)
    blocked = None
    if causal:
        blocked = relative_positions(query_length, key_length, q_offset=q_offset, device=query.device) > 0  # (Lq, Lk)
    if key_keep is not None:
        hidden = ~key_keep[:, None, None, :]  # (B, 1, 1, Lk)
        blocked = hidden if blocked is None else blocked | hidden
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            blocked = ~attn_mask if blocked is None else blocked | ~attn_mask
        else:
            total = attn_mask.to(dtype) if total is None else total + attn_mask.to(dtype)
    if blocked is not None:
        base = torch.zeros((), dtype=dtype, device=query.device) if total is None else total
        total = base.masked_fill(blocked, float("-inf"))
    return total


def _dense_bias(bias: OffsetBias) -> torch.Tensor:
    """(1, H, Lq, Lk) bias to add (read, never written): with one query the per-offset values' view is it as it is
    (no copy); otherwise a copy with the rows in order."""
    return bias.hankel() if bias.query_length == 1 else bias.dense()


def masked_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; a row that is entirely ``-inf`` gives zeros (and finite gradients)."""
    if scores.shape[-1] == 0 or torch.compiler.is_compiling():  # no data-dependent branch in a compiled graph
        dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., Lq, 1): nothing to attend to
    else:
        dead = torch.isneginf(scores.amax(dim=-1, keepdim=True))  # (..., Lq, 1): one pass instead of two
        if not dead.any():  # the usual case (no padding row): nothing to mend
            return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


def _call_mask(call: _Call, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    keep = None if call.ranges is None else call.ranges.keep(call.key_length, device=call.query.device)
    return _dense_mask(call.query, call.key_length, call.bias, call.causal, call.attn_mask, call.q_offset, keep, dtype)


def _eager(call: _Call) -> torch.Tensor:
    """The reference: every step written out, in the accumulation dtype."""
    acc = accumulate_dtype(call.query.dtype)
    key, value = call.repeated_kv()
    q, k, v = call.query.to(acc), key.to(acc), value.to(acc)
    scores = (q @ k.transpose(-2, -1)) * call.scale  # (B, H, Lq, Lk)
    mask = _call_mask(call)
    if mask is not None:
        scores = scores + mask
    weights = masked_softmax(scores)  # (B, H, Lq, Lk)
    if call.dropout_p:
        weights = drop_weights(weights, call.dropout_p)  # (B, H, Lq, Lk)
    return (weights @ v).to(call.query.dtype)  # (B, H, Lq, dv)


def _sdpa(call: _Call) -> torch.Tensor:
    if call.small:  # a decoding step or a small problem: switching the flag on every thread would cost more
        return _sdpa_forward(call)
    with flushing(call.query):  # the forward only: torch runs this path's backward (relpos.backends._denormals)
        return _sdpa_forward(call)


def _sdpa_forward(call: _Call) -> torch.Tensor:
    q, k, v, p = call.query, call.key, call.value, call.dropout_p
    gqa = {"enable_gqa": True} if call.grouped else {}  # SDPA shares k/v heads itself: no copies
    if call.dense_reason is None:
        if call.bias is None and call.ranges is None and (not call.causal or call.q_offset == 0):
            if not (p or call.grouped or call.small or torch.compiler.is_compiling()) and fused_available(q) and _needs_grad(q, k, v):
                return flash_attention(q, k, v, call.causal, call.scale)  # the same kernel; its backward flushed
            return F.scaled_dot_product_attention(q, k, v, is_causal=call.causal, dropout_p=p, scale=call.scale, **gqa)
        values = call.offset_values(_sdpa_mask_dtype(q))  # (Hb, Lq + Lk - 1): one conversion at most
        if not torch.is_grad_enabled():
            values = values.detach()  # a view that requires grad would force SDPA's slow math kernel
        if call.ranges is None and (q.shape[2] <= _tiles.CAUSAL_CHUNK or torch.compiler.is_compiling()):
            # one view covers everything (no padding; causal triangle too small to skip, or shapes symbolic)
            hankel = hankel_view(values, call.key_length)  # (1, Hb, Lq, Lk) view, queries reversed
            if q.shape[2] == 1:  # one query (a decoding step): reversed is as it is, and flipping would copy
                return F.scaled_dot_product_attention(q, k, v, attn_mask=hankel, dropout_p=p, scale=call.scale, **gqa)
            return F.scaled_dot_product_attention(q.flip(-2), k, v, attn_mask=hankel, dropout_p=p, scale=call.scale, **gqa).flip(-2)
        if not call.small:
            return tiled_sdpa(q, k, v, values, call.tiles(), call.scale, p, enable_gqa=call.grouped)  # (B, H, Lq, dv)
        # a small causal problem: one SDPA call with a small dense mask beats one call per chunk
    mask, dead = _sdpa_mask(call)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=call.scale, **gqa)
    return out if dead is None else out.masked_fill(dead, 0.0)  # rows that see no key: 0


_last_sdpa_mask = KeptResult()  # _sdpa_mask()'s last key and result


def _sdpa_mask(call: _Call) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one mask a masked call hands SDPA, and its rows that see no key (they attend to every key there and
    their output is zeroed after; None when there are none, which is read back only where a branch costs nothing).

    The last one is kept: a model's layers ask for the same mask in turn (one bias and one padding mask per
    forward), so a decoding step builds it once, not once per layer (on a GPU four launches a layer)."""
    key, named = _sdpa_mask_key(call)
    kept = None if key is None else _last_sdpa_mask.get(key, call.query.device)
    if kept is not None:
        return kept
    dtype = _sdpa_mask_dtype(call.query)
    mask = _call_mask(call, dtype).to(dtype)  # (.., Lq, Lk) additive, built in that dtype (a boolean mask too:
    # SDPA would convert it on every call, two operators; built once, the layers that share it pay nothing)
    dead = torch.isneginf(mask).all(dim=-1, keepdim=True)
    if branch_free(call.query) or dead.any():
        result = mask.masked_fill(dead, 0.0), dead
    else:
        result = mask, None
    if key is not None:
        _last_sdpa_mask.keep(key, call.query.device, named, result)
    return result


def _sdpa_mask_key(call: _Call) -> tuple[tuple | None, tuple]:
    """What :func:`_sdpa_mask`'s result depends on, and the tensors it names by storage (kept alive with the result,
    so no other tensor can take their memory); None where nothing may be kept (:func:`relpos._reuse.may_reuse`, a
    bias that trains, key ranges)."""
    offsets = isinstance(call.bias, OffsetBias)
    values = call.bias.values if offsets else call.bias
    named = tuple(t for t in (values, call.attn_mask) if t is not None)
    trains = (values is not None and values.requires_grad) or (call.attn_mask is not None and call.attn_mask.requires_grad)
    if trains or call.ranges is not None or not may_reuse(call.query.device):
        return None, ()
    where = tuple(map(storage_key, named))
    geometry = (call.bias.query_length, call.bias.q_offset) if offsets else None
    q = call.query
    return (where, geometry, values is None, call.causal, call.q_offset, q.shape[:3], call.key_length, q.dtype, q.device), named


def _sdpa_mask_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype of the bias or mask handed to SDPA: fp32 (or fp64) on CPU, whose kernels take it with bf16
    and fp16 queries; the query's own dtype elsewhere. On CUDA, a bf16 query with an fp32 bias sends SDPA to
    cuDNN, which returned NaN for every row (torch 2.11, H100; docs/benchmarks/gpu/index.md), while the memory-efficient
    kernel refuses it; in the query's dtype cuDNN reads the view as it is (no copy) and is exact."""
    return accumulate_dtype(query.dtype) if query.device.type == "cpu" else query.dtype


def _fused(call: _Call) -> torch.Tensor:
    dropout = (draw_seed(), call.dropout_p) if call.dropout_p else None
    key, value = call.repeated_kv()  # the fused CPU kernel takes equal head counts
    return fused_attention(call.query, key, value, call.offset_values(), call.tiles(), call.scale, dropout)


def _flex(call: _Call) -> torch.Tensor:
    from ._flex import flex_biased_attention

    ranges = None if call.ranges is None else (call.ranges.starts, call.ranges.ends)
    q, (k, v) = call.query, call.repeated_kv()
    if not torch.is_grad_enabled():  # flex refuses inputs that require grad on CPU, even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    return flex_biased_attention(
        q, k, v, call.offset_values(), scale=call.scale, causal=call.causal, q_offset=call.q_offset, key_ranges=ranges
    )


_TRITON_MAX_HEAD_DIM = 256  # one (rows, head dim) block of q, k and v per tile must fit the SM's shared memory

#: Looked up once, without importing triton: ``find_spec`` of a module not yet imported searches sys.path
#: (37 us on this machine, which every decoding step paid).
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _triton_refuses_inputs(query: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs (their dtype, their head dimensions), or None."""
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernel takes float16, bfloat16 or float32, got {query.dtype}"
    if max(query.shape[-1], value.shape[-1]) > _TRITON_MAX_HEAD_DIM:
        return f"head dimensions above {_TRITON_MAX_HEAD_DIM} do not fit one tile"
    return None


def triton_unavailable(query: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why relpos's Triton kernels cannot run on these tensors here (triton missing, their device, dtype or head
    dimensions), or None: shared by ``backend="triton"`` and the decomposed positions' ``impl="triton"``."""
    if not _TRITON_INSTALLED:
        return "triton is not installed (it comes with CUDA builds of torch; pip install 'relpos[gpu]')"
    if query.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "CPU tensors run the Triton kernel only under its interpreter (TRITON_INTERPRET=1, for tests)"
    if query.device.type not in ("cpu", "cuda"):
        return f"the Triton kernel runs on CUDA GPUs, not {query.device.type}"
    return _triton_refuses_inputs(query, value)


def _triton_unavailable(call: _Call) -> str | None:
    q = call.query
    if call.dense_reason and (call.key_mask is None or isinstance(call.bias, torch.Tensor)):
        return f"the kernel reads a per-offset bias and a key padding mask; {call.dense_reason}"
    refused = triton_unavailable(q, call.value)
    if refused:
        return refused
    if q.shape[2] == 0 or call.key_length == 0:
        return "an empty query or key: nothing to compute"
    return None


def _triton_spec(call: _Call):
    from ._triton import BIAS_CAUSAL_LINEAR, BIAS_NONE, BIAS_OFFSETS, BIAS_SYMMETRIC_LINEAR, TritonSpec

    bias, kind, flat = call.bias, BIAS_NONE, None
    if bias is not None:
        trainable = _needs_grad(bias.values)
        if bias.linear is not None and not trainable:
            kind = BIAS_SYMMETRIC_LINEAR if bias.linear.symmetric else BIAS_CAUSAL_LINEAR
        else:
            kind, flat = BIAS_OFFSETS, (None if bias.flat is None else bias.flat_indices())
    deterministic = torch.are_deterministic_algorithms_enabled()  # the bias gradient's sum in a fixed order
    return TritonSpec(kind, call.causal, call.scale, call.q_offset, flat, deterministic, call.dropout_p)


def _triton(call: _Call) -> torch.Tensor:
    from ._triton import triton_attention

    spec = _triton_spec(call)
    bias, slopes = call.bias, None
    if bias is not None and bias.linear is not None:
        slopes = bias.linear.slopes.expand(call.query.shape[1])  # (H,): one head's slopes broadcast
    ranges = None if call.ranges is None else (call.ranges.starts, call.ranges.ends)
    values = None if bias is None else bias.values
    seed = draw_seed_tensor(call.query.device) if call.dropout_p else None  # one per call, as the fused path's
    return triton_attention(call.query, call.key, call.value, values=values, slopes=slopes, key_ranges=ranges,
                            key_mask=call.key_mask, seed=seed, spec=spec)


def key_bias_unavailable(query: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why :func:`key_bias_attention` cannot run on these tensors here (it runs only in the Triton kernel), or None."""
    return triton_unavailable(query, value)


def key_bias_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    key_bias: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    q_offset: int = 0,
) -> torch.Tensor:
    """``softmax(q k^T * scale + key_bias[b, h, j] + mask) v`` in the Triton kernel: a real-valued term per key and
    head, added to every tile's scores, exact for any key padding mask (holes too), nothing read back to the CPU.

    What the ALiBi families' own per-key form needs where it is not a function of the offset: Bloom counts positions
    past a padding mask's holes, Falcon hands its per-key values. ``key_bias``: ``(B|1, H|1, Lk)`` floating, added
    after the logit scale, with no gradient (a tensor that requires one is refused); the other arguments as in
    :func:`attention`. A query row that sees no key returns zeros. Raises ValueError where the kernel cannot run
    (:func:`key_bias_unavailable` says why: triton missing, a CPU tensor outside Triton's interpreter, a dtype or
    head dimension the kernel does not take)."""
    from ._triton import BIAS_NONE, TritonSpec, triton_attention

    _check_qkv(query, key, value)
    batch, heads, query_length, dim = query.shape
    key_length = key.shape[2]
    check_tensor("key_bias", key_bias, shape="(B|1, H|1, Lk)")
    if not key_bias.dtype.is_floating_point or key_bias.dim() != 3 or key_bias.shape[0] not in (1, batch) \
            or key_bias.shape[1] not in (1, heads) or key_bias.shape[2] != key_length:
        raise ValueError(f"key_bias must be a floating (B|1, H|1, Lk) = ({batch}|1, {heads}|1, {key_length}) tensor, got "
                         f"{key_bias.dtype} of shape {tuple(key_bias.shape)}")
    if key_bias.device != query.device:
        raise ValueError(f"key_bias is on {key_bias.device}, query on {query.device}; move it with .to(query.device)")
    if torch.is_grad_enabled() and key_bias.requires_grad:
        raise ValueError("key_bias gets no gradient here (the kernel adds it as a constant); pass key_bias.detach(), or "
                         "use attention(bias=...) for a term that learns")
    causal, q_offset = check_bool("causal", causal), check_int("q_offset", q_offset, minimum=0)
    dropout_p, scale = check_dropout_p("dropout_p", dropout_p), check_scale("scale", scale)
    key_mask = check_key_mask(key_mask, batch, key_length, device=query.device)
    refused = key_bias_unavailable(query, value) or (
        "an empty query or key: nothing to compute" if query_length == 0 or key_length == 0 else None)
    if refused:
        raise ValueError(f"key_bias_attention cannot run this call: {refused}")
    spec = TritonSpec(BIAS_NONE, causal and key_length - 1 > q_offset, 1.0 / math.sqrt(dim) if scale is None else scale,
                      q_offset, None, torch.are_deterministic_algorithms_enabled(), dropout_p, key_real=True)
    seed = draw_seed_tensor(query.device) if dropout_p else None
    return triton_attention(query, key, value, values=None, slopes=None, key_ranges=None, key_mask=key_mask,
                            key_bias=key_bias, seed=seed, spec=spec)  # (B, H, Lq, dv)


@dataclass(frozen=True)
class _Implementation:
    """A backend's one shape: why it cannot run a call (``None`` when it can), and how it runs one."""

    unavailable: Callable[[_Call], str | None]
    run: Callable[[_Call], torch.Tensor]


_IMPLEMENTATIONS: dict[str, _Implementation] = {
    "eager": _Implementation(lambda call: None, _eager),  # the reference runs every call
    "sdpa": _Implementation(lambda call: None, _sdpa),  # a dense mask covers what the tiles cannot
    "fused": _Implementation(_fused_unavailable, _fused),
    "flex": _Implementation(_flex_unavailable, _flex),
    "triton": _Implementation(_triton_unavailable, _triton),
}
