"""Attention with a *learnable* Toeplitz bias at the speed of a frozen one (CPU).

SDPA falls back to its slow math kernel, holding (B, H, Lq, Lk), whenever a float mask
requires grad. This autograd Function keeps the fused kernel for the forward pass (the bias
enters as a detached zero-copy Hankel view; the queries arrive reversed) and computes every
gradient in the backward pass block by block over query rows:

    P  = exp(q k^T * scale + bias - logsumexp)          (rows r0:r1, all keys)
    dS = P * (dO v^T - rowsum(dO * O))
    dq = dS k * scale,  dk += dS^T q * scale,  dv += P^T dO
    d values[t] += sum over the block's anti-diagonal t of sum_b dS     (the bias gradient)

Only one (H, rows, Lk) block lives at a time (about 2**21 elements), never (B, H, Lq, Lk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .bias import hankel_view

__all__ = ["fused_available", "biased_attention_fused", "antidiagonal_sums"]

_BLOCK_ELEMENTS = 1 << 21  # measured best of 2**19 .. 2**24 on a 2-core CPU (docs/benchmarks.md)


def fused_available(query: torch.Tensor) -> bool:
    """The CPU flash kernel with logsumexp exists (torch >= 2.2) and takes this device and dtype."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


def antidiagonal_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., R, C) -> (..., R + C - 1) with ``out[t] = sum_{r + c = t} a[r, c]``.

    The skew trick: pad each row with R zeros, flatten, drop the last R entries and fold into
    rows of width C + R - 1; row r is then shifted right by r, so columns hold anti-diagonals.

    >>> antidiagonal_sums(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    tensor([1, 6, 8, 6])
    """
    rows, cols = a.shape[-2:]
    width = cols + rows - 1
    skewed = F.pad(a, (0, rows)).flatten(-2)[..., : rows * width].unflatten(-1, (rows, width))  # (..., R, R+C-1)
    return skewed.sum(-2)


class _BiasedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_rev, key, value, values, scale):  # q_rev: (B, H, Lq, d) queries reversed
        mask = hankel_view(values.detach().to(q_rev.dtype), key.shape[-2])  # (1, Hb, Lq, Lk) view
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_rev, key, value, 0.0, False, attn_mask=mask, scale=scale
        )
        ctx.save_for_backward(q_rev, key, value, values, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, values, out, lse = ctx.saved_tensors
        batch, heads, lq, dim = q.shape
        lk, bh, scale = k.shape[-2], batch * heads, ctx.scale
        acc = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 blocks are computed in fp32
        q3 = q.reshape(bh, lq, dim).to(acc)
        k3 = k.reshape(bh, lk, dim).to(acc)
        v3 = v.reshape(bh, lk, -1).to(acc)
        g3 = grad_out.reshape(bh, lq, -1).to(acc)
        mask = hankel_view(values.detach().to(acc), lk)[0]  # (Hb, Lq, Lk) view
        delta = (g3 * out.reshape(bh, lq, -1).to(acc)).sum(-1, keepdim=True)  # (BH, Lq, 1)
        lse3 = lse.reshape(bh, lq, 1).to(acc)
        dq, dk, dv = torch.empty_like(q3), torch.zeros_like(k3), torch.zeros_like(v3)
        dvalues = torch.zeros(values.shape, dtype=acc, device=values.device) if ctx.needs_input_grad[3] else None
        # Batch outermost: a block is (H, rows, Lk) whatever B is, so rows (the matmuls' M) stay large.
        rows = max(1, _BLOCK_ELEMENTS // (heads * lk))
        for b in range(batch):
            hs = slice(b * heads, (b + 1) * heads)  # this batch element's heads in the (B*H) layout
            kb, vb = k3[hs], v3[hs]  # (H, Lk, d)
            for r0 in range(0, lq, rows):
                r1 = min(lq, r0 + rows)
                qb, gb = q3[hs, r0:r1], g3[hs, r0:r1]  # (H, R, d)
                p = torch.bmm(qb, kb.transpose(1, 2)).mul_(scale).add_(mask[:, r0:r1])  # (H, R, Lk) logits
                p.sub_(lse3[hs, r0:r1]).exp_()  # probabilities
                ds = torch.bmm(gb, vb.transpose(1, 2)).sub_(delta[hs, r0:r1]).mul_(p)  # (H, R, Lk) dS
                dv[hs].baddbmm_(p.transpose(1, 2), gb)
                dq[hs, r0:r1] = torch.bmm(ds, kb)
                dk[hs].baddbmm_(ds.transpose(1, 2), qb)
                if dvalues is not None:
                    per_head = ds.sum(0, keepdim=True) if values.shape[0] == 1 else ds  # a shared bias sums heads
                    dvalues[:, r0 : r1 + lk - 1] += antidiagonal_sums(per_head)
        grads = (
            dq.mul_(scale).view(q.shape).to(q.dtype),
            dk.mul_(scale).view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype),
            None if dvalues is None else dvalues.to(values.dtype),
        )
        return (*grads, None)


def biased_attention_fused(
    q_rev: torch.Tensor, key: torch.Tensor, value: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of reversed queries with the Hankel view of ``values`` (H or 1, Lq + Lk - 1)."""
    return _BiasedAttention.apply(q_rev, key, value, values, scale)
