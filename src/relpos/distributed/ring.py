"""Context-parallel (ring) attention with a relative position term, forward and backward, on ``torch.distributed``.

Each of the ``P`` ranks holds ``Lc = L / P`` rows of q, k and v (:mod:`relpos.distributed.layout`). Key/value
pieces travel around the ring, each piece sent on while the rank attends to it; a rank's partial results merge
by their log-sum-exp. The position term of a (query piece, key piece) pair is a slice of the per-offset values
of the whole sequence, read at the pieces' global positions::

    global values  V[u], u = (j - i) + L - 1            (H, 2L - 1), built once per call from the bias module
    block values   V[u0 : u0 + nq + nk - 1],  u0 = (ks - qs) - (nq - 1) + L - 1

so every block is the single-process computation on a smaller grid (:func:`relpos.backends._fused.tile_forward`,
padding and the causal triangle skipped by tiles). Backward: dq stays local; each key piece's dk and dv
accumulate as the piece goes round again and take one last hop home; the values' gradient is each rank's share
(summed across ranks with the other parameters' gradients, :func:`all_reduce_grads`).

Memory: a rank holds its own q, k, v, output and log-sum-exp, plus two key/value pieces of at most
:data:`PIECE_ROWS` tokens (the one in hand and the one arriving), never an (Lc, L) or (L, L) tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import check_bias_heads, check_bool, check_choice, check_positive_float, check_scale
from ..backends._denormals import flushing
from ..backends._fused import _finite_lse, accumulate_dtype, fused_available, tile_flash_gradients, tile_forward, tile_gradients
from ..backends._masks import _runs, check_key_mask
from ..backends._tiles import Tile, plan_tiles
from ..backends.dispatch import _check_qkv, check_defines_future
from ..core.bias import AdditiveBias, OffsetBias
from ..encodings.rotary import RotaryEmbedding
from ..encodings.xpos import XPos
from ._comm import TAG_FINAL, TAG_GRAD, TAG_KV, Ring
from .layout import LAYOUTS, Layout, Segment, global_positions, pieces, segments

__all__ = ["PIECE_ROWS", "QUERY_ROWS", "ring_attention"]

#: Tokens per key/value piece (each message, and the keys of each attention block): a rank holds two pieces in
#: flight. QUERY_ROWS: query rows per attention block. Measured on 2 CPU processes at L = 16384 (docs/distributed.md).
PIECE_ROWS = 2048
QUERY_ROWS = 2048
#: Scores per block of the backward's workspace: half the single-process size (docs/benchmarks/attention/index.md), since that
#: fixed workspace does not shrink with the number of ranks while everything else does (docs/distributed.md).
BACKWARD_BLOCK = 1 << 20

DEFAULT_TIMEOUT = 300.0  # seconds any rank waits for another before raising RingTimeoutError


@dataclass(frozen=True)
class _Block:
    """One (query piece, key piece) pair: query rows ``rows`` attend to the key piece through ``tiles``."""

    rows: slice  # local query rows
    values: torch.Tensor  # (Hb, nq + nk - 1) per-offset values, causal mask folded in
    u0: int  # where ``values`` starts in the global values
    tiles: list[Tile]


@dataclass(frozen=True)
class _Plan:
    """Everything a rank's schedule depends on, fixed at the boundary and equal on every rank."""

    ring: Ring
    length: int  # L, the whole sequence
    causal: bool
    scale: float
    own: tuple[Segment, ...]  # this rank's key/value pieces
    queries: tuple[Segment, ...]  # this rank's query rows, in blocks
    theirs: tuple[tuple[Segment, ...], ...]  # theirs[src]: rank src's pieces
    ranges: tuple | None  # ranges[src][m][b]: (start, end) of example b's real keys in piece m of rank src
    groups: int  # query heads per key/value head

    def blocks(self, src: int, m: int, bias: torch.Tensor | None, batch: int, acc: torch.dtype, device):
        """The non-empty blocks of this rank's query pieces against piece ``m`` of rank ``src``."""
        key = self.theirs[src][m]
        ranges = None if self.ranges is None else self.ranges[src][m]
        for qp in self.queries:
            block = self._block(qp, key, ranges, bias, batch, acc, device)
            if block is not None and block.tiles:
                yield block

    def _block(self, qp: Segment, kp: Segment, ranges, bias, batch: int, acc, device) -> _Block | None:
        row0 = 0
        if self.causal:
            if kp.start > qp.start + qp.length - 1:  # every key in every query's future
                return None
            row0 = max(0, kp.start - qp.start)  # earlier rows see none of these keys
        rows, qs = qp.length - row0, qp.start + row0
        q_off = qs - kp.start  # where the first query sits among the piece's keys (>= 0 when causal)
        n = rows + kp.length - 1
        u0 = (kp.start - qs) - (rows - 1) + (self.length - 1)
        values = torch.zeros(1, n, dtype=acc, device=device) if bias is None else bias[:, u0 : u0 + n]  # (Hb, n)
        if self.causal and rows + q_off < n:  # offsets j - i > 0 from index rows + q_off on
            values = values.clone()
            values[:, rows + q_off :] = float("-inf")
        tiles = plan_tiles(batch, rows, kp.length, q_offset=max(q_off, 0), causal=self.causal, key_ranges=ranges)
        return _Block(slice(qp.local + row0, qp.local + qp.length), values, u0, tiles)


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)  # (B, H, n, d)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)  # (B, Hkv, n, d)


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, m: torch.Tensor) -> None:
    """Fold a block's output ``o`` and log-sum-exp ``m`` into the running ``out`` / ``lse`` (views, in place)."""
    m = m.masked_fill(m == float("inf"), float("-inf"))  # rows no tile covered: no contribution
    new = torch.logaddexp(lse, m)  # (B, H, R)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows with nothing at all yet: both weights 0
    out.mul_((lse - safe).exp_()[..., None]).addcmul_(o.to(out.dtype), (m - safe).exp_()[..., None])
    lse.copy_(new)


