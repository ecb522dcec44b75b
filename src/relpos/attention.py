"""Scaled dot-product attention with any relpos bias, on several backends.

``attention(q, k, v, bias=...)`` takes a relpos bias module, an :class:`OffsetBias`, or a
dense tensor. Backends:

* ``"eager"``: the readable reference (matmul, + bias, mask, softmax, matmul); the oracle.
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``. A relative bias enters as
  a zero-copy Hankel view of its per-offset values with the queries reversed (and the output
  reversed back): no (H, Lq, Lk) bias is allocated. With a bias that requires grad, SDPA runs
  its math kernel (it holds (B, H, Lq, Lk)).
* ``"fused"`` (CPU): the same forward on SDPA's fused kernel, and a backward that computes the
  bias-table gradient blockwise (:mod:`relpos._fused`): training with a learnable table at
  about the cost of a frozen one.
* ``"flex"``: compiled ``flex_attention`` with a ``score_mod`` reading the per-offset vector.
  On CPU torch supports it for inference only; on GPU it trains (gradients into the table).

``"auto"`` picks one by device, dtype, whether gradients are needed, and the bias kind;
:func:`select_backend` returns the choice and why each other backend was not picked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Union

import torch
import torch.nn.functional as F

from ._checks import check_bool, check_choice, check_int
from ._fused import biased_attention_fused, fused_available
from .bias import AdditiveBias, OffsetBias
from .buckets import relative_positions

__all__ = ["Backend", "BiasLike", "BackendChoice", "attention", "resolve_bias", "select_backend"]

Backend = Literal["auto", "eager", "sdpa", "fused", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "eager", "sdpa", "fused", "flex")
BiasLike = Union[AdditiveBias, OffsetBias, torch.Tensor, None]
_FUSED_MIN_SCORES = 1 << 21  # B*H*Lq*Lk below which the math kernel beats the fused path (docs/benchmarks.md)


def resolve_bias(
    bias: BiasLike, query_length: int, key_length: int, *, num_heads: int, q_offset: int = 0, device=None
) -> OffsetBias | torch.Tensor | None:
    """Turn any accepted ``bias`` into an :class:`OffsetBias`, a dense tensor, or ``None``."""
    if bias is None:
        return None
    if isinstance(bias, AdditiveBias):
        if bias.num_heads not in (1, num_heads):
            raise ValueError(f"bias has num_heads={bias.num_heads} but the query has {num_heads} heads")
        if bias.translation_invariant:
            return bias.offsets(query_length, key_length, q_offset=q_offset, device=device)
        return bias.materialize(query_length, key_length, q_offset=q_offset, device=device)
    if isinstance(bias, OffsetBias):
        got = (bias.query_length, bias.key_length, bias.q_offset)
        if got != (query_length, key_length, q_offset):
            raise ValueError(
                "bias (an OffsetBias) was built for (query_length, key_length, q_offset)="
                f"{got}, but the attention call has {(query_length, key_length, q_offset)}"
            )
        if bias.num_heads not in (1, num_heads):
            raise ValueError(f"bias has num_heads={bias.num_heads} but the query has {num_heads} heads")
        return bias
    if isinstance(bias, torch.Tensor):
        return bias
    raise TypeError(f"bias must be a relpos bias module, an OffsetBias, a tensor or None; got {type(bias).__name__}")


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


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _flex_unavailable(query: torch.Tensor, bias, attn_mask, needs_grad: bool) -> str | None:
    if not isinstance(bias, OffsetBias):
        return "flex reads a per-offset bias; this bias is dense or absent"
    if attn_mask is not None:
        return "attn_mask is not supported by the flex path (use a causal flag or another backend)"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch >= 2.5 has it
        return "this torch has no torch.nn.attention.flex_attention"
    if query.device.type == "cpu" and needs_grad:
        return "torch's FlexAttention has no backward on CPU"
    return None


def select_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: OffsetBias | torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> BackendChoice:
    """What ``backend="auto"`` runs for these inputs, and why not the others.

    Rules: no gradient into the bias, or a dense bias: ``sdpa`` (zero-copy view, fused kernel).
    A learnable per-offset bias: ``fused`` on CPU, ``flex`` on GPU (both train the table without
    (B, H, L, L) memory), else ``sdpa`` (math kernel). ``eager`` is the reference, never auto.
    """
    bias_grad = isinstance(bias, OffsetBias) and _needs_grad(bias.values)
    needs_grad = bias_grad or _needs_grad(query, key, value)
    rejected = {"eager": "the reference path: materializes (B, H, Lq, Lk) scores; never chosen automatically"}
    flex_no = _flex_unavailable(query, bias, attn_mask, needs_grad)
    fused_no = None
    if not isinstance(bias, OffsetBias) or attn_mask is not None:
        fused_no = "needs a per-offset bias and no attn_mask"
    elif not fused_available(query):
        fused_no = f"needs torch's CPU flash kernel; query is {query.dtype} on {query.device.type}"
    if bias_grad and fused_no is None and query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] < _FUSED_MIN_SCORES:
        fused_no = f"fewer than {_FUSED_MIN_SCORES} scores: SDPA's math kernel is faster at this size and holds little memory"
    if bias_grad and fused_no is None:
        rejected["sdpa"] = "the bias table needs a gradient: SDPA would fall back to its math kernel (B, H, Lq, Lk)"
        rejected["flex"] = flex_no or "fused is the CPU training path"
        return BackendChoice("fused", "learnable per-offset bias on CPU: fused forward, blockwise bias gradient", rejected)
    if bias_grad and query.device.type != "cpu" and flex_no is None:
        rejected["sdpa"] = "the bias table needs a gradient: SDPA would hold a (B, H, Lq, Lk) bias gradient"
        rejected["fused"] = fused_no or "fused is the CPU path"
        return BackendChoice("flex", "learnable per-offset bias on GPU: flex trains captured tables", rejected)
    rejected["fused"] = fused_no or "no gradient into the bias table: plain SDPA already runs fused"
    rejected["flex"] = flex_no or "compiles per shape (seconds); sdpa with a zero-copy view is as fast here"
    reason = "fused kernel, bias as a zero-copy view" if isinstance(bias, OffsetBias) and attn_mask is None else "dense mask"
    if bias_grad:
        reason = "no training path applies here, so SDPA's math kernel computes the bias gradient"
    return BackendChoice("sdpa", reason, rejected)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: BiasLike = None,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
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
        attn_mask: boolean (``True`` = attend) or additive, broadcastable to ``(B, H, Lq, Lk)``.
        scale: logit scale; ``None`` means ``1/sqrt(d)`` (T5 uses ``1.0``).
        q_offset: cached tokens before the first query (decoding) or the query-to-key alignment.
        backend: ``"auto"``, ``"eager"``, ``"sdpa"``, ``"fused"`` or ``"flex"``.

    Returns ``(B, H, Lq, dv)``. A query row whose keys are all masked returns zeros.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, H, L, d), got {shape}")
    batch, heads, query_length, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != batch or value.shape[:2] != key.shape[:2] or key.shape[2] != value.shape[2]:
        raise ValueError(
            f"key and value must be (B={batch}, Hkv, Lk, d) alike, got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if heads % kv_heads:
        raise ValueError(f"key/value heads ({kv_heads}) must divide query heads ({heads}) for grouped-query attention")
    if key.shape[3] != dim:
        raise ValueError(f"key's last dimension must equal query's d={dim}, got {key.shape[3]}")
    causal = check_bool("causal", causal)
    q_offset = check_int("q_offset", q_offset, minimum=0)
    backend = check_choice("backend", backend, BACKENDS)
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if kv_heads != heads:  # grouped-query attention: share each key/value head across its group
        key = key.repeat_interleave(heads // kv_heads, dim=1)  # (B, H, Lk, d)
        value = value.repeat_interleave(heads // kv_heads, dim=1)  # (B, H, Lk, dv)
    key_length = key.shape[2]
    resolved = resolve_bias(bias, query_length, key_length, num_heads=heads, q_offset=q_offset, device=query.device)
    if backend == "auto":
        backend = select_backend(query, key, value, bias=resolved, attn_mask=attn_mask).backend
    if backend == "eager":
        return _eager(query, key, value, resolved, causal, attn_mask, scale, q_offset)
    if backend in ("fused", "flex"):
        if not isinstance(resolved, OffsetBias) or attn_mask is not None:
            raise ValueError(
                f"backend={backend!r} needs a relative (per-offset) bias and no attn_mask; "
                "use backend='sdpa' or 'eager' for dense biases and masks"
            )
        if backend == "fused":
            if not fused_available(query):
                raise ValueError(
                    f"backend='fused' runs on CPU with float tensors, got {query.dtype} on {query.device.type}; "
                    "use backend='flex' on GPU"
                )
            offsets = resolved.mask_future() if causal else resolved
            out = biased_attention_fused(query.flip(-2), key, value, offsets.values, scale)
            return out.flip(-2)  # (B, H, Lq, dv)
        why = _flex_unavailable(query, resolved, attn_mask, _needs_grad(query, key, value, resolved.values))
        if why:
            raise ValueError(f"backend='flex' is unavailable: {why}")
        from ._flex import flex_biased_attention

        return flex_biased_attention(query, key, value, resolved, causal=causal, scale=scale)
    return _sdpa(query, key, value, resolved, causal, attn_mask, scale, q_offset)


def _dense_mask(
    query: torch.Tensor,
    key_length: int,
    bias: OffsetBias | torch.Tensor | None,
    causal: bool,
    attn_mask: torch.Tensor | None,
    q_offset: int,
) -> torch.Tensor | None:
    """Bias, causal mask and ``attn_mask`` summed into one additive tensor (or ``None``)."""
    query_length, dtype = query.shape[2], query.dtype
    total = None
    if bias is not None:
        total = (bias.dense() if isinstance(bias, OffsetBias) else bias).to(dtype)  # (1|B, H, Lq, Lk)
    blocked = None
    if causal:
        blocked = relative_positions(query_length, key_length, q_offset=q_offset, device=query.device) > 0  # (Lq, Lk)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            blocked = ~attn_mask if blocked is None else blocked | ~attn_mask
        else:
            total = attn_mask.to(dtype) if total is None else total + attn_mask.to(dtype)
    if blocked is not None:
        base = torch.zeros((), dtype=dtype, device=query.device) if total is None else total
        total = base.masked_fill(blocked, float("-inf"))
    return total


def masked_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim; a row that is entirely ``-inf`` gives zeros (and finite gradients)."""
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., Lq, 1): nothing to attend to
    return torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


