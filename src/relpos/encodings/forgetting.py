"""Forgetting gates: the Forgetting Transformer (FoX; Lin, Nikishin, He & Courville, ICLR 2025)
and data-dependent ALiBi.

Each head computes a forget gate from the input, ``f_t = sigmoid(w_f . x_t + b_f)`` (the paper's
``w_f``, ``b_f``: the rows and bias of ``fgate_proj``, FoX's name), and adds the log of the
gates between key and query to the logits:

``b[h, i, j] = sum_{l=j+1}^{i} log f_l = c_i - c_j``,  ``c_i = sum_{l<=i} log f_l``  (causal, ``j <= i``).

The row term ``c_i`` is the same for every key of a query and cancels in softmax: only the
per-key term ``-c_j`` matters. :func:`gated_attention` folds it into the dot product exactly,

``q' = [q, 1, 0...]``, ``k' = [k, -c_j / scale, 0...]``:  ``scale * q' . k' = scale * q . k - c_j``,

(``v`` zero-padded to the same width, so CPU SDPA keeps its flash kernel) and runs
:func:`relpos.attention` on ``q', k', v'`` with no bias: every backend, causal and padding masks
as usual, gradients into the gates through the attention's own backward, and never a
``(B, H, Lq, Lk)`` tensor. Decoding keeps the running sum ``c`` with the cache (one row per step).

Inference on CPU (no gradient; causal self-attention with no other mask, ``backend="auto"``) skips
the fold: ``-c_j`` enters SDPA's flash kernel as a row-stride-0 view of ``(B, H, 1, Lk)`` beside the
kernel's own causal mask, at head width ``d`` (1.06x of SDPA with no bias against the fold's 1.21x,
L = 2048, one thread). Training keeps the fold: the kernel gives no gradient into a mask.

Precision: the fold adds ``-c_j`` (which grows with the position) to ``q . k`` inside the dot
product, so fp32 rounds the logits to about ``|c_L| * 6e-8`` (``1e-4`` when the gates have forgotten
``e^-2000`` by the last key); bf16 and fp16 inputs are therefore computed in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_device, check_int, check_scale, check_shape, check_tensor
from ..backends._denormals import flushing
from ..backends._fused import fused_available
from ..backends.dispatch import Backend, attention

__all__ = ["ForgettingGate", "gated_attention"]

_ALIGN = 8  # the folded head width is rounded up to a multiple of this


def _fold(query, key, value, key_gate, scale):
    """q', k', v' of width ``round_up(max(d + 1, dv), 8)``, fp32 at least: one ``cat`` each (its backward
    is three slices; filling a buffer in place would copy the whole gradient once per filled slice)."""
    dtype = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
    dim, dv = query.shape[-1], value.shape[-1]
    width = -(-max(dim + 1, dv) // _ALIGN) * _ALIGN
    one = torch.ones((), dtype=dtype, device=query.device)
    zero = torch.zeros((), dtype=dtype, device=query.device)
    q = torch.cat([query.to(dtype), one.expand(*query.shape[:-1], 1), zero.expand(*query.shape[:-1], width - dim - 1)], -1)
    column = (-key_gate / scale).to(dtype)[..., None]  # (B, H, Lk, 1)
    k = torch.cat([key.to(dtype), column, zero.expand(*key.shape[:-1], width - dim - 1)], -1)  # (B, H, Lk, w)
    v = torch.cat([value.to(dtype), zero.expand(*value.shape[:-1], width - dv)], -1)  # (B, H, Lk, w)
    return q, k, v  # q: (B, H, Lq, w)


def _per_key_applies(query, key, value, key_gate, causal, attn_mask, key_mask, dropout_p, q_offset, backend) -> bool:
    """Inference on CPU, causal self-attention (L > 0, dv = d) with no other mask: one flash call with a per-key mask."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, key_gate))
    return (
        backend == "auto" and causal and q_offset == 0 and query.shape[2] == key.shape[2] > 0 and attn_mask is None
        and key_mask is None and not dropout_p and not needs_grad and fused_available(query)
        and value.shape[-1] == query.shape[-1]  # the flash kernel takes one head width
        and not torch.compiler.is_compiling()
    )