def _own_piece(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    return t[:, :, seg.local : seg.local + seg.length].contiguous()


def _forward(plan: _Plan, q, k, v, bias):
    """(B, H, Lc, dv) output and (B, H, Lc) log-sum-exp, both in the accumulation dtype."""
    batch, heads, local, _ = q.shape
    acc = accumulate_dtype(q.dtype)
    out = torch.zeros(batch, heads, local, v.shape[-1], dtype=acc, device=q.device)  # (B, H, Lc, dv)
    lse = torch.full((batch, heads, local), float("-inf"), dtype=acc, device=q.device)  # (B, H, Lc)
    for m, seg in enumerate(plan.own):
        for src, (kp, vp) in plan.ring.travel((_own_piece(k, seg), _own_piece(v, seg)), TAG_KV, "keys and values"):
            kp, vp = _repeat(kp, plan.groups), _repeat(vp, plan.groups)  # (B, H, nk, d)
            for blk in plan.blocks(src, m, bias, batch, acc, q.device):
                o, l = tile_forward(q[:, :, blk.rows].flip(-2), kp, vp, blk.values, blk.tiles, plan.scale)
                _merge(out[:, :, blk.rows], lse[:, :, blk.rows], o.flip(-2), l.flip(-1))
    return out, lse


def _block_gradients(plan: _Plan, q, kp, vp, blk: _Block, out, lse, grad_out, bias_grad: bool):
    """dq (rows of the block), dk, dv (the key piece) in the accumulation dtype, and the block values' gradient."""
    rows = blk.rows
    q_rev, o_rev, g_rev, l_rev = q[:, :, rows].flip(-2), out[:, :, rows].flip(-2), grad_out[:, :, rows].flip(-2), lse[:, :, rows].flip(-1)
    if bias_grad or not fused_available(q):
        return tile_gradients(
            q_rev, kp, vp, blk.values, o_rev, l_rev, g_rev, blk.tiles, plan.scale, bias_grad=bias_grad, block_elements=BACKWARD_BLOCK
        )
    finite = _finite_lse(l_rev)  # rows with no key anywhere: +inf, probabilities 0
    dq, dk, dv = tile_flash_gradients(q_rev, kp, vp, blk.values, o_rev.to(q.dtype), finite, g_rev, blk.tiles, plan.scale)
    return dq, dk, dv, None


def _backward(plan: _Plan, q, k, v, bias, out, lse, grad_out, bias_grad: bool):
    """dq, dk, dv in the accumulation dtype and this rank's share of the values' gradient (or None)."""
    ring, acc = plan.ring, out.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, H, Lc, d)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)  # (B, Hkv, Lc, d): every piece's rows written once, below
    dv = torch.empty(v.shape, dtype=acc, device=q.device)  # (B, Hkv, Lc, dv)
    dvalues = torch.zeros_like(bias) if bias_grad else None  # (Hb, 2L - 1)
    grad_out = grad_out.contiguous()
    for m, seg in enumerate(plan.own):
        shapes = [(*k.shape[:2], seg.length, k.shape[3]), (*v.shape[:2], seg.length, v.shape[3])]  # dk, dv of the piece
        home, sends = None, []
        travel = ring.travel((_own_piece(k, seg), _own_piece(v, seg)), TAG_KV, "keys and values")
        for step, (src, (kp, vp)) in enumerate(travel):
            gk, gv = (torch.zeros(shape, dtype=acc, device=q.device) for shape in shapes)  # this rank's share
            kh, vh = _repeat(kp, plan.groups), _repeat(vp, plan.groups)
            for blk in plan.blocks(src, m, bias, q.shape[0], acc, q.device):
                bq, bk, bv, bvalues = _block_gradients(plan, q, kh, vh, blk, out, lse, grad_out, bias_grad)
                dq[:, :, blk.rows] += bq.flip(-2)
                gk += _fold(bk, plan.groups)
                gv += _fold(bv, plan.groups)
                if dvalues is not None:
                    dvalues[:, blk.u0 : blk.u0 + blk.values.shape[1]] += bvalues
            if step:  # the sums so far, from the previous rank (received after the work: no buffer held during it)
                carried, carried_works = ring.recv(shapes, acc, q.device, TAG_GRAD)
                ring.wait(carried_works, f"the key gradients of rank {src}'s piece {m}")
                gk, gv = gk.add_(carried[0]), gv.add_(carried[1])
            ring.wait(sends, "the previous key gradients to be received")
            if ring.size == 1:
                home = (gk, gv)
            else:
                sends = ring.send((gk, gv), TAG_GRAD if step < ring.size - 1 else TAG_FINAL)
        if ring.size > 1:  # the finished sums come home from the previous rank (posted late: no buffer held meanwhile)
            home, home_works = ring.recv(shapes, acc, q.device, TAG_FINAL)
            ring.wait(sends + home_works, f"the gradients of this rank's key piece {m} to come home")
        dk[:, :, seg.local : seg.local + seg.length] = home[0]
        dv[:, :, seg.local : seg.local + seg.length] = home[1]
    return dq, dk, dv, dvalues


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, values, plan: _Plan):
        bias = None if values is None else values.detach().to(accumulate_dtype(query.dtype))  # (Hb, 2L - 1)
        with flushing(query):
            out, lse = _forward(plan, query, key, value, bias)  # (B, H, Lc, dv), (B, H, Lc)
        ctx.save_for_backward(query, key, value, values, out, lse)
        ctx.plan = plan
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, values, out, lse = ctx.saved_tensors
        bias = None if values is None else values.detach().to(out.dtype)
        with flushing(query):
            dq, dk, dv, dvalues = _backward(ctx.plan, query, key, value, bias, out, lse, grad_out, ctx.needs_input_grad[3])
        grads = (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype))
        return (*grads, None if dvalues is None else dvalues.to(values.dtype), None)


