"""Decomposed 2D relative positions (MViTv2, SAM, ViTDet) inside a flash-attention kernel (Triton).

The logit of query ``i`` and key ``j = y' Kw + x'`` (keys in raster order on a ``Kh x Kw`` grid)::

    s[i, j] = scale * q_i . k_j + rel_h[i, y'] + rel_w[i, x']

The kernels visit the keys as the grid they are: a block of ``BN`` columns, then every key row ``y'`` of them. In
every such tile ``rel_h`` adds one value per query row and ``rel_w`` a ``(BM, BN)`` block, read once per column
block (the same for every row), so the ``(N, K)`` bias never exists, in the forward or the backward:

* forward: online softmax in fp32 over the tiles, in base 2 (the logits scaled by ``log2(e)`` as they are formed,
  ``exp2`` for the weights), the base-2 log-sum-exp kept for the backward; the inner loop runs over
  the key rows (``Kh`` steps: 64 for SAM ViT-B's global layers), which Triton's pipeliner overlaps;
* ``dk, dv``: one program per key tile (a row's column block), looping over the query blocks;
* ``dq, d rel_h, d rel_w``: one program per query block, looping over column blocks, then over the rows, so
  ``d rel_w``'s ``(BM, BN)`` block sums in registers over the rows and is stored once; ``d rel_h[i, y']`` gets
  each tile's row sums of ``dS`` by an atomic add (``BM`` of them per tile, never two programs on one address);
* ``delta = rowsum(dO * O)`` is one torch operator on the host.

The kernels also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the test
suite checks them against the ``"reference"`` path of :func:`relpos.encodings.decomposed.decomposed_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import _LOG2E, INTERPRETED, _cdiv, _pow2, _precision  # the main kernel's: interpreter, arithmetic, dot precision

__all__ = ["decomposed_triton"]


@triton.jit
def _rel_w_block(rw_ptrs, rows_ok, cols_ok):
    """(BM, BN) ``rel_w[i, x']`` of one column block, in its storage dtype, ``-inf`` on columns past Kw (so a tile's
    logits need no column mask): the same block serves every key row of those columns."""
    bw = tl.load(rw_ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    return tl.where(cols_ok[None, :], bw, float("-inf"))


@triton.jit
def _scores(q, k, rh_ptrs, bw, rows_ok, scale, PRECISION: tl.constexpr):
    """(BM, BN) logits of one tile in base 2, ``log2(e) (scale q.k + rel_h[i, y'] + rel_w[i, x'])`` (``bw``:
    :func:`_rel_w_block`): two fused multiply-adds per score, and ``exp2`` of them needs no multiply."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (scale * _LOG2E)  # (BM, BN)
    bh = tl.load(rh_ptrs, mask=rows_ok, other=0.0).to(tl.float32) * _LOG2E  # (BM,): one key row's rel_h
    return s + bh[:, None] + bw.to(tl.float32) * _LOG2E