def _per_key_inference(query, key, value, key_gate, scale) -> torch.Tensor:
    """``softmax(scale q . k - c_j + causal) v`` in one call of SDPA's CPU flash kernel: ``-c_j`` enters as
    a ``(B, H, Lq, Lk)`` *view* of ``(B, H, 1, Lk)`` (row stride 0) beside the kernel's own ``is_causal``
    (which ``F.scaled_dot_product_attention`` refuses with a mask, the kernel does not). Head width stays
    ``d``: 1.06x of SDPA is_causal with no bias at L = 2048 (one thread) against 1.21x for the fold."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)  # (B, H, L, d)
    batch, heads, length, _ = q.shape
    mask = (-key_gate).to(dtype)[:, :, None, :].expand(batch, heads, length, length)  # (B, H, Lq, Lk) view
    with flushing(q):  # decayed gates: far keys' weights would be denormal floats (relpos.backends._denormals)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=mask, scale=scale)
    return out.to(query.dtype)  # (B, H, Lq, dv)


def gated_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_gate: torch.Tensor,
    *,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    q_offset: int = 0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``softmax(scale * q . k + c_i - c_j + mask) v`` with ``key_gate = c`` of the keys ``(B, H, Lk)``.

    Args as :func:`relpos.attention`; ``key_gate`` is the cumulative log forget gate of every key
    (:meth:`ForgettingGate.cumulative`); ``key``/``value`` heads may be grouped (repeated here,
    since each query head has its own gates). ``causal`` must hold whenever a query could see a
    later key: the gates define no bias for future keys.
    """
    check_tensor("query", query, shape="(B, H, Lq, d)")
    check_tensor("key", key, shape="(B, Hkv, Lk, d)")
    check_tensor("value", value, shape="(B, Hkv, Lk, dv)")
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"query and key must be 4-D (B, H, L, d), got {tuple(query.shape)} and {tuple(key.shape)}")
    batch, heads, query_length, _ = query.shape
    key_length = key.shape[2]
    check_shape("key_gate", key_gate, (batch, heads, key_length), meaning="(B, H, Lk)")
    causal = check_bool("causal", causal)  # read below before relpos.attention would check it
    scale = check_scale("scale", scale)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if scale == 0:
        raise ValueError("scale must be non-zero for gated_attention (the gate column is divided by it)")
    if not causal and key_length - 1 > q_offset and attn_mask is None:
        raise ValueError(
            "forgetting gates define no bias for future keys (j > i), but causal=False lets queries see them: "
            "pass causal=True (FoX and data-dependent ALiBi are causal)"
        )
    if key.shape[1] != heads and key.shape[1] and heads % key.shape[1] == 0:
        group = heads // key.shape[1]  # each query head has its own gates: share nothing
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # (B, H, Lk, d)
    if _per_key_applies(query, key, value, key_gate, causal, attn_mask, key_mask, dropout_p, q_offset, backend):
        return _per_key_inference(query, key, value, key_gate, scale)
    q, k, v = _fold(query, key, value, key_gate, scale)  # (B, H, L, w) each
    out = attention(q, k, v, causal=causal, attn_mask=attn_mask, key_mask=key_mask, dropout_p=dropout_p,
                    scale=scale, q_offset=q_offset, backend=backend)  # (B, H, Lq, w)
    return out[..., : value.shape[-1]].to(query.dtype)  # (B, H, Lq, dv)


class ForgettingGate(nn.Module):
    """FoX's forget gate: ``log f = logsigmoid(fgate_proj(x))``, one gate per head and token.

    Args:
        dim: width of the input ``x`` the gates are computed from (the model width).
        num_heads: heads, one gate each.
        bias: whether ``fgate_proj`` has the bias ``b_f`` (FoX: yes).

    ``cumulative(x)`` is ``c = cumsum(log f)`` ``(B, H, L)``; the bias it stands for is
    ``c_i - c_j`` (shown here with every gate ``f = 1/2``, so ``b = -(i - j) log 2``):

    >>> gate = ForgettingGate(1, num_heads=1)
    >>> with torch.no_grad():
    ...     _ = gate.fgate_proj.weight.zero_(), gate.fgate_proj.bias.zero_()
    >>> c = gate.cumulative(torch.zeros(1, 3, 1))[0, 0]
    >>> (c[:, None] - c[None, :]).tril()
    tensor([[ 0.0000,  0.0000,  0.0000],
            [-0.6931,  0.0000,  0.0000],
            [-1.3863, -0.6931,  0.0000]], grad_fn=<TrilBackward0>)
    """

    def __init__(
        self, dim: int, num_heads: int, *, bias: bool = True,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.dim = check_int("dim", dim, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.fgate_proj = nn.Linear(self.dim, self.num_heads, bias=check_bool("bias", bias), device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"

    def log_forget(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, L)`` ``log f_t`` of ``x (B, L, dim)``, in fp32 at least (the running sum grows)."""
        check_shape("x", x, (None, None, self.dim), meaning="(B, L, dim)")
        logits = self.fgate_proj(x)  # (B, L, H)
        return F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))).transpose(1, 2)  # (B, H, L)

    def cumulative(self, x: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        """``c (B, H, L)``: running sums of ``log f`` over ``x``'s tokens, after ``start`` ``(B, H)``
        (the last ``c`` of the tokens before, from a cache)."""
        c = self.log_forget(x).cumsum(-1)  # (B, H, L)
        if start is not None:
            check_shape("start", start, (c.shape[0], self.num_heads), meaning="(B, H)")
            c = c + start[..., None].to(c.dtype)  # (B, H, L)
        return c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cumulative(x)