PositionLike = AdditiveBias | OffsetBias | None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bias: PositionLike = None,
    rotary: RotaryEmbedding | XPos | None = None,
    causal: bool = False,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    layout: Layout = "contiguous",
    group: dist.ProcessGroup | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """Self-attention over one sequence sharded along its length across the ranks of ``group``.

    Every rank calls it with its own rows (``layout``), the same settings and the same position term; each
    gets its rows of the output, equal to single-process :func:`relpos.attention` over the whole sequence.

    Args:
        query, key, value: this rank's ``(B, H, Lc, d)``, ``(B, Hkv, Lc, d)``, ``(B, Hkv, Lc, dv)`` rows
            (``Hkv`` divides ``H``); the sequence is ``L = P * Lc`` long.
        bias: a translation-invariant relpos bias module (T5, clipped, ALiBi, Kerple, FIRE up to its threshold,
            Sandwich, log-decay, ...) or an :class:`OffsetBias` built for ``(L, L)``; evaluated at global offsets.
        rotary: a :class:`RotaryEmbedding` or :class:`XPos`, applied to q and k at their global positions.
        causal: keys after the query's global position are masked.
        key_mask: this rank's ``(B, Lc)`` boolean rows, ``True`` for real tokens; within each piece of
            :data:`PIECE_ROWS` tokens an example's real tokens form one run (right or left padding).
        scale: logit scale, ``1/sqrt(d)`` by default.
        layout: ``"contiguous"`` or ``"zigzag"`` (causal load balance), as :func:`relpos.distributed.shard` cuts.
        group: the process group (default: the whole world).
        timeout: seconds any wait for another rank may take before :class:`RingTimeoutError`.

    Returns this rank's ``(B, H, Lc, dv)`` output in the query's dtype; gradients flow to q, k, v and to the
    bias's parameters (this rank's share: sum them across ranks, :func:`relpos.distributed.all_reduce_grads`).
    Ranks that disagree on shapes or settings raise :class:`DistributedMismatchError` on every rank.
    """
    ring, layout, scale, length = _validate(query, key, value, bias, rotary, causal, key_mask, scale, layout, group, timeout)
    query, key = _rotate(rotary, query, key, ring, layout, length)
    values = _values(bias, length, query, causal)  # (Hb, 2L - 1) or None
    mine = segments(ring.rank, ring.size, query.shape[2], layout)
    own = pieces(mine, PIECE_ROWS)
    runs, problem = _piece_runs(key_mask, own)
    ring.agree(_fields(query, key, value, values, rotary, causal, key_mask, scale, layout, ring, problem), query.device)
    if problem:
        raise ValueError(problem)
    theirs = tuple(pieces(segments(r, ring.size, query.shape[2], layout), PIECE_ROWS) for r in range(ring.size))
    plan = _Plan(
        ring, length, causal, 1.0 / query.shape[-1] ** 0.5 if scale is None else scale, own, pieces(mine, QUERY_ROWS), theirs,
        _gather_ranges(ring, runs, query.device), query.shape[1] // key.shape[1],
    )
    return _RingAttention.apply(query, key, value, values, plan)


