"""Decomposed 2D relative positions (MViTv2, Li et al. 2022; SAM; ViTDet) without a (B, H, N, N) tensor.

A query at grid cell ``(y, x)`` and a key at ``(y', x')`` add to their logit::

    bias[q, k] = rel_h[q, y'] + rel_w[q, x']
    rel_h[q, y'] = q . R_h[y - y' + Kh - 1]        (the UNscaled query, one table per axis)
    rel_w[q, x'] = q . R_w[x - x' + Kw - 1]

with two learned tables ``rel_pos_h`` ``(2 S_h - 1, head_dim)`` and ``rel_pos_w``, shared by the
heads, named as in transformers' ``SamVisionAttention`` / ``VitDetAttention`` (so their weights
load). The sign is the query minus the key (Swin's, not T5's). The bias depends on the query's
content, so it is not a :class:`relpos.RelativeBias` (whose ``bias_at`` reads offsets only).

``rel_h`` and ``rel_w`` are ``(B, H, N, Kh)`` and ``(B, H, N, Kw)``: small. Three paths compute
the same attention (the ``impl`` switch of :func:`decomposed_attention`):

* ``"tiles"`` (CPU): blocks of query rows; each block builds its dense ``(H, rows, N)`` bias from
  ``rel_h`` + ``rel_w`` (into one reused buffer) and calls SDPA's fused CPU flash kernel. The
  backward is SDPA's CPU flash backward on the fold below (same output, same logsumexp): its
  query gradient holds ``d rel_h`` and ``d rel_w``. Never more than one block of bias at a time.
* ``"fold"`` (any device): ``[q * s, rel_h, rel_w] . [k, onehot(key row), onehot(key column)]``
  equals ``q . k * s + bias``, so one SDPA call with a head dim of ``d + Kh + Kw`` (the value
  zero-padded to it so CPU SDPA keeps its flash kernel); gradients by SDPA's own backward. On a
  GPU, ``64 + 64 + 64 <= 256`` fits the flash kernels, and zero channels pad the head dimension to a
  multiple of 8 (a window of 14: 64 + 28 = 92 becomes 96), which they need.
* ``"triton"`` (CUDA; opt-in): a flash-attention kernel that adds ``rel_h`` and ``rel_w`` inside each tile
  (relpos.backends._triton_decomposed): the keys visited as their grid, a block of columns then every key row of
  it, so a tile adds one ``rel_h`` value per query row and the column block's ``rel_w``, read once for all the
  rows; attention's own head dim (no fold), no
  ``(N, K)`` bias, gradients into q, k, v, ``rel_h`` and ``rel_w``; no dropout. Tested under Triton's interpreter;
  not yet timed on a GPU, so ``"auto"`` keeps the fold there.
* ``"reference"``: the dense bias and an eager softmax, the readable definition the others are
  tested against.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_choice, check_grid, check_int, check_probability, check_scale, check_tensor
from ..backends._fused import accumulate_dtype, fused_available
from ..backends._head_dim import fused_head_dim
from ..backends.dispatch import triton_unavailable

__all__ = [
    "DecomposedRelPos",
    "Impl",
    "decomposed_attention",
    "decomposed_bias",
    "decomposed_terms",
    "rel_pos_lookup",
    "resize_rel_pos",
]

Impl = Literal["auto", "tiles", "fold", "triton", "reference"]
IMPLS = ("auto", "tiles", "fold", "triton", "reference")
# Forward blocks: 768 query rows, the length from which SDPA's CPU flash kernel uses its largest query
# block (256), measured fastest in docs/benchmarks/vision/sam.md; fewer when a block's mask (H * rows * N) would
# pass 2**26 elements; short sequences (windows) go several examples per call up to that size.
_FORWARD_ROWS = 768
_FORWARD_ELEMENTS = 1 << 26


# --- the tables: SAM's linear resize and lookup ------------------------------------------------


def resize_rel_pos(table: torch.Tensor, length: int) -> torch.Tensor:
    """``(L, C)`` table -> ``(length, C)``, linearly interpolated as SAM does (``align_corners=False``).

    The same length returns the table itself.

    >>> resize_rel_pos(torch.tensor([[0.0], [4.0]]), 4)[:, 0]
    tensor([0., 1., 3., 4.])
    """
    if table.shape[0] == length:
        return table
    resized = F.interpolate(table.t().unsqueeze(0), size=length, mode="linear")  # (1, C, length)
    return resized[0].t()  # (length, C)


def rel_pos_lookup(q_size: int, k_size: int, table: torch.Tensor) -> torch.Tensor:
    """``(q_size, k_size, C)``: the table row for each (query, key) pair along one axis (SAM's ``get_rel_pos``).

    The table is first resized to ``2 * max(q_size, k_size) - 1`` rows. Equal sizes read row
    ``q - k + k_size - 1``; unequal sizes scale the shorter axis' coordinates to the longer one.

    >>> rel_pos_lookup(2, 2, torch.arange(3.0)[:, None])[..., 0]
    tensor([[1., 0.],
            [2., 1.]])
    """
    length = 2 * max(q_size, k_size) - 1
    resized = resize_rel_pos(table, length)  # (2 max - 1, C)
    q_scale, k_scale = max(k_size / q_size, 1.0), max(q_size / k_size, 1.0)
    q_coords = torch.arange(q_size, device=table.device)[:, None] * q_scale  # (q, 1)
    k_coords = torch.arange(k_size, device=table.device)[None, :] * k_scale  # (1, k)
    index = (q_coords - k_coords + (k_size - 1) * k_scale).long()  # (q, k), truncated like SAM
    return resized[index]  # (q, k, C)


def _check_table(name: str, table, head_dim: int) -> torch.Tensor:
    check_tensor(name, table, shape="(2 S - 1, head_dim)")
    if table.dim() != 2 or table.shape[1] != head_dim:
        raise ValueError(
            f"{name} must be (2 S - 1, head_dim={head_dim}) (the query's head dim), got {tuple(table.shape)}; "
            "a table of another width belongs to another head size"
        )
    return table


def decomposed_terms(
    query: torch.Tensor,
    rel_pos_h: torch.Tensor,
    rel_pos_w: torch.Tensor,
    q_size: int | Sequence[int],
    k_size: int | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rel_h (..., N, Kh)`` and ``rel_w (..., N, Kw)`` from the unscaled ``query (..., N, d)``, N = Qh * Qw.

    Tables of another length are resized as SAM does (a grid larger or smaller than the one the
    model was trained at).
    """
    query = check_tensor("query", query, shape="(..., N, head_dim)")
    (qh, qw), (kh, kw) = check_grid("q_size", q_size), check_grid("k_size", q_size if k_size is None else k_size)
    if query.dim() < 2 or query.shape[-2] != qh * qw:
        raise ValueError(f"query must be (..., N, head_dim) with N = q_size {qh} x {qw} = {qh * qw}, got {tuple(query.shape)}")
    head_dim = query.shape[-1]
    table_h = rel_pos_lookup(qh, kh, _check_table("rel_pos_h", rel_pos_h, head_dim)).to(query.dtype)  # (Qh, Kh, d)
    table_w = rel_pos_lookup(qw, kw, _check_table("rel_pos_w", rel_pos_w, head_dim)).to(query.dtype)  # (Qw, Kw, d)
    grid = query.unflatten(-2, (qh, qw))  # (..., Qh, Qw, d)
    rel_h = torch.einsum("...yxc,ykc->...yxk", grid, table_h).flatten(-3, -2)  # (..., N, Kh)
    rel_w = torch.einsum("...yxc,xkc->...yxk", grid, table_w).flatten(-3, -2)  # (..., N, Kw)
    return rel_h, rel_w


def decomposed_bias(rel_h: torch.Tensor, rel_w: torch.Tensor) -> torch.Tensor:
    """The dense bias ``(..., N, Kh * Kw)``: ``rel_h[q, y'] + rel_w[q, x']`` (reference and tiles only).

    >>> decomposed_bias(torch.tensor([[0.0, 10.0]]), torch.tensor([[1.0, 2.0, 3.0]]))
    tensor([[ 1.,  2.,  3., 11., 12., 13.]])
    """
    return (rel_h[..., :, None] + rel_w[..., None, :]).flatten(-2)


# --- attention ---------------------------------------------------------------------------------


def _reference(query, key, value, rel_h, rel_w, scale: float, dropout_p: float) -> torch.Tensor:
    acc = accumulate_dtype(query.dtype)
    logits = (query.to(acc) @ key.to(acc).transpose(-2, -1)) * scale + decomposed_bias(rel_h, rel_w).to(acc)  # (B, H, N, K)
    weights = torch.softmax(logits, dim=-1)  # (B, H, N, K)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return (weights @ value.to(acc)).to(query.dtype)  # (B, H, N, dv)


def _fold_inputs(query, key, value, rel_h, rel_w, scale: float):
    """``[q * s, rel_h, rel_w]``, ``[k, onehot(key row), onehot(key column)]`` and ``v`` zero-padded: one head dim D."""
    kh, kw = rel_h.shape[-1], rel_w.shape[-1]
    rows = torch.arange(kh * kw, device=key.device)
    onehot = torch.cat([F.one_hot(rows // kw, kh), F.one_hot(rows % kw, kw)], -1).to(key.dtype)  # (K, Kh + Kw)
    q_fold = torch.cat([query * scale, rel_h.to(query.dtype), rel_w.to(query.dtype)], -1)  # (B, H, N, d + Kh + Kw)
    k_fold = torch.cat([key, onehot.expand(*key.shape[:-1], -1)], -1)  # (B, H, K, d + Kh + Kw)
    width = fused_head_dim(q_fold.shape[-1], query.device)  # D: a multiple of 8 on CUDA (SDPA's fused kernels)
    q_fold, k_fold = F.pad(q_fold, (0, width - q_fold.shape[-1])), F.pad(k_fold, (0, width - k_fold.shape[-1]))
    v_fold = F.pad(value, (0, width - value.shape[-1]))  # (B, H, K, D): CPU SDPA keeps its flash kernel
    return q_fold, k_fold, v_fold


def _fold(query, key, value, rel_h, rel_w, scale: float, dropout_p: float) -> torch.Tensor:
    q_fold, k_fold, v_fold = _fold_inputs(query, key, value, rel_h, rel_w, scale)  # (B, H, ., D)
    out = F.scaled_dot_product_attention(q_fold, k_fold, v_fold, dropout_p=dropout_p, scale=1.0)  # (B, H, N, D)
    return out[..., : value.shape[-1]]  # (B, H, N, dv)


def _forward_blocks(batch: int, heads: int, length: int, keys: int) -> list[tuple[int, int, int, int]]:
    """(b0, b1, r0, r1) blocks: 768 query rows of one example (global layers), or whole examples
    grouped up to ``_FORWARD_ELEMENTS`` logits (windowed layers: many small windows per call)."""
    rows = max(1, min(_FORWARD_ROWS, _FORWARD_ELEMENTS // (heads * keys)))
    if rows < length:
        return [(b, b + 1, a, min(length, a + rows)) for b in range(batch) for a in range(0, length, rows)]
    group = max(1, _FORWARD_ELEMENTS // (heads * length * keys))
    return [(b, min(batch, b + group), 0, length) for b in range(0, batch, group)]


class _TiledDecomposed(torch.autograd.Function):
    """Forward: SDPA's CPU flash kernel per block of query rows; backward: SDPA's CPU flash backward on the fold."""

    @staticmethod
    def forward(ctx, query, key, value, rel_h, rel_w, scale):
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()  # once, not per block
        batch, heads, length, _ = query.shape
        acc = accumulate_dtype(query.dtype)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out = query.new_empty(batch, heads, length, value.shape[-1])  # (B, H, N, dv)
        lse = torch.empty(batch, heads, length, dtype=acc, device=query.device)  # (B, H, N)
        terms_h, terms_w = rel_h.to(acc), rel_w.to(acc)  # (B, H, N, Kh), (B, H, N, Kw)
        blocks = _forward_blocks(batch, heads, length, key.shape[-2])
        first = blocks[0]  # the largest block
        buffer = query.new_empty(first[1] - first[0], heads, first[3] - first[2], rel_h.shape[-1], rel_w.shape[-1], dtype=acc)
        for b0, b1, a, c in blocks:  # one mask buffer for every block: no fresh pages to fault in per block
            mask = torch.add(terms_h[b0:b1, :, a:c, :, None], terms_w[b0:b1, :, a:c, None, :], out=buffer[: b1 - b0, :, : c - a])
            o, m = flash(query[b0:b1, :, a:c], key[b0:b1], value[b0:b1], 0.0, False, attn_mask=mask.flatten(-2), scale=scale)
            out[b0:b1, :, a:c], lse[b0:b1, :, a:c] = o, m  # (b, H, rows, dv), (b, H, rows)
        ctx.save_for_backward(query, key, value, rel_h, rel_w, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # The fold's gradients by SDPA's CPU flash backward: the fold has the same output and logsumexp.
        q, k, v, rel_h, rel_w, out, lse = ctx.saved_tensors
        (d, dv), (kh, kw) = (q.shape[-1], v.shape[-1]), (rel_h.shape[-1], rel_w.shape[-1])
        q_fold, k_fold, v_fold = _fold_inputs(q, k, v, rel_h, rel_w, ctx.scale)  # (B, H, ., D)
        pad = (0, q_fold.shape[-1] - dv)
        dq, dk, dvf = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            F.pad(grad_out, pad), q_fold, k_fold, v_fold, F.pad(out, pad), lse, 0.0, False, scale=1.0
        )  # (B, H, ., D) each
        grads = (dq[..., :d] * ctx.scale, dk[..., :d], dvf[..., :dv], dq[..., d : d + kh], dq[..., d + kh : d + kh + kw])
        return (*(g.to(t.dtype) for g, t in zip(grads, (q, k, v, rel_h, rel_w))), None)


def _triton(query, key, value, rel_h, rel_w, scale: float, dropout_p: float) -> torch.Tensor:
    refused = "its kernel has no dropout" if dropout_p > 0.0 else triton_unavailable(query, value)
    if refused is None and len({t.dtype for t in (query, key, value, rel_h, rel_w)}) > 1:
        refused = "query, key, value, rel_h and rel_w must share one dtype"
    if refused:
        raise ValueError(f"impl='triton' cannot run this call: {refused}; use impl='auto'")
    from ..backends._triton_decomposed import decomposed_triton  # imports triton: only when asked for

    return decomposed_triton(query, key, value, rel_h, rel_w, scale)  # (B, H, N, dv)


def _choose(impl: str, query: torch.Tensor, dropout_p: float) -> str:
    if impl != "auto":
        return impl
    if dropout_p > 0.0:
        return "fold"  # SDPA's dropout (the CPU fused kernels have none: the math kernel then)
    return "tiles" if fused_available(query) else "fold"


def decomposed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rel_h: torch.Tensor,
    rel_w: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``softmax(q k^T * scale + rel_h[q, y'] + rel_w[q, x']) v`` -> ``(B, H, N, dv)``.

    Args:
        query: ``(B, H, N, d)``; key ``(B, H, K, d)`` with ``K = Kh * Kw`` keys in raster order;
            value ``(B, H, K, dv)``.
        rel_h, rel_w: ``(B, H, N, Kh)`` and ``(B, H, N, Kw)`` from :func:`decomposed_terms`.
        scale: logit scale; ``None`` is ``d ** -0.5`` (SAM's and ViTDet's).
        dropout_p: attention dropout (``"auto"`` then takes the fold through SDPA).
        impl: ``"auto"`` (``"tiles"`` on CPU, ``"fold"`` elsewhere), ``"tiles"``, ``"fold"``, ``"triton"``
            (the position terms inside a flash kernel's tiles; CUDA, no dropout) or ``"reference"`` (the dense
            bias, eager; holds ``(B, H, N, K)``).
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("rel_h", rel_h), ("rel_w", rel_w)):
        check_tensor(name, t, shape="(B, H, ., .)")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, ., .), got shape {tuple(t.shape)}")
    impl = check_choice("impl", impl, IMPLS)
    scale = check_scale("scale", scale)
    dropout_p = check_probability("dropout_p", dropout_p)
    if key.shape[:2] != query.shape[:2] or value.shape[:3] != key.shape[:3] or (key.shape[-1], value.shape[-1]) != (query.shape[-1],) * 2:
        raise ValueError(
            f"key and value must be (B, H, K, d) with the query's B, H and head dim d (SAM's and ViTDet's layout); got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if rel_h.shape[:3] != query.shape[:3] or rel_w.shape[:3] != query.shape[:3]:
        raise ValueError(f"rel_h and rel_w must be (B, H, N, .) like query {tuple(query.shape[:3])}, got {tuple(rel_h.shape)} and {tuple(rel_w.shape)}")
    if rel_h.shape[-1] * rel_w.shape[-1] != key.shape[-2]:
        raise ValueError(f"the key grid Kh x Kw = {rel_h.shape[-1]} x {rel_w.shape[-1]} (from rel_h, rel_w) must hold the {key.shape[-2]} keys")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    impl = _choose(impl, query, dropout_p)
    if impl == "tiles":
        if dropout_p > 0.0 or not fused_available(query):
            raise ValueError(f"impl='tiles' runs SDPA's CPU flash kernel, which has no dropout and takes CPU tensors; got dropout_p={dropout_p}, device {query.device}: use impl='fold' or 'auto'")
        return _TiledDecomposed.apply(query, key, value, rel_h, rel_w, scale)
    if impl == "fold":
        return _fold(query, key, value, rel_h, rel_w, scale, dropout_p)
    if impl == "triton":
        return _triton(query, key, value, rel_h, rel_w, scale, dropout_p)
    return _reference(query, key, value, rel_h, rel_w, scale, dropout_p)


class DecomposedRelPos(nn.Module):
    """The two decomposed relative-position tables of one attention layer (MViTv2, SAM, ViTDet).

    Args:
        input_size: the grid ``(Sh, Sw)`` (or ``S``) the tables are sized for: SAM's global layers
            use the patch grid (64 for 1024 px / 16 px patches), its windowed layers the window (14).
        head_dim: the query's head dim (the tables' width).

    Parameters ``rel_pos_h (2 Sh - 1, head_dim)`` and ``rel_pos_w (2 Sw - 1, head_dim)``, named as in
    transformers' ``SamVisionAttention``; zero-initialised like SAM's. Other grids resize them.

    >>> pos = DecomposedRelPos(3, head_dim=4)
    >>> q = k = v = torch.randn(1, 2, 9, 4)
    >>> pos(q, k, v, (3, 3)).shape
    torch.Size([1, 2, 9, 4])
    """

    def __init__(self, input_size: int | Sequence[int], head_dim: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.input_size = check_grid("input_size", input_size)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        kwargs = {"device": device, "dtype": dtype}
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * self.input_size[0] - 1, head_dim, **kwargs))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * self.input_size[1] - 1, head_dim, **kwargs))

    def extra_repr(self) -> str:
        return f"input_size={self.input_size}, head_dim={self.head_dim}"

    def terms(self, query: torch.Tensor, q_size: int | Sequence[int], k_size: int | Sequence[int] | None = None):
        """``rel_h (..., N, Kh)``, ``rel_w (..., N, Kw)`` for ``query (..., N, head_dim)`` on the grid ``q_size``."""
        return decomposed_terms(query, self.rel_pos_h, self.rel_pos_w, q_size, k_size)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        q_size: int | Sequence[int],
        k_size: int | Sequence[int] | None = None,
        *,
        scale: float | None = None,
        dropout_p: float = 0.0,
        impl: Impl = "auto",
    ) -> torch.Tensor:
        """Attention ``(B, H, N, dv)`` over ``query (B, H, N, d)`` on the grid ``q_size`` and keys on ``k_size``."""
        rel_h, rel_w = self.terms(query, q_size, k_size)  # (B, H, N, Kh), (B, H, N, Kw)
        return decomposed_attention(query, key, value, rel_h, rel_w, scale=scale, dropout_p=dropout_p, impl=impl)