def _eager(query, key, value, bias, causal, attn_mask, scale, q_offset) -> torch.Tensor:
    scores = (query @ key.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    mask = _dense_mask(query, key.shape[2], bias, causal, attn_mask, q_offset)
    if mask is not None:
        scores = scores + mask
    return masked_softmax(scores) @ value  # (B, H, Lq, dv)


def _sdpa(query, key, value, bias, causal, attn_mask, scale, q_offset) -> torch.Tensor:
    if isinstance(bias, OffsetBias) and attn_mask is None:
        # Toeplitz bias (causal mask folded in) as a Hankel view: reverse the queries, not the bias.
        offsets = (bias.mask_future() if causal else bias).to(query.dtype)
        hankel = offsets.hankel()  # (1, H, Lq, Lk) view, no copy
        if not torch.is_grad_enabled():
            hankel = hankel.detach()  # a view that requires grad would force SDPA's slow math kernel
        out = F.scaled_dot_product_attention(query.flip(-2), key, value, attn_mask=hankel, scale=scale)
        return out.flip(-2)  # (B, H, Lq, dv)
    if bias is None and attn_mask is None and (not causal or q_offset == 0):
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    mask = _dense_mask(query, key.shape[2], bias, causal, attn_mask, q_offset)  # (.., Lq, Lk)
    dead = torch.isneginf(mask).all(dim=-1, keepdim=True)  # rows with nothing to attend to
    if dead.any():
        mask = mask.masked_fill(dead, 0.0)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
        return out.masked_fill(dead, 0.0)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