def _validate(query, key, value, bias, rotary, causal, key_mask, scale, layout, group, timeout):
    _check_qkv(query, key, value)
    check_bool("causal", causal)
    scale = check_scale("scale", scale)
    layout = check_choice("layout", layout, LAYOUTS)
    timeout = check_positive_float("timeout", timeout)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the whole world), got {type(group).__name__}")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"ring attention is self-attention over one sharded sequence: key rows ({key.shape[2]}) must equal query rows "
            f"({query.shape[2]}) on every rank"
        )
    if layout == "zigzag" and query.shape[2] % 2:
        raise ValueError(
            f"layout='zigzag' holds two equal chunks per rank, so the local length must be even, got {query.shape[2]}; "
            "pad the sequence to a multiple of 2 * world_size and mark the padding with key_mask"
        )
    check_key_mask(key_mask, query.shape[0], query.shape[2], device=query.device)
    if rotary is not None and not isinstance(rotary, (RotaryEmbedding, XPos)):
        raise TypeError(f"rotary must be a relpos RotaryEmbedding, XPos or None, got {type(rotary).__name__}")
    if bias is not None and not isinstance(bias, (AdditiveBias, OffsetBias)):
        raise TypeError(
            f"bias must be a relpos bias module or an OffsetBias (per-offset values over the whole sequence), got "
            f"{type(bias).__name__}; a dense (B, H, L, L) tensor cannot be sharded by offset"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("relpos.distributed needs torch.distributed initialized: call torch.distributed.init_process_group first")
    ring = Ring(group, timeout)
    return ring, layout, scale, ring.size * query.shape[2]


def _rotate(rotary, query, key, ring: Ring, layout: str, length: int):
    """q and k rotated at their global positions (RoPE; xPos scales keys down)."""
    if rotary is None:
        return query, key
    positions = global_positions(ring.rank, ring.size, query.shape[2], layout, device=query.device)  # (Lc,)
    if isinstance(rotary, XPos):
        return rotary.rotate_positions(query, positions, length=length), rotary.rotate_positions(key, positions, length=length, downscale=True)
    return rotary.rotate_positions(query, positions, length=length), rotary.rotate_positions(key, positions, length=length)


def _values(bias, length: int, query: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """(Hb, 2L - 1) per-offset values of the whole sequence (index ``u`` is offset ``u - (L - 1)``)."""
    if bias is None:
        return None
    heads = query.shape[1]
    if isinstance(bias, OffsetBias):
        if (bias.query_length, bias.key_length, bias.q_offset) != (length, length, 0):
            raise ValueError(
                f"bias (an OffsetBias) must be built for the whole sequence, (query_length, key_length, q_offset) = "
                f"({length}, {length}, 0), got {(bias.query_length, bias.key_length, bias.q_offset)}"
            )
        values = bias.values
    else:
        if not bias.translation_invariant:
            raise TypeError(
                f"bias {type(bias).__name__} is not translation invariant: context-parallel attention needs a bias of "
                "the offset j - i alone (T5, clipped, ALiBi, Kerple, FIRE, Sandwich, log-decay)"
            )
        check_defines_future(bias, causal, length, 0, None)
        values = bias.offsets(length, length, device=query.device).values
    check_bias_heads("bias", values.shape[0], heads, query_length=query.shape[2])
    if values.device != query.device:
        raise ValueError(f"bias values are on {values.device} but the query is on {query.device}; move the bias with .to(device)")
    return values


def _piece_runs(key_mask: torch.Tensor | None, own: tuple[Segment, ...]) -> tuple[list | None, str]:
    """Each own piece's ``(starts, ends)`` of every example's real keys (None without a mask), and why the mask
    cannot be cut so ('' when it can): within a piece an example's real tokens must form one run."""
    if key_mask is None:
        return None, ""
    runs = [_runs(key_mask[:, seg.local : seg.local + seg.length]) for seg in own]  # (starts, ends) or None
    for seg, run in zip(own, runs):
        if run is None:
            return None, (
                f"key_mask has real tokens that are not one run per example within rows {seg.local}..{seg.local + seg.length - 1} "
                "of some rank's shard: context-parallel attention takes padding masks (right or left padding), "
                "not holes"
            )
    return runs, ""


def _gather_ranges(ring: Ring, runs: list | None, device: torch.device):
    """ranges[src][m][b] = (start, end) of example b's real keys in piece m of rank src (one bounded all-gather)."""
    if runs is None:
        return None
    mine = torch.tensor([list(zip(starts, ends)) for starts, ends in runs], dtype=torch.int64, device=device)  # (n, B, 2)
    every = ring.all_gather(mine, "every rank's key padding")  # (P, n, B, 2)
    return tuple(tuple(tuple(map(tuple, piece)) for piece in rank) for rank in every.tolist())


def _fingerprint(t: torch.Tensor | None) -> tuple:
    if t is None:
        return ()
    d = t.detach().double()
    return tuple(t.shape), str(t.dtype), float(d.sum()), float(d.abs().sum())


def _fields(query, key, value, values, rotary, causal, key_mask, scale, layout, ring: Ring, problem: str) -> dict:
    """What every rank must agree on; a position term by its values' checksum (unsynchronized parameters differ)."""
    finite = None if values is None else values.masked_fill(~torch.isfinite(values), 0.0)
    rot = None
    if rotary is not None:
        inner = rotary.rotary if isinstance(rotary, XPos) else rotary
        rot = (type(rotary).__name__, _fingerprint(inner.inv_freq), repr(rotary))
    return {
        "world size": ring.size,
        "layout": layout,
        "query shape": tuple(query.shape),
        "key shape": tuple(key.shape),
        "value shape": tuple(value.shape),
        "dtype": str(query.dtype),
        "device type": query.device.type,
        "causal": causal,
        "scale": scale,
        "position term": _fingerprint(finite),
        "rotary": rot,
        "key_mask given": key_mask is not None,
        "key_mask problem": problem,
        "gradients": torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, values)),
    }

