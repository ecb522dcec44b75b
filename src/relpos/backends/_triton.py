"""Flash attention with the relative position term computed inside each tile (Triton).

One kernel file, in the layout of Triton's fused-attention tutorial and FlashAttention-2:
a forward with an online softmax in fp32, and a backward in three kernels (``delta = rowsum(dO * O)``;
``dk, dv`` per key block; ``dq`` and the bias gradient per query block). The position term of
tile (query rows ``i``, keys ``j``) never exists as an ``(Lq, Lk)`` array:

* ``BIAS_OFFSETS``: read from the per-offset values ``values[h, j - i + Lq - 1]`` (any
  :class:`~relpos.OffsetBias`: T5, clipped, Kerple, Sandwich, FIRE, log-decay). A tile whose
  offsets all lie in a range the bias marks :attr:`~relpos.OffsetBias.flat` (T5 beyond
  ``max_distance``, clipped beyond R) adds one scalar per head instead;
* ``BIAS_CAUSAL_LINEAR`` / ``BIAS_SYMMETRIC_LINEAR``: ALiBi's closed forms ``m * min(j - i, 0)`` and
  ``-m * |j - i|`` from one slope per head; a tile wholly on one side of the diagonal adds ``+-m * j`` per key
  and folds ``-+m * i`` into each row's softmax shift (as a flat range's one value is), so it costs one
  fused multiply-add and one add per score;
* causal attention and key padding (one run of kept keys per example) skip whole tiles; only the
  tiles they cut are masked. A padding mask of any other pattern (holes), and any key mask on a GPU
  (read there, never back on the CPU), is a per-key term, ``-inf`` on hidden keys, added to every tile's
  scores (``KEYBIAS``), with each example's first and last kept key bounding the blocks it visits; an example
  that hides no key between those two (a flag beside its terms) skips the terms in the forward and in dq. dk/dv
  adds none: a hidden key's rows of dk and dv depend on nothing but its own weights, so they are zeroed once;
* a real-valued term per key and head (``key_bias``: the ALiBi families' own per-key form, Bloom's positions that
  skip a padding mask's holes, Falcon's per-key values) rides in the same per-key terms, added to every tile's
  scores, dk/dv's too (``KEYREAL``); it gets no gradient;
* attention dropout: each tile draws the keep-mask of its scores with Philox4x32-7 at each score's
  position, one evaluation for the four scores of a 16 x 16 square that one thread holds in either tile
  orientation (``_kept``), so the backward kernels re-draw exactly the forward's mask, whatever the tiles, and
  no tile passes its mask through shared memory; the drop probability is rounded to 2**-16 and kept weights
  scaled by ``1 / (1 - p')`` as in relpos's other backends.

Bias gradient (``d values[h, t]`` = the sum of ``dS`` over the diagonal ``j - i = t - Lq + 1``, over
the batch): each (query block, key block) tile reduces its ``dS`` along its ``BM + BN - 1``
diagonals in registers (``tl.gather`` skews the tile) and adds them with atomics; flat tiles add
their whole sum to the range's one entry, accumulated per program. ``deterministic=True``
writes each tile's diagonal sums to its own slot and adds them in a fixed order instead.

The kernels also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported), which is how the CPU test suite checks them against fp64 oracles.
The readable reference they are tested against is the ``eager`` backend (relpos.backends.dispatch).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._reuse import KeptResult, may_reuse, storage_key

__all__ = ["INTERPRETED", "TritonSpec", "triton_attention"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # decided when triton.jit ran (import time)
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # inside the kernels: the slopes are scaled as they load (the values on the host)

BIAS_NONE, BIAS_OFFSETS, BIAS_CAUSAL_LINEAR, BIAS_SYMMETRIC_LINEAR = 0, 1, 2, 3


# --------------------------------------------------------------------------------------------- tiles
# Kinds of tile: how the position term of a tile is computed (scores are kept in log2 units).
# NONE: no term; SCALAR: one value for the whole tile (a flat range); GATHER: per-offset values;
# RAMP: slope * (j - i) in a tile wholly on one side of the diagonal, as a term per key plus a term per query row
# (ALiBi's tiles off the diagonal, the slope negated right of it for the symmetric form);
# CAUSAL_LINEAR: m * min(j - i, 0); SYMMETRIC: -m * |j - i| (the tiles the diagonal crosses).
NONE, SCALAR, GATHER, RAMP, CAUSAL_LINEAR, SYMMETRIC = 0, 1, 2, 3, 4, 5
WIDE = 8  # added to RAMP, CAUSAL_LINEAR, SYMMETRIC where positions reach EXACT_POSITIONS: converted, not from bits
# (the kernels write it as the literal 8: a compiled kernel reads no Python-int global, the interpreter no constexpr's %)
EXACT_POSITIONS = (1 << 22) - 256  # positions (keys; query rows plus q_offset) below this: exact floats from bits
KEY_PAD = 128  # -inf past a key mask's last key: a tile (<= 128 keys) loads its per-key terms unchecked; the last
# of them (no tile reads it) says whether the example hides a key between its first and last kept one (1.0) or not (0.0)
KEY_PAD_ = tl.constexpr(KEY_PAD)
_NO_ROW = tl.constexpr(0x7F800000)  # a row past Lq in _row_stats: lse = inf (its weights 0), delta = 0
PAD = 256  # zeros on both sides of the per-offset values: a tile's gather needs no bounds mask (tiles <= 128)


@triton.jit
def _scores(qk, m0, n0, vals, c, slope, qk_scale, q_offset, KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            KEYS_FIRST: tl.constexpr):
    """``(t, r)``: the scores in log2 units of the tile of queries ``m0 .. m0 + BM - 1`` and keys
    ``n0 .. n0 + BN - 1`` are ``t + r``, ``t`` (BM, BN) (``KEYS_FIRST``: (BN, BM), the dk/dv kernel's tiles), ``r`` a
    term per query row, (BM,) or a scalar, which the callers fold into each row's softmax shift instead of adding it
    to every score. ``t = q.k * scale * log2(e)`` plus the part of the position term that varies along a row.

    ``c`` and ``slope`` are already times log2(e), and so are the values ``vals`` points into (at offset 0 of the
    head's values). Positions are computed relative to the tile's corner, as floats (an integer-to-float conversion
    per score would share the exp2 unit): ``d0 = n0 - (m0 + q_offset)`` plus the key's and the row's place in the
    tile. A gathered tile's addresses are the values at ``d0`` plus ``j - i`` within the tile, the same for every
    tile (fewer registers and instructions than absolute positions: docs/benchmarks/gpu/kernel-anatomy.md)."""
    r = 0.0
    if KIND == 0:
        t = qk * qk_scale
    elif KIND == 1:
        t = qk * qk_scale
        r = c
    elif KIND == 2:
        rows, cols = _tile(tl.arange(0, BM), tl.arange(0, BN), KEYS_FIRST)
        t = qk * qk_scale + tl.load(vals + (n0 - m0) + (cols - rows))
    elif KIND % 8 == 3 and KEYS_FIRST:  # slope * (j - i) = slope * (j - m0 - q_offset) - slope * (i - m0): dk/dv's
        # loop keeps its keys and moves its rows, so the row term stays and the key term follows the tile
        cols_f = _as_float(n0 - m0 - q_offset + tl.arange(0, BN), KIND >= 8)
        rows, cols = _tile(tl.arange(0, BM), slope * cols_f, KEYS_FIRST)
        t = qk * qk_scale + cols
        r = -slope * tl.arange(0, BM).to(tl.float32)  # (BM,)
    elif KIND % 8 == 3:  # slope * (j - n0) + [slope * (n0 - m0 - q_offset) - slope * (i - m0)]: the forward's and dq's
        # loops keep their rows and move their keys, so the key term is the same in every tile (computed once, outside
        # the loops) and the row term takes the tile's corner
        rows, cols = _tile(tl.arange(0, BM), slope * _exact_float(tl.arange(0, BN)), KEYS_FIRST)
        t = qk * qk_scale + cols
        r = slope * (n0 - m0 - q_offset).to(tl.float32) - slope * tl.arange(0, BM).to(tl.float32)  # (BM,)
    else:
        rows, cols = _tile(m0 + q_offset + tl.arange(0, BM), n0 + tl.arange(0, BN), KEYS_FIRST)
        if KIND % 8 == 4:
            t = qk * qk_scale + slope * tl.minimum(_as_float(cols - rows, KIND >= 8), 0.0)
        else:
            t = qk * qk_scale - slope * tl.abs(_as_float(cols - rows, KIND >= 8))
    return t, r


@triton.jit
def _as_float(x, CONVERT: tl.constexpr):
    """Integer positions ``x`` as fp32: from their bits (:func:`_exact_float`) below ``EXACT_POSITIONS``, converted
    (``CONVERT``) beyond."""
    if CONVERT:
        f = x.to(tl.float32)
    else:
        f = _exact_float(x)
    return f


@triton.jit
def _exact_float(x):
    """``x.to(float32)`` for integers ``|x| < 2**22`` without a conversion instruction (which shares the exp2 unit):
    ``2**23 + 2**22 + x`` has the float bits ``0x4B400000 + x``, and subtracting ``2**23 + 2**22`` is exact."""
    return (x + 0x4B400000).to(tl.int32).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _tile(row_vec, col_vec, KEYS_FIRST: tl.constexpr):
    """``row_vec`` (BM,) and ``col_vec`` (BN,) shaped to broadcast over a (BM, BN) tile, or a (BN, BM) one."""
    if KEYS_FIRST:
        rows, cols = row_vec[None, :], col_vec[:, None]
    else:
        rows, cols = row_vec[:, None], col_vec[None, :]
    return rows, cols


@triton.jit
def _visible(rows, cols, lo, hi, q_offset, CAUSAL: tl.constexpr):
    """Which (query, key) pairs a tile may attend to: keys in [lo, hi), and not in the future."""
    keep = (cols >= lo) & (cols < hi)
    if CAUSAL:
        keep = keep & (cols <= rows + q_offset)
    return keep


@triton.jit
def _kept(seed, bh, m0, n0, threshold, BM: tl.constexpr, BN: tl.constexpr):
    """Dropout's keep-mask, ``(BM, BN)``, of the scores of the query block ``m0 .. m0 + BM - 1`` and the key block
    ``n0 .. n0 + BN - 1`` (both starting at multiples of 16) of (example, head) ``bh = b * H + h``. Query
    ``i = 16 u + 8 s + r`` and key ``j = 16 v + 8 t + c`` (``r, c < 8``) read word ``2 s + t`` of the Philox4x32-7
    evaluation keyed by ``seed`` at the counter ``(8 v + c, bh, 8 u + r, 0)``: the four scores ``{i, i + 8} x
    {j, j + 8}`` of one evaluation lie in one thread's registers in the tensor-core layout of a tile of either
    orientation (queries by keys in the forward and dq, keys by queries in dk/dv), so no tile exchanges its mask
    through shared memory, and the first round multiplies a column and a row of counters, not a tile. A score is
    kept when the word's high 16 bits reach ``round(p * 2**16)``, that is when the word reaches ``threshold``, that
    number times 2**16 (its bits passed as an int32: :func:`_dropout_args`). Query blocks start at multiples of
    16; so do key blocks, which in the forward and dq otherwise start at an example's first kept key: with dropout
    they start at the next multiple of 16, and the keys before it run last, in one masked step."""
    gi = m0 // 2 + tl.arange(0, BM // 2)  # (BM/2,): 8 u + r
    gj = n0 // 2 + tl.arange(0, BN // 2)  # (BN/2,): 8 v + c
    w0, w1, w2, w3 = tl.philox(seed, gj[None, :], bh, gi[:, None], 0, 7)  # (BM/2, BN/2); 7 rounds, as FlashAttention-2
    words = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # (BM/2, BN/2, t, s): word 2 s + t
    words = tl.permute(tl.reshape(words, (BM // 16, 8, BN // 16, 8, 2, 2)), (0, 5, 1, 2, 4, 3))  # (u, s, r, v, t, c)
    return tl.reshape(words, (BM, BN)) >= threshold.to(tl.uint32, bitcast=True)


@triton.jit
def _seed(SEED, DROPOUT: tl.constexpr):
    """The call's dropout seed, read from a (1,) int64 tensor on the device (drawn there: a compiled graph,
    CUDA graphs included, draws a new one per call); 0 without dropout."""
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    return seed


@triton.jit
def _no_holes(kb_row, Lk, KEYBIAS: tl.constexpr):
    """Whether a key mask read per key hides no key between this example's first and last kept one (the flag in
    its terms' last entry, :func:`_key_mask_terms`): the blocks in between then need no per-key terms. False
    without a key mask (nothing to skip)."""
    no_holes = False
    if KEYBIAS:
        no_holes = tl.load(kb_row + Lk + KEY_PAD_ - 1) == 0.0
    return no_holes


@triton.jit
def _key_terms(kb_row, offs_n):
    """(BN,) the per-key term of keys ``offs_n`` (log2 units; ``-inf`` hides a key: a padding mask of any
    pattern). The terms run ``KEY_PAD`` keys past ``Lk``, all ``-inf`` (:func:`_key_mask_terms`): no bounds check."""
    return tl.load(kb_row + offs_n)


@triton.jit
def _load_block(base, offs, stride, offs_d, limit, D: tl.constexpr, D_PAD: tl.constexpr, MASK: tl.constexpr):
    """(rows, D_PAD) block; bounds are checked only where a block can cross them."""
    ptrs = base + offs[:, None] * stride + offs_d[None, :]
    if MASK:
        x = tl.load(ptrs, mask=(offs[:, None] < limit) & (offs_d[None, :] < D), other=0.0)
    elif D == D_PAD:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def _key_range(STARTS, ENDS, b, Lk, RANGES: tl.constexpr):
    lo = 0
    hi = Lk
    if RANGES:
        lo = tl.load(STARTS + b)
        hi = tl.load(ENDS + b)
    return lo, hi


@triton.jit
def _flat_value(vals, offset, KIND: tl.constexpr):
    """A flat range's one value (log2 units) at ``offset`` of the head's values, for tiles of kind SCALAR; 0 else."""
    c = 0.0
    if KIND == 1:
        c = tl.load(vals + offset)
    return c


@triton.jit
def _square_start(lo, hi, ALIGN: tl.constexpr):
    """``(first, start)``: an example's first kept key and where the forward's and dq's key blocks start. They start
    at ``first``, except with dropout and key ranges (``ALIGN``): dropout draws 16 x 16 squares (:func:`_kept`), so
    they start at the next multiple of 16 and the caller runs the keys ``[first, start)`` last, in one masked step
    of the block at ``first // 16 * 16``."""
    first = lo
    if ALIGN:
        lo = tl.minimum((first + 15) // 16 * 16, hi)
    return first, lo


@triton.jit
def _row_segments(lo, hi, m0, Lq, q_offset, t_lo, t_hi, CAUSAL: tl.constexpr, FLAT: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    """Key blocks of query block m0: [lo, e1) flat low, [e1, e2) gathered, [e2, full) flat high, all
    unmasked; [full, hi) masked (the causal diagonal, a padding edge, the last partial block)."""
    if CAUSAL:
        hi = tl.minimum(hi, q_offset + m0 + BM)  # no row of the block sees a key past its last row
        full = tl.minimum(hi, q_offset + m0 + 1)  # keys every row of the block sees
    else:
        full = hi
    full = tl.maximum(lo, lo + ((full - lo) // BN) * BN)
    e1 = lo
    e2 = full
    if FLAT:
        a = t_lo - BN + 1 + m0 - Lq + 1  # the last n0 whose tile lies wholly at offsets <= the low range
        e1 = tl.minimum(full, lo + tl.where(a >= lo, (a - lo) // BN + 1, 0) * BN)
        z = t_hi + m0 + BM - Lq  # the first n0 whose tile lies wholly at offsets >= the high range
        e2 = tl.maximum(e1, tl.minimum(full, lo + tl.where(z > lo, (z - lo + BN - 1) // BN, 0) * BN))
    return hi, e1, e2, full


# ------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_step(
    acc, m_i, l_i, q, k_base, v_base, vals, c, slope, offs_m, offs_d, offs_dv, m0, n0, lo, hi,
    stride_kn, stride_vn, q_offset, qk_scale, seed, drop_bh, drop_t, kb_row,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, KIND: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, KEYBIAS: tl.constexpr, BN: tl.constexpr,
    PRECISION: tl.constexpr, SCALE_POS: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BN)
    k = _load_block(k_base, offs_n, stride_kn, offs_d, hi, D, D_PAD, MASK)  # (BN, D)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BM, BN)
    t, r = _scores(qk, m0, n0, vals, c, slope, qk_scale, q_offset, KIND, offs_m.shape[0], BN, False)
    if KEYBIAS:
        t = t + _key_terms(kb_row, offs_n)[None, :]
    if MASK:
        t = tl.where(_visible(offs_m[:, None], offs_n[None, :], lo, hi, q_offset, CAUSAL), t, float("-inf"))
    if KIND <= 1 and not KEYBIAS and not MASK and SCALE_POS:  # t = qk * qk_scale: its max is qk's, scaled
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale + r)  # (BM,)
    else:
        m_new = tl.maximum(m_i, tl.max(t, 1) + r)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.math.exp2(t - (m_use - r)[:, None])  # (BM, BN); with t = qk * qk_scale, one fused multiply-add a score
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)  # the softmax's normalizer: dropout comes after it
    if DROPOUT:  # dropped weights out; the kept ones are scaled once, at the end
        p = tl.where(_kept(seed, drop_bh, m0, n0, drop_t, offs_m.shape[0], BN), p, 0.0)
    v = _load_block(v_base, offs_n, stride_vn, offs_dv, hi, DV, DV_PAD, MASK)  # (BN, DV)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # (BM, DV)
    return acc, m_new, l_i


@triton.jit
def _fwd_blocks(
    acc, m_i, l_i, q, k_base, v_base, vals, slope, offs_m, offs_d, offs_dv, m0, lo, hi, e1, e2, full, Lq,
    stride_kn, stride_vn, q_offset, qk_scale, t_lo, t_hi, seed, drop_bh, drop_t, kb_row,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, MAIN: tl.constexpr,
    FLAT: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, KEYBIAS: tl.constexpr, BN: tl.constexpr,
    PRECISION: tl.constexpr, GS: tl.constexpr, PART: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr,
    SCALE_POS: tl.constexpr,
):
    """Every key block of one query block (``_fwd_kernel``'s regions), the softmax state carried through."""
    if FLAT and PART != 2:  # the blocks wholly left of the diagonal or of a flat range's low end
        c_lo = _flat_value(vals, t_lo - (Lq - 1), LOW)
        for n0 in range(lo, e1, BN):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, c_lo, slope, offs_m, offs_d, offs_dv,
                                      m0, n0, lo, hi, stride_kn, stride_vn, q_offset, qk_scale,
                                      seed, drop_bh, drop_t, kb_row,
                                      D, DV, D_PAD, DV_PAD, LOW, CAUSAL, False, DROPOUT, KEYBIAS, BN, PRECISION, SCALE_POS)
    if FLAT and PART != 2:  # wholly right of it (ALiBi's symmetric ramp: the slope negated)
        c_hi = _flat_value(vals, t_hi - (Lq - 1), HIGH)
        for n0 in range(e2, full, BN):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, c_hi, -slope, offs_m, offs_d, offs_dv,
                                      m0, n0, lo, hi, stride_kn, stride_vn, q_offset, qk_scale,
                                      seed, drop_bh, drop_t, kb_row,
                                      D, DV, D_PAD, DV_PAD, HIGH, CAUSAL, False, DROPOUT, KEYBIAS, BN, PRECISION, SCALE_POS)
    if PART != 1 and MAIN < 3:  # per-offset values: the gathered blocks, then the masked ones
        for n0 in range(e1, e2, BN):
            for part in tl.static_range(GS):
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, 0.0, slope, offs_m, offs_d, offs_dv,
                                          m0, n0 + part * (BN // GS), lo, hi, stride_kn, stride_vn, q_offset, qk_scale,
                                          seed, drop_bh, drop_t, kb_row,
                                          D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, False, DROPOUT, KEYBIAS, BN // GS, PRECISION, SCALE_POS)
        for n0 in range(full, hi, BN):
            for part in tl.static_range(GS):
                acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, 0.0, slope, offs_m, offs_d, offs_dv,
                                          m0, n0 + part * (BN // GS), lo, hi, stride_kn, stride_vn, q_offset, qk_scale,
                                          seed, drop_bh, drop_t, kb_row,
                                          D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, True, DROPOUT, KEYBIAS, BN // GS, PRECISION, SCALE_POS)
    if MAIN >= 3:  # ALiBi: the few blocks the diagonal crosses and the masked ones in one loop, masked
        n_mid = (e2 - e1) // BN
        for i in range(0, n_mid + (hi - full + BN - 1) // BN):
            n0 = tl.where(i < n_mid, e1 + i * BN, full + (i - n_mid) * BN)
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, 0.0, slope, offs_m, offs_d, offs_dv,
                                      m0, n0, lo, hi, stride_kn, stride_vn, q_offset, qk_scale,
                                      seed, drop_bh, drop_t, kb_row,
                                      D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, True, DROPOUT, KEYBIAS, BN, PRECISION, SCALE_POS)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["Lq", "Lk", "q_offset", "t_lo", "t_hi", "drop_t"])
def _fwd_kernel(
    Q, K, V, O, LSE, VALS, SLOPES, STARTS, ENDS,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_vals, KB, stride_kbb, stride_kbh,
    H, GROUP, Lq, Lk, q_offset, qk_scale, t_lo, t_hi, SEED, drop_t, drop_scale,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    MAIN: tl.constexpr, FLAT: tl.constexpr, CAUSAL: tl.constexpr, RANGES: tl.constexpr, DROPOUT: tl.constexpr,
    KEYBIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr, GS: tl.constexpr,
    PART: tl.constexpr, LOW: tl.constexpr, HIGH: tl.constexpr, SCALE_POS: tl.constexpr,
):
    """One query block. ``GS``: the blocks whose tiles gather per-offset values (and the masked ones) run as ``GS``
    steps of ``BN / GS`` keys, whose address tensors fit the registers, while flat blocks take all ``BN`` at once.

    ``PART`` 0: every key block. With a flat range the forward can run as two launches of the same tiles
    (``_Blocks.split_flat``): ``PART`` 1 only the flat blocks, compiled without the gathering code, so it keeps
    the registers and shared memory of a kernel with no position term; ``PART`` 2 the gathered and masked blocks,
    starting from part 1's output and log-sum-exp as its softmax state (m = lse, l = 1, acc = out).

    ``FLAT``: the key blocks wholly at offsets <= ``t_lo`` take tiles of kind ``LOW``, those wholly at offsets
    >= ``t_hi`` tiles of kind ``HIGH`` (a flat range's scalar; ALiBi's ramp left and right of the diagonal), the
    rest ``MAIN``. ``SCALE_POS``: ``qk_scale >= 0``, so a tile with no term per score takes its max from ``q.k``."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    seed = _seed(SEED, DROPOUT)
    b, h = pid_bh // H, pid_bh % H
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d, offs_dv = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    q = _load_block(Q + b * stride_qb + h * stride_qh, offs_m, stride_qm, offs_d, Lq, D, D_PAD, True)  # (BM, D)
    k_base = K + b * stride_kb + (h // GROUP) * stride_kh
    v_base = V + b * stride_vb + (h // GROUP) * stride_vh
    vals = VALS + h * stride_vals + (Lq - 1)  # offset 0 of this head's values
    slope = 0.0
    if MAIN >= 3:
        slope = tl.load(SLOPES + h) * _LOG2E
    drop_bh = pid_bh  # dropout's (example, head) counter word
    kb_row = KB + b * stride_kbb + h * stride_kbh  # this (example, head)'s per-key terms
    lo, hi = _key_range(STARTS, ENDS, b, Lk, RANGES)
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :]  # (BM, DV)
    o_mask = (offs_m[:, None] < Lq) & (offs_dv[None, :] < DV)
    if PART == 2:  # part 1's rows as the softmax state: out = acc / l with l = 1 at m = lse
        lse_1 = tl.load(LSE + pid_bh * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))  # (BM,) base 2
        m_i = tl.where(lse_1 < float("inf"), lse_1, float("-inf"))
        l_i = tl.where(lse_1 < float("inf"), 1.0, 0.0)
        acc = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)  # (BM, DV)
    else:
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DV_PAD], tl.float32)
    first, lo = _square_start(lo, hi, DROPOUT and RANGES)
    hi, e1, e2, full = _row_segments(lo, hi, m0, Lq, q_offset, t_lo, t_hi, CAUSAL, FLAT, BM, BN)
    if _no_holes(kb_row, Lk, KEYBIAS):  # a key mask hiding no key inside [lo, hi): no per-key terms
        acc, m_i, l_i = _fwd_blocks(
                acc, m_i, l_i, q, k_base, v_base, vals, slope, offs_m, offs_d, offs_dv, m0, lo, hi, e1, e2, full, Lq,
                stride_kn, stride_vn, q_offset, qk_scale, t_lo, t_hi, seed, drop_bh, drop_t, kb_row,
                D, DV, D_PAD, DV_PAD, MAIN, FLAT, CAUSAL, DROPOUT, False, BN, PRECISION, GS, PART, LOW, HIGH, SCALE_POS)
    else:
        acc, m_i, l_i = _fwd_blocks(
                acc, m_i, l_i, q, k_base, v_base, vals, slope, offs_m, offs_d, offs_dv, m0, lo, hi, e1, e2, full, Lq,
                stride_kn, stride_vn, q_offset, qk_scale, t_lo, t_hi, seed, drop_bh, drop_t, kb_row,
                D, DV, D_PAD, DV_PAD, MAIN, FLAT, CAUSAL, DROPOUT, KEYBIAS, BN, PRECISION, GS, PART, LOW, HIGH, SCALE_POS)
    if DROPOUT and RANGES:
        if first < lo:
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, 0.0, slope, offs_m, offs_d, offs_dv,
                                      m0, first // 16 * 16, first, lo, stride_kn, stride_vn, q_offset, qk_scale,
                                      seed, drop_bh, drop_t, kb_row,
                                      D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, True, DROPOUT, KEYBIAS, BN // GS, PRECISION,
                                      SCALE_POS)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that see no key: 0
    if DROPOUT:
        out = out * drop_scale  # 1 / (1 - p) for the kept weights
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))  # base 2
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)
    tl.store(LSE + pid_bh * Lq + offs_m, lse, mask=offs_m < Lq)


# ------------------------------------------------------------------------------------------ backward
# Regions: each backward kernel visits its blocks in up to five loops, one per tile kind (masked, flat high, gathered,
# flat low, masked), each carrying the accumulators (dk and dv, or dq) into the next. A loop that may run no step
# sits behind its own branch (``_dkdv_region``, ``_dq_region``): bare, its zero-step path copied the accumulators
# just before the wait that ends the loop's last tensor-core steps, and ptxas (Triton 3.6's, sm_90) then serialized
# every wgmma of the kernel (remark C7515: "non wgmma instructions defining accumulator registers ... between start
# and end of the pipeline stage"); behind a branch each loop ends in its own wait. Read with tools/kernel_anatomy.py
# (docs/benchmarks/gpu/kernel-anatomy.md).
@triton.jit
def _delta_kernel(O, DO, LSE, STATS, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm, H, Lq,
                  DV: tl.constexpr, DV_PAD: tl.constexpr, BM: tl.constexpr):
    """Each row's ``delta = rowsum(dO * O)``, written beside its log-sum-exp: ``STATS`` (B, H, Lq, 2) fp32 holds
    ``(lse, delta)`` per row, which the backward kernels read as one 64-bit word (:func:`_row_stats`)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dv = tl.arange(0, DV_PAD)
    o = _load_block(O + b * stride_ob + h * stride_oh, offs_m, stride_om, offs_dv, Lq, DV, DV_PAD, True)
    do = _load_block(DO + b * stride_db + h * stride_dh, offs_m, stride_dm, offs_dv, Lq, DV, DV_PAD, True)
    rows = pid_bh * Lq + offs_m
    tl.store(STATS + 2 * rows, tl.load(LSE + rows, mask=offs_m < Lq), mask=offs_m < Lq)
    tl.store(STATS + 2 * rows + 1, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < Lq)


@triton.jit
def _row_stats(pair):
    """``(lse, delta)``, (BM,) fp32 each, from each row's 64-bit word of ``STATS`` (:func:`_delta_kernel`): lse's bits
    low, delta's high. One 64-bit load a row instead of two 32-bit ones: Triton 3.6 pipelines each of these small
    loads into shared memory as a tree of branches and 4-byte copies (dk/dv reads them every step: its flat tile
    451 -> 389-396 instructions, docs/benchmarks/gpu/kernel-anatomy.md)."""
    lse = (pair & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    delta = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lse, delta


@triton.jit
def _dkdv_step(
    dk, dv, k, v, q_base, do_base, stats_row, vals, c, slope, offs_n, offs_d, offs_dv, m0, n0, lo, hi, Lq,
    stride_qm, stride_dm, q_offset, qk_scale, seed, drop_bh, drop_t, drop_scale, kt,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, KIND: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, KEYREAL: tl.constexpr, BM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = m0 + tl.arange(0, BM)
    q = _load_block(q_base, offs_m, stride_qm, offs_d, Lq, D, D_PAD, MASK)  # (BM, D)
    do = _load_block(do_base, offs_m, stride_dm, offs_dv, Lq, DV, DV_PAD, MASK)  # (BM, DV)
    if MASK:
        pair = tl.load(stats_row + offs_m, mask=offs_m < Lq, other=_NO_ROW)  # (BM,) int64
    else:
        pair = tl.load(stats_row + offs_m)
    lse, delta = _row_stats(pair)  # (BM,) fp32 each
    st = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BN, BM)
    st, r = _scores(st, m0, n0, vals, c, slope, qk_scale, q_offset, KIND, BM, offs_n.shape[0], True)
    if KEYREAL:  # real-valued per-key terms (key_bias): part of every score (a mask alone is zeroed at the end)
        st = st + kt[:, None]
    pt = tl.math.exp2(st - (lse - r)[None, :])  # (BN, BM)
    if MASK:
        pt = tl.where(_visible(offs_m[None, :], offs_n[:, None], lo, hi, q_offset, CAUSAL), pt, 0.0)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BN, BM)
    if DROPOUT:  # the forward's mask, transposed: dv takes the kept weights (scaled at the end)
        keep = tl.trans(_kept(seed, drop_bh, m0, n0, drop_t, BM, offs_n.shape[0]))  # (BN, BM)
        dv = tl.dot(tl.where(keep, pt, 0.0).to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.where(keep, dpt * drop_scale, 0.0)
    else:
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_region(
    dk, dv, m_lo, m_hi, k, v, q_base, do_base, stats_row, vals, c, slope, offs_n, offs_d, offs_dv, n0, lo, hi,
    Lq, stride_qm, stride_dm, q_offset, qk_scale, seed, drop_bh, drop_t, drop_scale, kt,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, KIND: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, KEYREAL: tl.constexpr, BM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dk, dv over the query blocks ``[m_lo, m_hi)`` of one region (one tile kind), its loop behind its own branch
    (see "Regions" above)."""
    if m_lo < m_hi:
        for m0 in range(m_lo, m_hi, BM):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, stats_row, vals, c, slope, offs_n, offs_d,
                                offs_dv, m0, n0, lo, hi, Lq, stride_qm, stride_dm, q_offset, qk_scale,
                                seed, drop_bh, drop_t, drop_scale, kt,
                                D, DV, D_PAD, DV_PAD, KIND, CAUSAL, MASK, DROPOUT, KEYREAL, BM, PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["Lq", "Lk", "q_offset", "t_lo", "t_hi", "drop_t"])
def _dkdv_kernel(
    Q, K, V, DO, DK, DV_OUT, STATS, VALS, SLOPES, STARTS, ENDS,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm, stride_vals, KB, stride_kbb, stride_kbh,
    H, HKV, GROUP, Lq, Lk, q_offset, qk_scale, scale, t_lo, t_hi, SEED, drop_t, drop_scale,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    MAIN: tl.constexpr, FLAT: tl.constexpr, CAUSAL: tl.constexpr, RANGES: tl.constexpr, DROPOUT: tl.constexpr,
    KEYBIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr, LOW: tl.constexpr,
    HIGH: tl.constexpr, KEYREAL: tl.constexpr,
):
    """dk, dv of one key block of one key/value head: every query head of its group, every query block.

    Query blocks [m_start, u0) are masked (the causal diagonal; all of them when the key block crosses a
    padding edge), [u0, f1) flat high, [f1, f2) gathered, [f2, u1) flat low, [u1, m_end) masked (the last
    partial block)."""
    pid_n, pid_bh = tl.program_id(0), tl.program_id(1)
    seed = _seed(SEED, DROPOUT)
    b, hk = pid_bh // HKV, pid_bh % HKV
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_d, offs_dv = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    lo, hi = _key_range(STARTS, ENDS, b, Lk, RANGES)
    k = _load_block(K + b * stride_kb + hk * stride_kh, offs_n, stride_kn, offs_d, Lk, D, D_PAD, True)  # (BN, D)
    v = _load_block(V + b * stride_vb + hk * stride_vh, offs_n, stride_vn, offs_dv, Lk, DV, DV_PAD, True)
    dk = tl.zeros([BN, D_PAD], tl.float32)
    dv = tl.zeros([BN, DV_PAD], tl.float32)
    m_start = 0
    if CAUSAL:
        m_start = (tl.maximum(n0 - q_offset, 0) // BM) * BM  # earlier queries see none of these keys
    m_end = tl.where((n0 >= hi) | (n0 + BN <= lo), m_start, Lq)  # keys that are all padding: no query
    u1 = m_start + ((m_end - m_start) // BM) * BM  # whole query blocks
    u0 = m_start
    if CAUSAL:
        need = n0 + BN - 1 - q_offset  # the first row that sees every key of the block
        u0 = m_start + tl.where(need > m_start, (need - m_start + BM - 1) // BM, 0) * BM
    u0 = tl.where((n0 < lo) | (n0 + BN > hi), u1, tl.minimum(u0, u1))  # a padding edge: every block masked
    f1 = u0
    f2 = u1
    if FLAT:
        dm = n0 - BM + Lq - t_hi  # the last m0 whose tile lies wholly at offsets >= the high range
        f1 = tl.minimum(u1, u0 + tl.where(dm >= u0, (dm - u0) // BM + 1, 0) * BM)
        cm = n0 + BN + Lq - 2 - t_lo  # the first m0 whose tile lies wholly at offsets <= the low range
        f2 = tl.maximum(f1, tl.minimum(u1, u0 + tl.where(cm > u0, (cm - u0 + BM - 1) // BM, 0) * BM))
    for g in range(GROUP):
        h = hk * GROUP + g
        slope = 0.0
        if MAIN >= 3:
            slope = tl.load(SLOPES + h) * _LOG2E
        vals = VALS + h * stride_vals + (Lq - 1)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_db + h * stride_dh
        stats_row = STATS + (b * H + h) * Lq  # each row's (lse, delta), one int64
        drop_bh = b * H + h
        kt = 0.0
        if KEYREAL:  # this head's per-key terms of the block (log2 units; -inf on hidden keys and past Lk)
            kt = _key_terms(KB + b * stride_kbb + h * stride_kbh, offs_n)  # (BN,)
        dk, dv = _dkdv_region(dk, dv, m_start, u0, k, v, q_base, do_base, stats_row, vals, 0.0, slope, offs_n,
                              offs_d, offs_dv, n0, lo, hi, Lq, stride_qm, stride_dm, q_offset, qk_scale, seed, drop_bh,
                              drop_t, drop_scale, kt, D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, True, DROPOUT,
                              KEYREAL, BM, PRECISION)
        if FLAT:
            c_hi = _flat_value(vals, t_hi - (Lq - 1), HIGH)
            dk, dv = _dkdv_region(dk, dv, u0, f1, k, v, q_base, do_base, stats_row, vals, c_hi, -slope, offs_n,
                                  offs_d, offs_dv, n0, lo, hi, Lq, stride_qm, stride_dm, q_offset, qk_scale, seed,
                                  drop_bh, drop_t, drop_scale, kt, D, DV, D_PAD, DV_PAD, HIGH, CAUSAL, False,
                                  DROPOUT, KEYREAL, BM, PRECISION)
        dk, dv = _dkdv_region(dk, dv, f1, f2, k, v, q_base, do_base, stats_row, vals, 0.0, slope, offs_n,
                              offs_d, offs_dv, n0, lo, hi, Lq, stride_qm, stride_dm, q_offset, qk_scale, seed, drop_bh,
                              drop_t, drop_scale, kt, D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, False, DROPOUT,
                              KEYREAL, BM, PRECISION)
        if FLAT:
            c_lo = _flat_value(vals, t_lo - (Lq - 1), LOW)
            dk, dv = _dkdv_region(dk, dv, f2, u1, k, v, q_base, do_base, stats_row, vals, c_lo, slope, offs_n,
                                  offs_d, offs_dv, n0, lo, hi, Lq, stride_qm, stride_dm, q_offset, qk_scale, seed,
                                  drop_bh, drop_t, drop_scale, kt, D, DV, D_PAD, DV_PAD, LOW, CAUSAL, False,
                                  DROPOUT, KEYREAL, BM, PRECISION)
        dk, dv = _dkdv_region(dk, dv, u1, m_end, k, v, q_base, do_base, stats_row, vals, 0.0, slope, offs_n,
                              offs_d, offs_dv, n0, lo, hi, Lq, stride_qm, stride_dm, q_offset, qk_scale, seed, drop_bh,
                              drop_t, drop_scale, kt, D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, True, DROPOUT,
                              KEYREAL, BM, PRECISION)
    if KEYBIAS:  # a key a mask hides has no gradient: its rows of dk and dv zeroed once here, not masked in every step
        # (nothing else reads them; the key terms are one row per example, _key_mask_terms)
        hidden = _key_terms(KB + b * stride_kbb, offs_n) == float("-inf")  # (BN,)
        dk = tl.where(hidden[:, None], 0.0, dk)
        dv = tl.where(hidden[:, None], 0.0, dv)
    kv_mask = offs_n[:, None] < Lk
    tl.store(DK + pid_bh * Lk * D + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=kv_mask & (offs_d[None, :] < D))  # DK, DV_OUT: contiguous (B, Hkv, Lk, d)
    if DROPOUT:
        dv = dv * drop_scale
    tl.store(DV_OUT + pid_bh * Lk * DV + offs_n[:, None] * DV + offs_dv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=kv_mask & (offs_dv[None, :] < DV))


@triton.jit
def _diagonal_sums(ds, BM: tl.constexpr, BN: tl.constexpr):
    """Sums of ``ds`` (BM, BN), BN <= BM, along its diagonals, as two (BM,) vectors: ``upper[r]`` sums ``ds[i, j]``
    with ``j - i = r``, ``lower[r]`` those with ``j - i = r - BM``. Row r of the cyclic skew ``ds[(j - r) mod BM, j]``
    holds both (a tile's BM x BN gathered values; a full skew would hold (BM + BN) x BN)."""
    tl.static_assert(BN <= BM)
    r = tl.arange(0, BM)[:, None]
    j = tl.arange(0, BN)[None, :]
    skewed = tl.gather(ds, (j - r) & (BM - 1), axis=0)  # (BM, BN): [r, j] = ds[(j - r) mod BM, j]
    upper = tl.sum(tl.where(j >= r, skewed, 0.0), 1)  # (BM,): offset r
    lower = tl.sum(tl.where(j < r, skewed, 0.0), 1)  # (BM,): offset r - BM
    return upper, lower


@triton.jit
def _dq_step(
    dq, q, do, lse, delta, k_base, v_base, vals, dvals, c, slope, offs_m, offs_d, offs_dv, n0, m0, lo, hi, Lq, n_vals,
    stride_kn, stride_vn, q_offset, qk_scale, seed, drop_bh, drop_t, drop_scale, kb_row,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, KIND: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, KEYBIAS: tl.constexpr, DIAGONALS: tl.constexpr,
    DETERMINISTIC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
):
    """dq += dS k for one key block; returns the (BM,) row sums of the tile's dS too (for a flat tile: its one value's
    gradient, summed over rows once per region)."""
    offs_n = n0 + tl.arange(0, BN)
    k = _load_block(k_base, offs_n, stride_kn, offs_d, hi, D, D_PAD, MASK)  # (BN, D)
    v = _load_block(v_base, offs_n, stride_vn, offs_dv, hi, DV, DV_PAD, MASK)  # (BN, DV)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BM, BN)
    s, r = _scores(s, m0, n0, vals, c, slope, qk_scale, q_offset, KIND, BM, BN, False)
    if KEYBIAS:
        s = s + _key_terms(kb_row, offs_n)[None, :]
    p = tl.math.exp2(s - (lse - r)[:, None])
    if MASK:
        p = tl.where(_visible(offs_m[:, None], offs_n[None, :], lo, hi, q_offset, CAUSAL), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
    if DROPOUT:  # the gradient reaches the weights the forward kept, scaled as they were
        dp = tl.where(_kept(seed, drop_bh, m0, n0, drop_t, BM, offs_n.shape[0]), dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])  # the score gradient, natural units
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    rows = tl.zeros([BM], tl.float32)
    if KIND == 1:  # a flat tile: its rows' dS sums (summed over rows once per region, not per tile)
        rows = tl.sum(ds, 1)
    if DIAGONALS:
        upper, lower = _diagonal_sums(ds, BM, BN)
        w = tl.arange(0, BM)
        target = n0 - m0 + Lq - 1 + w  # (BM,): values index of offset n0 - m0 + w
        tl.atomic_add(dvals + target, upper, mask=(w < BN) & (target >= 0) & (target < n_vals))
        low = target - BM
        tl.atomic_add(dvals + low, lower, mask=(w > 0) & (low >= 0) & (low < n_vals))
        if DETERMINISTIC:  # this program's own slot: its tiles add in loop order
            tl.debug_barrier()
    return dq, rows


@triton.jit
def _dq_region(
    dq, n_lo, n_hi, q, do, lse, delta, k_base, v_base, vals, dvals, c, slope, offs_m, offs_d, offs_dv, m0, lo,
    hi, Lq, n_vals, stride_kn, stride_vn, q_offset, qk_scale, seed, drop_bh, drop_t, drop_scale, kb_row,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, KIND: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, DROPOUT: tl.constexpr, KEYBIAS: tl.constexpr, DIAGONALS: tl.constexpr,
    DETERMINISTIC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
):
    """``(dq, the tiles' dS sum)`` over the key blocks ``[n_lo, n_hi)`` of one region (one tile kind), its loop
    behind its own branch (see "Regions" above); the sum is a flat region's one value's gradient."""
    rows = tl.zeros([BM], tl.float32)
    if n_lo < n_hi:
        for n0 in range(n_lo, n_hi, BN):
            dq, part = _dq_step(dq, q, do, lse, delta, k_base, v_base, vals, dvals, c, slope, offs_m, offs_d, offs_dv,
                                n0, m0, lo, hi, Lq, n_vals, stride_kn, stride_vn, q_offset, qk_scale,
                                seed, drop_bh, drop_t, drop_scale, kb_row,
                                D, DV, D_PAD, DV_PAD, KIND, CAUSAL, MASK, DROPOUT, KEYBIAS, DIAGONALS, DETERMINISTIC, BM,
                                BN, PRECISION)
            rows += part
    return dq, tl.sum(rows, 0)


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_base, v_base, vals, dvals, slope, offs_m, offs_d, offs_dv, m0, lo, hi, e1, e2, full, Lq,
    n_vals, stride_kn, stride_vn, q_offset, qk_scale, t_lo, t_hi, seed, drop_bh, drop_t, drop_scale, kb_row,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, MAIN: tl.constexpr,
    FLAT: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, KEYBIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    DETERMINISTIC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
    LOW: tl.constexpr, HIGH: tl.constexpr,
):
    """``(dq, the low and the high flat ranges' dS sums)`` of one query block over every key block
    (``_dq_kernel``'s regions), added to ``dq``."""
    diagonals = BIAS_GRAD and MAIN == 2
    lo_sum = tl.sum(tl.zeros([BM], tl.float32), 0)
    hi_sum = tl.sum(tl.zeros([BM], tl.float32), 0)
    if FLAT:
        c_lo = _flat_value(vals, t_lo - (Lq - 1), LOW)
        dq, lo_sum = _dq_region(dq, lo, e1, q, do, lse, delta, k_base, v_base, vals, dvals, c_lo, slope, offs_m, offs_d,
                                offs_dv, m0, lo, hi, Lq, n_vals, stride_kn, stride_vn, q_offset, qk_scale, seed,
                                drop_bh, drop_t, drop_scale, kb_row, D, DV, D_PAD, DV_PAD, LOW, CAUSAL, False,
                                DROPOUT, KEYBIAS, False, DETERMINISTIC, BM, BN, PRECISION)
    dq, _ = _dq_region(dq, e1, e2, q, do, lse, delta, k_base, v_base, vals, dvals, 0.0, slope, offs_m, offs_d, offs_dv,
                       m0, lo, hi, Lq, n_vals, stride_kn, stride_vn, q_offset, qk_scale, seed, drop_bh, drop_t,
                       drop_scale, kb_row, D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, False, DROPOUT, KEYBIAS, diagonals,
                       DETERMINISTIC, BM, BN, PRECISION)
    if FLAT:
        c_hi = _flat_value(vals, t_hi - (Lq - 1), HIGH)
        dq, hi_sum = _dq_region(dq, e2, full, q, do, lse, delta, k_base, v_base, vals, dvals, c_hi, -slope, offs_m,
                                offs_d, offs_dv, m0, lo, hi, Lq, n_vals, stride_kn, stride_vn, q_offset, qk_scale, seed,
                                drop_bh, drop_t, drop_scale, kb_row, D, DV, D_PAD, DV_PAD, HIGH, CAUSAL, False,
                                DROPOUT, KEYBIAS, False, DETERMINISTIC, BM, BN, PRECISION)
    dq, _ = _dq_region(dq, full, hi, q, do, lse, delta, k_base, v_base, vals, dvals, 0.0, slope, offs_m, offs_d,
                       offs_dv, m0, lo, hi, Lq, n_vals, stride_kn, stride_vn, q_offset, qk_scale, seed, drop_bh,
                       drop_t, drop_scale, kb_row, D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, True, DROPOUT, KEYBIAS,
                       diagonals, DETERMINISTIC, BM, BN, PRECISION)
    return dq, lo_sum, hi_sum


@triton.jit(do_not_specialize=["Lq", "Lk", "q_offset", "n_vals", "t_lo", "t_hi", "drop_t"])
def _dq_kernel(
    Q, K, V, DO, DQ, STATS, VALS, DVALS, SLOPES, STARTS, ENDS,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm, stride_vals, stride_dvals, stride_slot, KB, stride_kbb, stride_kbh,
    H, GROUP, Lq, Lk, q_offset, qk_scale, scale, n_vals, t_lo, t_hi, SEED, drop_t, drop_scale,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    MAIN: tl.constexpr, FLAT: tl.constexpr, CAUSAL: tl.constexpr, RANGES: tl.constexpr, DROPOUT: tl.constexpr,
    KEYBIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, DETERMINISTIC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr, LOW: tl.constexpr,
    HIGH: tl.constexpr,
):
    """dq of one query block, and its share of the per-offset values' gradient."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    seed = _seed(SEED, DROPOUT)
    b, h = pid_bh // H, pid_bh % H
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d, offs_dv = tl.arange(0, D_PAD), tl.arange(0, DV_PAD)
    q = _load_block(Q + b * stride_qb + h * stride_qh, offs_m, stride_qm, offs_d, Lq, D, D_PAD, True)  # (BM, D)
    do = _load_block(DO + b * stride_db + h * stride_dh, offs_m, stride_dm, offs_dv, Lq, DV, DV_PAD, True)
    lse, delta = _row_stats(tl.load(STATS + pid_bh * Lq + offs_m, mask=offs_m < Lq, other=_NO_ROW))  # (BM,) each
    k_base = K + b * stride_kb + (h // GROUP) * stride_kh
    v_base = V + b * stride_vb + (h // GROUP) * stride_vh
    vals = VALS + h * stride_vals + (Lq - 1)
    dvals = DVALS + h * stride_dvals + (pid_bh * tl.num_programs(0) + pid_m) * stride_slot  # own slot if deterministic
    drop_bh = pid_bh  # dropout's (example, head) counter word
    kb_row = KB + b * stride_kbb + h * stride_kbh
    slope = 0.0
    if MAIN >= 3:
        slope = tl.load(SLOPES + h) * _LOG2E
    lo, hi = _key_range(STARTS, ENDS, b, Lk, RANGES)
    dq = tl.zeros([BM, D_PAD], tl.float32)
    first, lo = _square_start(lo, hi, DROPOUT and RANGES)
    hi, e1, e2, full = _row_segments(lo, hi, m0, Lq, q_offset, t_lo, t_hi, CAUSAL, FLAT, BM, BN)
    if _no_holes(kb_row, Lk, KEYBIAS):  # a key mask hiding no key inside [lo, hi): no per-key terms
        dq, lo_sum, hi_sum = _dq_blocks(
            dq, q, do, lse, delta, k_base, v_base, vals, dvals, slope, offs_m, offs_d, offs_dv, m0, lo, hi, e1, e2, full, Lq,
            n_vals, stride_kn, stride_vn, q_offset, qk_scale, t_lo, t_hi, seed, drop_bh, drop_t, drop_scale, kb_row,
            D, DV, D_PAD, DV_PAD, MAIN, FLAT, CAUSAL, DROPOUT, False, BIAS_GRAD, DETERMINISTIC, BM, BN, PRECISION, LOW, HIGH)
    else:
        dq, lo_sum, hi_sum = _dq_blocks(
            dq, q, do, lse, delta, k_base, v_base, vals, dvals, slope, offs_m, offs_d, offs_dv, m0, lo, hi, e1, e2, full, Lq,
            n_vals, stride_kn, stride_vn, q_offset, qk_scale, t_lo, t_hi, seed, drop_bh, drop_t, drop_scale, kb_row,
            D, DV, D_PAD, DV_PAD, MAIN, FLAT, CAUSAL, DROPOUT, KEYBIAS, BIAS_GRAD, DETERMINISTIC, BM, BN, PRECISION, LOW, HIGH)
    if DROPOUT and RANGES:
        if first < lo:
            dq, _ = _dq_step(dq, q, do, lse, delta, k_base, v_base, vals, dvals, 0.0, slope, offs_m, offs_d, offs_dv,
                             first // 16 * 16, m0, first, lo, Lq, n_vals, stride_kn, stride_vn, q_offset, qk_scale,
                             seed, drop_bh, drop_t, drop_scale, kb_row, D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, True,
                             DROPOUT, KEYBIAS, BIAS_GRAD and MAIN == 2, DETERMINISTIC, BM, BN, PRECISION)
    tl.store(DQ + pid_bh * Lq * D + offs_m[:, None] * D + offs_d[None, :],  # DQ: contiguous (B, H, Lq, d)
             (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
    if BIAS_GRAD and LOW == 1:  # the flat tiles' whole gradient lands on the range's one entry
        tl.atomic_add(dvals + tl.maximum(t_lo, 0), lo_sum)
        if DETERMINISTIC:
            tl.debug_barrier()
        tl.atomic_add(dvals + tl.minimum(t_hi, n_vals - 1), hi_sum)


# ------------------------------------------------------------------------------------------- wrapper
@dataclass(frozen=True)
class _Blocks:
    fwd: tuple[int, int, int, int]  # BM, BN, warps, stages
    dkdv: tuple[int, int, int, int]
    dq: tuple[int, int, int, int]
    fwd_offsets: tuple[int, int, int, int] | None = None  # the forward that reads per-offset values; fwd if None
    gather_split: int = 1  # that forward's gathering (and masked) blocks in this many steps of BN / gather_split keys
    split_flat: bool = False  # that forward, with a flat range and no dropout, as two launches (_fwd_kernel's PART)
    fwd_registers: int | None = None  # the forward's register cap (ptxas's maxnreg) for 16-bit inputs; None: ptxas's
    dkdv_dropout: tuple[int, int, int, int] | None = None  # dk/dv with dropout (its mask's registers); dkdv if None

    def __post_init__(self) -> None:
        tiles = {"fwd": self.fwd, "dkdv": self.dkdv, "dq": self.dq, "fwd_offsets": self.fwd_offsets,
                 "dkdv_dropout": self.dkdv_dropout}
        for name, tile in tiles.items():
            if tile is not None and (tile[0] % 16 or tile[1] % 16):
                raise ValueError(f"{name} tile {tile[:2]}: its BM and BN must be multiples of 16 (dropout draws the "
                                 "four scores {i, i + 8} x {j, j + 8} of 16 x 16 squares together, _kept)")
        width = (self.fwd_offsets or self.fwd)[1]
        if width % self.gather_split or width // self.gather_split % 16:
            raise ValueError(f"gather_split {self.gather_split}: the forward's gathering steps of BN / gather_split keys "
                             f"must be whole multiples of 16, got {width} / {self.gather_split}")
        if self.dq[1] > self.dq[0]:
            raise ValueError(f"dq tile {self.dq[:2]}: its BN must be at most its BM (the values' gradient sums each tile "
                             "along its diagonals as two halves of a cyclic skew, _diagonal_sums)")

    def keys(self, dropout: bool) -> tuple[int, int, int, int]:
        """(BM, BN, warps, stages) of the dk/dv kernel."""
        return self.dkdv_dropout if dropout and self.dkdv_dropout is not None else self.dkdv

    def forward(self, offsets: bool) -> tuple[tuple[int, int, int, int], int]:
        """(BM, BN, warps, stages) of the forward, and its GS."""
        if offsets and self.fwd_offsets is not None:
            return self.fwd_offsets, self.gather_split
        return self.fwd, 1


#: (BM, BN, warps, stages) per kernel on a GPU, by head dimension. d <= 64, measured on an H100 (bf16, B=4, H=16,
#: forward; ``benchmarks/gpu_kernel.py``, docs/benchmarks/gpu/kernel.md). No term or a closed form (ALiBi): 64 x 64
#: (no term at L = 16384: 10.3 ms against 11.9 for 64 x 32). Per-offset values: 64 x 32, whose gathered tiles hold
#: half the addresses (T5 at L = 16384: 12.7 ms against 13.2 for 64 x 64, 14.2 for 128 x 64 with 8 warps, 14.4 for
#: 128 x 128 with 8 warps; every tile gathering: 18.6 ms against 34.0 for 64 x 64). Training steps (T5, L = 16384):
#: dk/dv 32 x 128 53.6 ms against 64 x 64 55.4; dq 64 x 64 55.6 ms against 128 x 64 56.5 and 64 x 32 57.9.
#: Larger head dimensions keep the fused-attention tutorial's shapes (not measured here). ``gather_split=2`` with a
#: 64 x 64 forward of per-offset values is in the sweep, not yet timed (docs/benchmarks/gpu/kernel.md). The forward's
#: 128-register cap keeps four 4-warp blocks per SM (65536 registers) where ptxas would take 150-170 for ALiBi and
#: lose one, with no spill (docs/benchmarks/gpu/kernel-anatomy.md; not yet timed). dk/dv with dropout keeps dkdv's
#: shape until the sweep (``dkdv_dropout``: 32 x 128 with 8 warps holds the mask without spilling) is timed.
GPU_BLOCKS: dict[int, _Blocks] = {
    64: _Blocks((64, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), fwd_offsets=(64, 32, 4, 3), fwd_registers=128),
    128: _Blocks((128, 64, 8, 3), (32, 128, 8, 3), (128, 32, 8, 2)),
    256: _Blocks((64, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2)),
}
INTERPRETER_BLOCKS = _Blocks((16, 16, 1, 1), (16, 16, 1, 1), (16, 16, 1, 1))  # many tiles at test sizes


def _blocks(head_dim: int, device: torch.device) -> _Blocks:
    """Tile sizes: small under the interpreter, per head dimension on a GPU."""
    if device.type != "cuda":
        return INTERPRETER_BLOCKS
    return GPU_BLOCKS[min(d for d in GPU_BLOCKS if d >= max(head_dim, 16))]


@dataclass(frozen=True)
class TritonSpec:
    """Everything about one call that is not a tensor."""

    bias_kind: int  # BIAS_NONE, BIAS_OFFSETS, BIAS_CAUSAL_LINEAR, BIAS_SYMMETRIC_LINEAR
    causal: bool
    scale: float
    q_offset: int
    flat: tuple[int, int] | None  # indices into the values (OffsetBias.flat_indices) or None
    deterministic: bool = False
    dropout_p: float = 0.0  # attention dropout drawn in the kernels (:func:`_kept`), its seed a device tensor
    key_real: bool = False  # the per-key terms carry real values (key_bias), not only a mask: dk/dv adds them


def _dropout_args(spec: TritonSpec, seed: torch.Tensor | None) -> dict:
    """The kernels' dropout arguments: the seed's (1,) int64 tensor, the threshold of :func:`_kept` (``round(p *
    2**16) * 2**16``, a uint32 whose bits travel as an int32) and ``1 / (1 - p')`` with ``p'`` the rounded ``p``
    (relpos's rounding, relpos.backends._dropout.effective_p)."""
    if not spec.dropout_p:
        return dict(SEED=seed, drop_t=0, drop_scale=1.0, DROPOUT=False)
    threshold = round(spec.dropout_p * 65536)  # at most 65535: dispatch refuses a p that rounds to 1 (check_dropout_p)
    bits = threshold << 16
    return dict(SEED=seed, drop_t=bits - (1 << 32) if bits >= 1 << 31 else bits,
                drop_scale=1.0 / (1.0 - threshold / 65536), DROPOUT=True)


def _next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2`` is a constexpr function: 3 us a call)."""
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` (``triton.cdiv`` is a constexpr function: 3 us a call, three calls per training step)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    return max(16, _next_pow2(n))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=64)
def _kinds(spec: TritonSpec, wide: bool = False) -> dict:
    """The kernels' tile kinds: ``MAIN`` for the tiles the diagonal or a mask cuts (and, for per-offset values, the
    tiles outside the flat ranges), ``LOW`` / ``HIGH`` for the tiles wholly at offsets <= ``t_lo`` / >= ``t_hi``
    (:func:`_region_bounds`), ``FLAT`` whether those regions are split off at all. ``wide``: positions reach
    ``EXACT_POSITIONS`` (:func:`_wide`), so ALiBi's kinds convert them instead. Kept per kind of call (the backward
    asks per call); callers expand it, never change it."""
    kinds = _tile_kinds(spec)
    if wide:
        kinds.update({name: kind + WIDE for name, kind in kinds.items() if name != "FLAT" and kind >= RAMP})
    return kinds


def _wide(spec: TritonSpec, query_length: int, key_length: int) -> bool:
    """Whether a key, or a query row plus ``q_offset``, reaches ``EXACT_POSITIONS``."""
    return max(key_length, query_length + spec.q_offset) >= EXACT_POSITIONS


def _tile_kinds(spec: TritonSpec) -> dict:
    if spec.bias_kind == BIAS_OFFSETS:
        return dict(MAIN=GATHER, LOW=SCALAR, HIGH=SCALAR, FLAT=spec.flat is not None)
    if spec.bias_kind in (BIAS_CAUSAL_LINEAR, BIAS_SYMMETRIC_LINEAR) and spec.causal:  # every visible key: j <= i
        return dict(MAIN=RAMP, LOW=RAMP, HIGH=NONE, FLAT=True)
    if spec.bias_kind == BIAS_CAUSAL_LINEAR:  # m * (j - i) left of the diagonal, nothing right of it
        return dict(MAIN=CAUSAL_LINEAR, LOW=RAMP, HIGH=NONE, FLAT=True)
    if spec.bias_kind == BIAS_SYMMETRIC_LINEAR:  # m * (j - i) left of the diagonal, -m * (j - i) right of it
        return dict(MAIN=SYMMETRIC, LOW=RAMP, HIGH=RAMP, FLAT=True)
    return dict(MAIN=NONE, LOW=NONE, HIGH=NONE, FLAT=False)


def _region_bounds(spec: TritonSpec, query_length: int, n_vals: int) -> tuple[int, int]:
    """``(t_lo, t_hi)`` in the values' indices (offset ``j - i`` at ``j - i + Lq - 1``): a flat range's ends, or, for
    ALiBi, the diagonal ``j = i + q_offset`` both; ``(-1, n_vals)`` (no region) without either."""
    if spec.bias_kind == BIAS_OFFSETS:
        return spec.flat if spec.flat is not None else (-1, n_vals)
    if spec.bias_kind in (BIAS_CAUSAL_LINEAR, BIAS_SYMMETRIC_LINEAR):
        return (query_length - 1 + spec.q_offset,) * 2
    return -1, n_vals


_last_padded = KeptResult()  # _padded_values()'s last input and result


def _padded_values(values: torch.Tensor, spec: TritonSpec) -> torch.Tensor:
    """(Hb, PAD + n + PAD) fp32 values times log2(e), the kernels' units: tiles read past either end without a bounds
    mask. The last result is kept: a model's layers share one bias per forward, so its
    values are padded once, not once per layer (:mod:`relpos._reuse` permitting), and again when they change
    in place. A call whose kernels read no values (no position term, ALiBi's closed forms) gets one zero row per
    device, built once."""
    if spec.bias_kind != BIAS_OFFSETS:
        return _unused_values(values.device)
    key = storage_key(values)
    padded = _last_padded.get(key, values.device)
    if padded is None:
        padded = torch.nn.functional.pad(values.float(), (PAD, PAD)).mul_(LOG2E)
        _last_padded.keep(key, values.device, (values,), padded)
    return padded


@functools.lru_cache(maxsize=64)
def _forward_plan(spec: TritonSpec, blocks: _Blocks, dim: int, dim_v: int, dtype: torch.dtype, ranges: bool,
                  key_bias: bool, wide: bool) -> tuple[int, tuple[int, ...], dict]:
    """(BM, parts, the forward's constant keyword arguments) for calls of this kind with these tiles: worked out once,
    not per call (a model's layers and steps repeat a handful of kinds; the Python per launch is what a GPU waits
    for). The tiles are part of the key: tests and tools/kernel_anatomy.py change them between calls."""
    (bm, bn, warps, stages), split = blocks.forward(spec.bias_kind == BIAS_OFFSETS)
    two_parts = blocks.split_flat and spec.flat is not None and spec.bias_kind == BIAS_OFFSETS and not spec.dropout_p
    dropout = {name: value for name, value in _dropout_args(spec, None).items() if name != "SEED"}
    constants = dict(D=dim, DV=dim_v, D_PAD=_pow2(dim), DV_PAD=_pow2(dim_v), **_kinds(spec, wide), CAUSAL=spec.causal,
                     RANGES=ranges, BM=bm, BN=bn, PRECISION=_precision(dtype), KEYBIAS=key_bias, GS=split,
                     SCALE_POS=spec.scale >= 0, num_warps=warps, num_stages=stages, **dropout)
    if blocks.fwd_registers is not None and dtype != torch.float32:  # fp32 tiles need more (no tensor cores)
        constants["maxnreg"] = blocks.fwd_registers
    return bm, (1, 2) if two_parts else (0,), constants


def _launch_forward(q, k, v, padded, slopes, starts, ends, key_terms, seed, spec: TritonSpec):
    """The forward kernel: ``(out (B, H, Lq, dv), lse (B, H, Lq) fp32, base 2)``; inputs as :func:`triton_attention`
    prepares them (``padded``: :func:`_padded_values`)."""
    batch, heads, query_length, dim = q.shape
    key_length, dim_v = k.shape[2], v.shape[3]
    bm, parts, constants = _forward_plan(spec, _blocks(dim, q.device), dim, dim_v, q.dtype, starts is not None,
                                         key_terms is not None, _wide(spec, query_length, key_length))
    out = q.new_empty(batch, heads, query_length, dim_v)  # (B, H, Lq, dv)
    lse = torch.empty(batch, heads, query_length, device=q.device, dtype=torch.float32)  # base 2
    t_lo, t_hi = _region_bounds(spec, query_length, padded.shape[1] - 2 * PAD)
    for part in parts:  # part 2 reads part 1's out and lse: launched after it, in order
        _fwd_kernel[(_cdiv(query_length, bm), batch * heads)](
            q, k, v, out, lse, padded[:, PAD:], slopes, starts, ends,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], _head_stride(padded),
            *_key_args(key_terms, q.device),
            heads, heads // k.shape[1], query_length, key_length, spec.q_offset, spec.scale * LOG2E, t_lo, t_hi,
            SEED=seed, PART=part, **constants,
        )
    return out, lse


def _launch_backward(grad_out, q, k, v, out, lse, padded, slopes, starts, ends, key_terms, seed, spec: TritonSpec,
                     bias_grad: bool):
    """The three backward kernels: ``(dq, dk, dv, d values (Hb, n) fp32 or None)``."""
    batch, heads, query_length, dim = q.shape
    kv_heads, key_length, dim_v = k.shape[1], k.shape[2], v.shape[3]
    n_vals = padded.shape[1] - 2 * PAD
    blocks = _blocks(dim, q.device)
    common = dict(D=dim, DV=dim_v, D_PAD=_pow2(dim), DV_PAD=_pow2(dim_v), **_kinds(spec, _wide(spec, query_length, key_length)),
                  CAUSAL=spec.causal, RANGES=starts is not None, PRECISION=_precision(q.dtype), KEYBIAS=key_terms is not None,
                  **_dropout_args(spec, seed))
    t_lo, t_hi = _region_bounds(spec, query_length, n_vals)
    vals, keys = padded[:, PAD:], _key_args(key_terms, q.device)

    stats = torch.empty(batch, heads, query_length, 2, device=q.device, dtype=torch.float32)  # (B, H, Lq, 2)
    _delta_kernel[(_cdiv(query_length, 64), batch * heads)](
        out, grad_out, lse, stats, *out.stride()[:3], *grad_out.stride()[:3], heads, query_length,
        DV=dim_v, DV_PAD=_pow2(dim_v), BM=64,
    )
    stats = stats.view(torch.int64)  # (B, H, Lq, 1): each row's (lse, delta) as one word (_row_stats)
    bm, bn, warps, stages = blocks.keys(bool(spec.dropout_p))
    dk = torch.empty(batch, kv_heads, key_length, dim, device=k.device, dtype=k.dtype)
    dv = torch.empty(batch, kv_heads, key_length, dim_v, device=v.device, dtype=v.dtype)
    _dkdv_kernel[(_cdiv(key_length, bn), batch * kv_heads)](
        q, k, v, grad_out, dk, dv, stats, vals, slopes, starts, ends,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], _head_stride(padded), *keys,
        heads, kv_heads, heads // kv_heads, query_length, key_length, spec.q_offset, spec.scale * LOG2E,
        spec.scale, t_lo, t_hi, **common, KEYREAL=spec.key_real, BM=bm, BN=bn, num_warps=warps, num_stages=stages,
    )
    bm, bn, warps, stages = blocks.dq
    programs = _cdiv(query_length, bm) * batch * heads
    slots = programs if (bias_grad and spec.deterministic) else 1
    dvals = torch.zeros(slots, padded.shape[0], n_vals, device=q.device, dtype=torch.float32)  # (slots, Hb, n)
    dq = torch.empty(batch, heads, query_length, dim, device=q.device, dtype=q.dtype)  # contiguous, whatever q's layout
    _dq_kernel[(_cdiv(query_length, bm), batch * heads)](
        q, k, v, grad_out, dq, stats, vals, dvals, slopes, starts, ends,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], _head_stride(padded),
        dvals.stride(1) if padded.shape[0] > 1 else 0, dvals.stride(0) if slots > 1 else 0, *keys,
        heads, heads // kv_heads, query_length, key_length, spec.q_offset, spec.scale * LOG2E, spec.scale,
        n_vals, t_lo, t_hi, **common, BIAS_GRAD=bias_grad, DETERMINISTIC=spec.deterministic, BM=bm, BN=bn,
        num_warps=warps, num_stages=stages,
    )
    if not bias_grad:
        return dq, dk, dv, None
    return dq, dk, dv, dvals[0] if slots == 1 else dvals.sum(0)  # (Hb, n): the slots summed in a fixed order


def _forward(q, k, v, values, slopes, starts, ends, key_terms, seed, spec: TritonSpec) -> tuple:
    """The forward from :func:`triton_attention`'s inputs: ``(q, k, v, padded, out, lse)``, q, k and v as launched
    (last dimension contiguous) and the padded values, which the backward reads again."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))  # (B, H, Lq, d), (B, Hkv, Lk, d), (B, Hkv, Lk, dv)
    padded = _padded_values(values, spec)  # (Hb, n + 2 PAD)
    return q, k, v, padded, *_launch_forward(q, k, v, padded, slopes, starts, ends, key_terms, seed, spec)


class _TritonAttention(torch.autograd.Function):
    """Eager autograd: the kernels launched directly (the custom ops below serve torch.compile)."""

    @staticmethod
    def forward(ctx, q, k, v, values, slopes, starts, ends, key_terms, seed, spec: TritonSpec):
        q, k, v, padded, out, lse = _forward(q, k, v, values, slopes, starts, ends, key_terms, seed, spec)
        ctx.save_for_backward(q, k, v, out, lse, padded, slopes, starts, ends, key_terms, seed)
        ctx.spec, ctx.values_dtype, ctx.values_grad = spec, values.dtype, values.requires_grad
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, padded, slopes, starts, ends, key_terms, seed = ctx.saved_tensors
        bias_grad = ctx.values_grad and ctx.spec.bias_kind == BIAS_OFFSETS
        dq, dk, dv, dvals = _launch_backward(_last_dim_contiguous(grad_out), q, k, v, out, lse, padded, slopes, starts,
                                             ends, key_terms, seed, ctx.spec, bias_grad)
        grad_values = dvals.to(ctx.values_dtype) if bias_grad else None  # (Hb, n)
        return dq, dk, dv, grad_values, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------- torch.compile
# Under torch.compile the kernels run as two opaque custom ops (relpos::triton_attention_fwd / _bwd) with their
# output shapes declared (register_fake) and the backward registered for autograd: the compiled graph calls
# them, and CUDA graphs (mode="reduce-overhead") capture them. The eager path keeps _TritonAttention.

def _op_spec(bias_kind: int, causal: bool, scale: float, q_offset: int, flat_lo: int, flat_hi: int, has_flat: bool,
             deterministic: bool, dropout_p: float, key_real: bool) -> TritonSpec:
    flat = (flat_lo, flat_hi) if has_flat else None
    return TritonSpec(bias_kind, causal, scale, q_offset, flat, deterministic, dropout_p, key_real)


def _spec_args(spec: TritonSpec) -> tuple:
    flat_lo, flat_hi = spec.flat if spec.flat is not None else (0, 0)
    return (spec.bias_kind, spec.causal, spec.scale, spec.q_offset, flat_lo, flat_hi, spec.flat is not None,
            spec.deterministic, spec.dropout_p, spec.key_real)


_SPEC_SCHEMA = ("int bias_kind, bool causal, float scale, int q_offset, int flat_lo, int flat_hi, bool has_flat, "
                "bool deterministic, float dropout_p, bool key_real")  # the schemas are written out: no inference from annotations


@torch.library.custom_op(
    "relpos::triton_attention_fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor values, Tensor slopes, Tensor? starts, Tensor? ends, Tensor? key_terms, "
           f"Tensor? seed, {_SPEC_SCHEMA}) -> (Tensor, Tensor)",
)
def _op_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, values: torch.Tensor, slopes: torch.Tensor,
                starts: torch.Tensor | None, ends: torch.Tensor | None, key_terms: torch.Tensor | None,
                seed: torch.Tensor | None, bias_kind: int, causal: bool, scale: float, q_offset: int, flat_lo: int,
                flat_hi: int, has_flat: bool, deterministic: bool, dropout_p: float,
                key_real: bool) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _op_spec(bias_kind, causal, scale, q_offset, flat_lo, flat_hi, has_flat, deterministic, dropout_p, key_real)
    return _forward(q, k, v, values, slopes, starts, ends, key_terms, seed, spec)[4:]  # (out, lse)


@_op_forward.register_fake
def _(q, k, v, values, slopes, starts, ends, key_terms, seed, *spec_args):
    out = q.new_empty(*q.shape[:3], v.shape[-1])  # (B, H, Lq, dv)
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)  # (B, H, Lq)


@torch.library.custom_op(
    "relpos::triton_attention_bwd", mutates_args=(),
    schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor values, Tensor slopes, "
           f"Tensor? starts, Tensor? ends, Tensor? key_terms, Tensor? seed, {_SPEC_SCHEMA}, bool bias_grad) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _op_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, values: torch.Tensor, slopes: torch.Tensor, starts: torch.Tensor | None,
                 ends: torch.Tensor | None, key_terms: torch.Tensor | None, seed: torch.Tensor | None, bias_kind: int,
                 causal: bool, scale: float, q_offset: int, flat_lo: int, flat_hi: int, has_flat: bool,
                 deterministic: bool, dropout_p: float, key_real: bool,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = _op_spec(bias_kind, causal, scale, q_offset, flat_lo, flat_hi, has_flat, deterministic, dropout_p, key_real)
    q, k, v, grad_out = (_last_dim_contiguous(t) for t in (q, k, v, grad_out))
    dq, dk, dv, dvals = _launch_backward(grad_out, q, k, v, out, lse, _padded_values(values, spec), slopes, starts, ends,
                                         key_terms, seed, spec, bias_grad)
    return dq, dk, dv, dvals if dvals is not None else values.new_zeros(0, dtype=torch.float32)


@_op_backward.register_fake
def _(grad_out, q, k, v, out, lse, values, slopes, starts, ends, key_terms, seed, *spec_args):
    bias_grad = spec_args[-1]
    dvals = values.new_empty(values.shape if bias_grad else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dvals  # contiguous, as the kernels write them


def _op_setup(ctx, inputs, output) -> None:
    q, k, v, values, slopes, starts, ends, key_terms, seed, *spec_args = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], values, slopes, starts, ends, key_terms, seed)
    ctx.spec_args = spec_args


def _op_gradients(ctx, grad_out, grad_lse):
    q, k, v, out, lse, values, slopes, starts, ends, key_terms, seed = ctx.saved_tensors
    bias_grad = bool(ctx.needs_input_grad[3]) and ctx.spec_args[0] == BIAS_OFFSETS
    dq, dk, dv, dvals = torch.ops.relpos.triton_attention_bwd(grad_out, q, k, v, out, lse, values, slopes, starts, ends,
                                                              key_terms, seed, *ctx.spec_args, bias_grad)
    grads = (dq, dk, dv, dvals.to(values.dtype) if bias_grad else None)
    return grads + (None,) * (5 + len(ctx.spec_args))


_op_forward.register_autograd(_op_gradients, setup_context=_op_setup)


def _key_args(key_terms: torch.Tensor | None, device: torch.device) -> tuple:
    """The kernels' (KB, stride over examples, stride over heads) for ``key_terms`` (Bk, Hk, Lk) in log2 units;
    broadcast dimensions get stride 0. Without key terms: an unused pointer on ``device``."""
    if key_terms is None:
        return _unused(device), 0, 0
    batch_stride = key_terms.stride(0) if key_terms.shape[0] > 1 else 0
    return key_terms, batch_stride, key_terms.stride(1) if key_terms.shape[1] > 1 else 0


def _head_stride(padded: torch.Tensor) -> int:
    """Per-head stride of the values; 0 for one row shared by every head."""
    return padded.stride(0) if padded.shape[0] > 1 else 0


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), not TF32: relpos's fp32 results are exact everywhere."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _mask_bounds(key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) int32 first kept key and one past the last (``Lk`` and 0 for an example with none), computed on the
    mask's device: nothing is read back to the CPU."""
    key_length = key_mask.shape[-1]
    index = torch.arange(key_length, device=key_mask.device)  # (Lk,)
    starts = torch.where(key_mask, index, key_length).amin(-1)  # (B,)
    ends = torch.where(key_mask, index + 1, 0).amax(-1)  # (B,)
    return starts.to(torch.int32), ends.to(torch.int32)


_last_key_mask = KeptResult()  # _key_mask_terms()'s last mask and result


def _key_mask_terms(key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key terms (B, 1, Lk + KEY_PAD) fp32: 0 or -inf, starts (B,), ends (B,))`` for a boolean key mask read on the
    device (the ``KEY_PAD`` keys past the end hidden too, so a tile loads its terms with no bounds check; the very
    last entry, which no tile reads, is 1.0 where the example hides a key between its first and last kept one, and
    0.0 where it does not, which the forward then skips the terms for): the blocks outside each example's kept keys
    are skipped too. The last is kept: a model's layers pass one padding mask per
    forward, so its operators (launches on a GPU) run once, not once per layer."""
    key = storage_key(key_mask) if may_reuse(key_mask.device) else None  # never under compile: no storage there
    kept = None if key is None else _last_key_mask.get(key, key_mask.device)
    if kept is None:
        padded = torch.nn.functional.pad(key_mask, (0, KEY_PAD))  # (B, Lk + KEY_PAD)
        terms = torch.where(padded, 0.0, float("-inf"))  # fp32
        starts, ends = _mask_bounds(key_mask)  # (B,), (B,)
        terms[:, -1] = key_mask.sum(-1) < ends - starts  # 1.0: a hidden key between the first and last kept one
        kept = (terms[:, None], starts, ends)  # (B, 1, Lk + KEY_PAD), (B,), (B,)
        if key is not None:
            _last_key_mask.keep(key, key_mask.device, (key_mask,), kept)
    return kept


_last_key_bias = KeptResult()  # _key_bias_terms()'s last inputs and result


def _key_bias_terms(key_bias: torch.Tensor, key_mask: torch.Tensor | None) -> tuple:
    """``(key terms (B|1, H|1, Lk + KEY_PAD) fp32, starts, ends)`` for a real-valued per-key term ``key_bias``
    ``(B|1, H|1, Lk)`` (natural-log units), in log2 units, ``-inf`` on the keys ``key_mask`` hides and past ``Lk``; the
    flag entry 1.0 (:func:`_key_mask_terms`), so every tile adds the terms; starts and ends bound each example's
    blocks as a key mask's do (None without a mask). Kept for the layers that share both, as the key mask's terms."""
    named = (key_bias,) if key_mask is None else (key_bias, key_mask)
    key = tuple(map(storage_key, named)) if may_reuse(key_bias.device) else None
    kept = None if key is None else _last_key_bias.get(key, key_bias.device)
    if kept is not None:
        return kept
    terms = key_bias.float() * LOG2E  # (B|1, H|1, Lk)
    starts = ends = None
    if key_mask is not None:
        terms = terms.masked_fill(~key_mask[:, None, :], float("-inf"))  # (B, H|1, Lk)
        starts, ends = _mask_bounds(key_mask)  # (B,), (B,)
    terms = torch.nn.functional.pad(terms, (0, KEY_PAD), value=float("-inf"))  # (.., Lk + KEY_PAD)
    terms[..., -1] = 1.0  # read as "holes": no tile skips the terms
    kept = (terms, starts, ends)
    if key is not None:
        _last_key_bias.keep(key, key_bias.device, named, kept)
    return kept


_UNUSED: dict[torch.device, torch.Tensor] = {}
_UNUSED_VALUES: dict[torch.device, torch.Tensor] = {}


def _unused_values(device: torch.device) -> torch.Tensor:
    """(1, 2 PAD + 1) fp32 zeros on ``device``: the padded values of a call whose kernels read none."""
    if device not in _UNUSED_VALUES:
        _UNUSED_VALUES[device] = torch.zeros(1, 2 * PAD + 1, device=device, dtype=torch.float32)
    return _UNUSED_VALUES[device]


def _unused(device: torch.device) -> torch.Tensor:
    """A (1,) fp32 zero on ``device`` for kernel arguments a call never reads (allocated once per device)."""
    if device not in _UNUSED:
        _UNUSED[device] = torch.zeros(1, device=device, dtype=torch.float32)
    return _UNUSED[device]


def triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    values: torch.Tensor | None,
    slopes: torch.Tensor | None,
    key_ranges: tuple[tuple[int, ...], tuple[int, ...]] | None,
    key_mask: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    spec: TritonSpec,
) -> torch.Tensor:
    """(B, H, Lq, dv) attention through the kernels; inputs already validated (relpos.attention).

    ``values``: (Hb, Lq + Lk - 1) per-offset bias (Hb = 1 or H), read when ``spec.bias_kind`` is
    ``BIAS_OFFSETS``; ``slopes``: (H,) for the linear kinds; ``key_ranges``: per-example kept keys
    ``(starts, ends)``, whose tiles are skipped; ``key_mask``: a boolean (B, Lk) key padding mask of any
    pattern (holes too), applied to every tile's keys (``-inf``) instead (nothing skipped); ``key_bias``: a real
    per-key term (B|1, H|1, Lk) added to every score (natural-log units, no gradient; ``spec.key_real``), the key mask
    folded in; ``seed``: dropout's (1,) int64 seed on the device (``spec.dropout_p > 0``).
    """
    device = query.device
    if values is None or spec.bias_kind != BIAS_OFFSETS:
        values = _unused(device)  # (1,): never read (_padded_values)
    if slopes is None:
        slopes = _unused(device)
    starts = ends = None
    if key_ranges is not None:
        starts = torch.tensor(key_ranges[0], device=device, dtype=torch.int32)  # (B,)
        ends = torch.tensor(key_ranges[1], device=device, dtype=torch.int32)
    slopes = slopes.float().contiguous()  # (H,): the kernels scale by log2(e) as they load
    key_terms = None
    if key_bias is not None:
        key_terms, starts, ends = _key_bias_terms(key_bias, key_mask)
    elif key_mask is not None:
        key_terms, starts, ends = _key_mask_terms(key_mask)
    if seed is None:
        seed = _unused(device)  # never read (no dropout)
    if torch.compiler.is_compiling():  # opaque custom ops the compiled graph calls
        out, _ = torch.ops.relpos.triton_attention_fwd(query, key, value, values, slopes, starts, ends, key_terms, seed,
                                                       *_spec_args(spec))
        return out
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, values))):
        # nothing to differentiate (inference, a decoding step): the launch without autograd.Function's bookkeeping
        # (about 20 us a call on the CPU machine of docs/benchmarks/gpu/triton-host.md)
        return _forward(query, key, value, values, slopes, starts, ends, key_terms, seed, spec)[4]
    return _TritonAttention.apply(query, key, value, values, slopes, starts, ends, key_terms, seed, spec)
