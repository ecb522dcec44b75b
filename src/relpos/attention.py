"""Scaled dot-product attention with any relpos bias.

``attention(q, k, v, bias=...)`` takes a relpos bias module, an :class:`OffsetBias`, or a
dense tensor. Backends:

* ``"eager"``: the readable reference (matmul, + bias, mask, softmax, matmul); the oracle.
* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``. A relative bias enters as
  a zero-copy Hankel view of its per-offset values with the queries reversed (and the
  output reversed back), so no (H, Lq, Lk) bias is ever allocated.

``"auto"`` picks ``"sdpa"``.
"""

from __future__ import annotations

import math
from typing import Literal, Union

import torch
import torch.nn.functional as F

from ._checks import check_bool, check_choice, check_int
from .bias import AdditiveBias, OffsetBias
from .buckets import relative_positions

__all__ = ["Backend", "BiasLike", "attention", "resolve_bias"]

Backend = Literal["auto", "eager", "sdpa"]
BiasLike = Union[AdditiveBias, OffsetBias, torch.Tensor, None]


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
    raise TypeError(
        f"bias must be a relpos bias module, an OffsetBias, a tensor or None; got {type(bias).__name__}"
    )


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
        key, value: ``(B, H, Lk, d)`` and ``(B, H, Lk, dv)``.
        bias: relpos bias module, :class:`OffsetBias`, or a tensor broadcastable to ``(B, H, Lq, Lk)``.
        causal: keys after the query's position are masked (``j > q_offset + i``).
        attn_mask: boolean (``True`` = attend) or additive, broadcastable to ``(B, H, Lq, Lk)``.
        scale: logit scale; ``None`` means ``1/sqrt(d)`` (T5 uses ``1.0``).
        q_offset: cached tokens before the first query (decoding) or the query-to-key alignment.
        backend: ``"auto"``, ``"eager"`` or ``"sdpa"``.

    Returns ``(B, H, Lq, dv)``. A query row whose keys are all masked returns zeros.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, H, L, d), got {shape}")
    batch, heads, query_length, dim = query.shape
    if key.shape[:2] != (batch, heads) or value.shape[:2] != (batch, heads) or key.shape[2] != value.shape[2]:
        raise ValueError(
            f"key and value must be (B={batch}, H={heads}, Lk, d), got key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape[3] != dim:
        raise ValueError(f"key's last dimension must equal query's d={dim}, got {key.shape[3]}")
    causal = check_bool("causal", causal)
    q_offset = check_int("q_offset", q_offset, minimum=0)
    backend = check_choice("backend", backend, ("auto", "eager", "sdpa"))
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    key_length = key.shape[2]
    resolved = resolve_bias(bias, query_length, key_length, num_heads=heads, q_offset=q_offset, device=query.device)
    if backend == "eager":
        return _eager(query, key, value, resolved, causal, attn_mask, scale, q_offset)
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


def _eager(query, key, value, bias, causal, attn_mask, scale, q_offset) -> torch.Tensor:
    scores = (query @ key.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    mask = _dense_mask(query, key.shape[2], bias, causal, attn_mask, q_offset)
    if mask is not None:
        scores = scores + mask
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, H, Lq, 1): nothing to attend to
    weights = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)  # (B, H, Lq, Lk)
    return weights @ value  # (B, H, Lq, dv)


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