@triton.jit
def _rows(base, offs, ok, width, offs_d, D: tl.constexpr):
    """(rows, D_PAD) block of a row-major ``(rows, D)`` tensor; zeros outside ``ok`` and past ``D``."""
    return tl.load(base + offs[:, None] * width + offs_d[None, :], mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _query_block(Q, RH, RW, pid_m, bh, N, Kh, Kw, offs_d, D: tl.constexpr, BM: tl.constexpr):
    """One program's query rows: their indices, which exist, the ``(BM, D_PAD)`` queries, and pointers to each row
    of ``rel_h`` and ``rel_w``."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    rows_ok = offs_m < N
    q = _rows(Q + bh * N * D, offs_m, rows_ok, D, offs_d, D)  # (BM, D_PAD)
    return offs_m, rows_ok, q, RH + bh * N * Kh + offs_m * Kh, RW + bh * N * Kw + offs_m * Kw  # (BM,) pointers


@triton.jit
def _key_tile(q, k_base, v_base, rh_row, bw, rows_ok, r, cols, cols_ok, Kw, scale, offs_d, offs_dv, D: tl.constexpr,
              DV: tl.constexpr, PRECISION: tl.constexpr):
    """Key row ``r``'s columns ``cols``: their keys ``(BN, D_PAD)``, values ``(BN, DV_PAD)`` and the tile's logits."""
    k = _rows(k_base, r * Kw + cols, cols_ok, D, offs_d, D)  # (BN, D_PAD)
    v = _rows(v_base, r * Kw + cols, cols_ok, DV, offs_dv, DV)  # (BN, DV_PAD)
    return k, v, _scores(q, k, rh_row + r, bw, rows_ok, scale, PRECISION)


@triton.jit
def _fwd_kernel(Q, K, V, RH, RW, O, LSE, N, Kh, Kw, scale, D: tl.constexpr, DV: tl.constexpr,
                D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_d, offs_dv, offs_c = tl.arange(0, D_PAD), tl.arange(0, DV_PAD), tl.arange(0, BN)
    offs_m, rows_ok, q, rh_row, rw_row = _query_block(Q, RH, RW, pid_m, bh, N, Kh, Kw, offs_d, D, BM)
    k_base, v_base = K + bh * Kh * Kw * D, V + bh * Kh * Kw * DV
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV_PAD], tl.float32)
    for c0 in range(0, Kw, BN):  # columns c0 + offs_c of every key row: rel_w read once for all of them
        cols = c0 + offs_c
        cols_ok = cols < Kw
        bw = _rel_w_block(rw_row[:, None] + cols[None, :], rows_ok, cols_ok)  # (BM, BN)
        for r in range(0, Kh):  # the inner loop runs over the rows (Kh steps), so its loads are pipelined
            k, v, s = _key_tile(q, k_base, v_base, rh_row, bw, rows_ok, r, cols, cols_ok, Kw, scale, offs_d, offs_dv,
                                D, DV, PRECISION)  # s: (BM, BN)
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a column < Kw
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # (BM, BN)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # (BM, DV_PAD)
            m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + bh * N * DV + offs_m[:, None] * DV + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=rows_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + bh * N + offs_m, m_i + tl.log2(l_i), mask=rows_ok)  # base 2: only the backward reads it


@triton.jit
def _dkdv_kernel(Q, K, V, RH, RW, DO, LSE, DELTA, DK, DVAL, N, Kh, Kw, n_cblocks, scale, D: tl.constexpr,
                 DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 PRECISION: tl.constexpr):
    pid, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    keys = Kh * Kw
    r, c0 = pid // n_cblocks, (pid % n_cblocks) * BN  # this program's key row and first column
    offs_d, offs_dv, offs_r = tl.arange(0, D_PAD), tl.arange(0, DV_PAD), tl.arange(0, BM)
    cols = c0 + tl.arange(0, BN)
    cols_ok = cols < Kw
    offs_n = r * Kw + cols  # (BN,) keys
    k = _rows(K + bh * keys * D, offs_n, cols_ok, D, offs_d, D)  # (BN, D_PAD)
    v = _rows(V + bh * keys * DV, offs_n, cols_ok, DV, offs_dv, DV)  # (BN, DV_PAD)
    dk = tl.zeros([BN, D_PAD], tl.float32)
    dv = tl.zeros([BN, DV_PAD], tl.float32)
    if N > 0:  # the loop behind a branch: its zero-step path would copy dk and dv before the loop's last wgmma
        # wait, and ptxas then serializes every wgmma (remark C7515; relpos.backends._triton, "Regions")
        for m0 in range(0, N, BM):
            offs_m = m0 + offs_r
            rows_ok = offs_m < N
            q = _rows(Q + bh * N * D, offs_m, rows_ok, D, offs_d, D)  # (BM, D_PAD)
            do = _rows(DO + bh * N * DV, offs_m, rows_ok, DV, offs_dv, DV)  # (BM, DV_PAD)
            lse = tl.load(LSE + bh * N + offs_m, mask=rows_ok, other=0.0)  # (BM,)
            delta = tl.load(DELTA + bh * N + offs_m, mask=rows_ok, other=0.0)
            bw = _rel_w_block(RW + bh * N * Kw + offs_m[:, None] * Kw + cols[None, :], rows_ok, cols_ok)  # (BM, BN)
            s = _scores(q, k, RH + bh * N * Kh + offs_m * Kh + r, bw, rows_ok, scale, PRECISION)
            p = tl.where(rows_ok[:, None], tl.exp2(s - lse[:, None]), 0.0)  # (BM, BN): the forward's weights
            dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=PRECISION)  # (BN, DV_PAD)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])  # (BM, BN): d logits
            dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PRECISION)  # (BN, D_PAD)
    ok = cols_ok[:, None]
    tl.store(DK + bh * keys * D + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=ok & (offs_d[None, :] < D))
    tl.store(DVAL + bh * keys * DV + offs_n[:, None] * DV + offs_dv[None, :], dv.to(DVAL.dtype.element_ty),
             mask=ok & (offs_dv[None, :] < DV))


@triton.jit
def _dq_kernel(Q, K, V, RH, RW, DO, LSE, DELTA, DQ, DRH, DRW, N, Kh, Kw, scale, D: tl.constexpr,
               DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               PRECISION: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_d, offs_dv, offs_c = tl.arange(0, D_PAD), tl.arange(0, DV_PAD), tl.arange(0, BN)
    offs_m, rows_ok, q, rh_row, rw_row = _query_block(Q, RH, RW, pid_m, bh, N, Kh, Kw, offs_d, D, BM)
    do = _rows(DO + bh * N * DV, offs_m, rows_ok, DV, offs_dv, DV)  # (BM, DV_PAD)
    lse = tl.load(LSE + bh * N + offs_m, mask=rows_ok, other=0.0)
    delta = tl.load(DELTA + bh * N + offs_m, mask=rows_ok, other=0.0)
    k_base, v_base = K + bh * Kh * Kw * D, V + bh * Kh * Kw * DV
    drh_row, drw_row = DRH + bh * N * Kh + offs_m * Kh, DRW + bh * N * Kw + offs_m * Kw
    dq = tl.zeros([BM, D_PAD], tl.float32)
    for c0 in range(0, Kw, BN):
        cols = c0 + offs_c
        cols_ok = cols < Kw
        drw = tl.zeros([BM, BN], tl.float32)  # d rel_w of these columns, summed over the key rows
        for r in range(0, Kh):
            # rel_w read per tile: held across the rows beside drw it spills dq's registers (255, Triton 3.9)
            bw = _rel_w_block(rw_row[:, None] + cols[None, :], rows_ok, cols_ok)  # (BM, BN)
            k, v, s = _key_tile(q, k_base, v_base, rh_row, bw, rows_ok, r, cols, cols_ok, Kw, scale, offs_d, offs_dv,
                                D, DV, PRECISION)  # s: (BM, BN)
            p = tl.where(rows_ok[:, None], tl.exp2(s - lse[:, None]), 0.0)  # (BM, BN)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])  # (BM, BN)
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)  # (BM, D_PAD)
            drw += ds
            tl.atomic_add(drh_row + r, tl.sum(ds, 1), mask=rows_ok)  # d rel_h[i, r]: this tile's share
        tl.store(drw_row[:, None] + cols[None, :], drw, mask=rows_ok[:, None] & cols_ok[None, :])
    tl.store(DQ + bh * N * D + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=rows_ok[:, None] & (offs_d[None, :] < D))


def _launch_options(kw: int) -> dict:
    """Tiles: (BM, BN) 16 x 16 under the interpreter (many tiles at test sizes), else 64 query rows and a column
    block that holds a whole key row up to 64 (SAM ViT-B's global layers: Kw = 64; a window of 14 pads to 16)."""
    if INTERPRETED:
        return {"BM": 16, "BN": 16}
    return {"BM": 64, "BN": min(64, _pow2(kw)), "num_warps": 4, "num_stages": 2}


#: dq's software pipeline: 3 stages. At SAM ViT-B's size in bf16 (tools/kernel_anatomy.py --decomposed) dq sits at the
#: register ceiling: with 2 stages Triton 3.6 (the GPU machine's) spills 40 bytes (255 registers), with 3 neither 3.6
#: nor 3.9 spills (254 / 255), and 1 stage (245) gives up the overlap of its loads; 2 blocks per SM in each case.
DQ_STAGES = 3


class _DecomposedTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, scale):
        b, h, n, d = q.shape
        kh, kw, dv = rel_h.shape[-1], rel_w.shape[-1], v.shape[-1]
        q, k, v, rel_h, rel_w = (t.contiguous() for t in (q, k, v, rel_h, rel_w))
        out = torch.empty(b, h, n, dv, dtype=q.dtype, device=q.device)  # (B, H, N, dv)
        lse = torch.empty(b, h, n, dtype=torch.float32, device=q.device)  # (B, H, N): base 2
        opts = _launch_options(kw)
        consts = {"D": d, "DV": dv, "D_PAD": _pow2(d), "DV_PAD": _pow2(dv), "PRECISION": _precision(q.dtype), **opts}
        _fwd_kernel[(_cdiv(n, opts["BM"]), b * h)](q, k, v, rel_h, rel_w, out, lse, n, kh, kw, scale, **consts)
        ctx.save_for_backward(q, k, v, rel_h, rel_w, out, lse)
        ctx.scale, ctx.consts = scale, consts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, rel_h, rel_w, out, lse = ctx.saved_tensors
        b, h, n, _ = q.shape
        kh, kw = rel_h.shape[-1], rel_w.shape[-1]
        consts = ctx.consts
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, N): rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        drh = torch.zeros(rel_h.shape, dtype=torch.float32, device=q.device)  # (B, H, N, Kh): atomic adds
        drw = torch.empty(rel_w.shape, dtype=torch.float32, device=q.device)  # (B, H, N, Kw)
        n_cblocks = _cdiv(kw, consts["BN"])
        args = (q, k, v, rel_h, rel_w, grad_out, lse, delta)
        _dkdv_kernel[(kh * n_cblocks, b * h)](*args, dk, dv, n, kh, kw, n_cblocks, ctx.scale, **consts)
        _dq_kernel[(_cdiv(n, consts["BM"]), b * h)](*args, dq, drh, drw, n, kh, kw, ctx.scale,
                                                    **(consts if INTERPRETED else consts | {"num_stages": DQ_STAGES}))
        return dq, dk, dv, drh.to(rel_h.dtype), drw.to(rel_w.dtype), None


def decomposed_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rel_h: torch.Tensor,
                      rel_w: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + rel_h[i, y'] + rel_w[i, x']) v`` ``(B, H, N, dv)`` in the kernels above; inputs
    checked by :func:`relpos.encodings.decomposed.decomposed_attention` (``impl="triton"``)."""
    return _DecomposedTriton.apply(query, key, value, rel_h, rel_w, float(scale))
