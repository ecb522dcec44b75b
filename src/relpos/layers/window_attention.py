"""Window attention for images (Swin V1, Liu et al. 2021; Swin V2, Liu et al. 2022).

A feature map ``(B, Hf, Wf, C)`` is padded to whole windows, optionally rolled by ``shift`` (the
shifted windows of every second Swin block), cut into ``nW`` windows of ``N = Wh * Ww`` patches,
and attention runs inside each window with a relative position bias. The pieces:

* :func:`window_partition` / :func:`window_merge`: ``(B, Hp, Wp, C) <-> (B, nW, N, C)``;
* :func:`shift_mask`: ``(nW, N, N)``, 0 inside a region, ``mask_value`` (Swin: -100) across the
  regions the cyclic shift glued together;
* :func:`window_attention`: softmax attention over ``(B, nW, H, N, d)`` with one ``(nW | 1, H, N, N)``
  term (bias + mask, combined once per layer) broadcast over the batch, never ``(B * nW, H, N, N)``;
* :class:`WindowAttention`: the layer, with Swin V1's table, the factorized table, Swin V2's
  continuous bias and cosine attention, under timm's parameter names.

The fused path (CPU) runs SDPA's flash kernel forward and a backward that recomputes the window
probabilities from the saved log-sum-exp, chunk by chunk: nothing of size ``(B, nW, H, N, N)``
is kept between forward and backward, and the bias (table or MLP) gets its gradient. The readable
reference path (``fused=False``) is the eager formula; tests hold them equal.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool, check_choice, check_device, check_dtype, check_int, check_probability, check_real, check_scale, check_tensor,
)
from ..backends._denormals import flushing
from ..encodings.window_bias import ContinuousPositionBias, FactorizedRelativePositionBias, RelativePositionBias
from ..encodings.windows import normalize_window_size

__all__ = [
    "PositionBiasKind", "window_partition", "window_merge", "shift_mask", "window_attention", "projected_window_attention",
    "WindowAttention",
]

PositionBiasKind = Literal["table", "factorized", "continuous", "none"]
SWIN_MASK_VALUE = -100.0  # Swin, timm and transformers' value between shifted regions
_CHUNK_SCORES = 1 << 22  # scores recomputed at once in the backward (16 MiB in fp32)
# the projections run as one matmul with the three weights stacked when the rows outnumber this many
# times the channels: stacking copies 3 C^2 weights and saves on a (M, C) x (C, C) product whose C is
# small (Swin stage 0, M = 8192, C = 96: 3.1 against 5.7 ms; at M = 128, C = 768 the copy costs more)
_STACK_ROWS_PER_CHANNEL = 16
_NORM_EPS = 1e-12  # F.normalize's eps: Swin V2's cosine attention (transformers, timm) uses the default


def window_partition(x: torch.Tensor, window: int | tuple[int, int]) -> torch.Tensor:
    """``(B, Hp, Wp, C) -> (B, nW, N, C)``, windows in raster order, patches in raster order.

    >>> window_partition(torch.arange(16.0).view(1, 4, 4, 1), (2, 2))[0, :, :, 0]
    tensor([[ 0.,  1.,  4.,  5.],
            [ 2.,  3.,  6.,  7.],
            [ 8.,  9., 12., 13.],
            [10., 11., 14., 15.]])
    """
    check_tensor("x", x, shape="(B, Hp, Wp, C)")
    wh, ww = normalize_window_size(window, ndim=2, name="window")
    if x.dim() != 4 or x.shape[1] % wh or x.shape[2] % ww:
        raise ValueError(f"x must be (B, Hp, Wp, C) with Hp, Wp multiples of the window {(wh, ww)}, got {tuple(x.shape)}")
    b, hp, wp, c = x.shape
    x = x.view(b, hp // wh, wh, wp // ww, ww, c).transpose(2, 3)  # (B, nH, nW_, Wh, Ww, C)
    return x.reshape(b, (hp // wh) * (wp // ww), wh * ww, c)  # (B, nW, N, C)


def window_merge(windows: torch.Tensor, window: int | tuple[int, int], height: int, width: int) -> torch.Tensor:
    """``(B, nW, N, C) -> (B, Hp, Wp, C)``: the inverse of :func:`window_partition`."""
    check_tensor("windows", windows, shape="(B, nW, N, C)")
    wh, ww = normalize_window_size(window, ndim=2, name="window")
    height, width = check_int("height", height, minimum=1), check_int("width", width, minimum=1)
    if windows.dim() != 4 or height % wh or width % ww or windows.shape[1:3] != ((height // wh) * (width // ww), wh * ww):
        raise ValueError(f"windows must be (B, nW, N, C) for a {height}x{width} map in windows of {(wh, ww)}, "
                         f"got {tuple(windows.shape)}")
    b, _, _, c = windows.shape
    x = windows.view(b, height // wh, width // ww, wh, ww, c).transpose(2, 3)  # (B, nH, Wh, nW_, Ww, C)
    return x.reshape(b, height, width, c)  # (B, Hp, Wp, C)


def _shift(shift, window: tuple[int, int], *, name: str) -> tuple[int, int]:
    """``0``, ``s`` or ``(sh, sw)``, each in ``[0, window)``."""
    pair = tuple(shift) if isinstance(shift, Sequence) and not isinstance(shift, str) else (shift, shift)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or (sh, sw), got {shift!r}")
    pair = tuple(check_int(f"{name}[{k}]", s, minimum=0) for k, s in enumerate(pair))
    if any(s >= w for s, w in zip(pair, window)):
        raise ValueError(f"{name} must be smaller than the window {window} on each axis, got {pair}")
    return pair


def _regions(size: int, window: int, shift: int, device) -> torch.Tensor:
    """(size,) region of each row (or column) after the roll: 0, 1 or 2 (Swin's three slices)."""
    index = torch.arange(size, device=device)  # (size,)
    return (index >= size - window).long() + (index >= size - shift).long()


def shift_mask(
    height: int,
    width: int,
    window: int | Sequence[int],
    shift: int | tuple[int, int],
    *,
    mask_value: float = SWIN_MASK_VALUE,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(nW, N, N)``: 0 between patches of one region, ``mask_value`` between regions.

    ``height`` and ``width`` are the padded map's (multiples of the window). After the cyclic roll
    by ``-shift``, the last row and column of windows hold patches from opposite borders; they must
    not attend to each other. A 4x4 map, 2x2 windows, shift 1: the last window holds 4 regions.

    >>> shift_mask(4, 4, 2, 1, mask_value=-1.0)[3]
    tensor([[ 0., -1., -1., -1.],
            [-1.,  0., -1., -1.],
            [-1., -1.,  0., -1.],
            [-1., -1., -1.,  0.]])
    """
    height, width = check_int("height", height, minimum=1), check_int("width", width, minimum=1)
    wh, ww = normalize_window_size(window, ndim=2, name="window")
    sh, sw = _shift(shift, (wh, ww), name="shift")
    if height % wh or width % ww:
        raise ValueError(f"height and width must be multiples of the window {(wh, ww)} (pad first), got {height}x{width}")
    mask_value = check_real("mask_value", mask_value)
    device = check_device("device", device)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    label = _regions(height, wh, sh, device)[:, None] * 3 + _regions(width, ww, sw, device)[None, :]  # (Hp, Wp)
    labels = window_partition(label[None, :, :, None], (wh, ww))[0, :, :, 0]  # (nW, N)
    different = labels[:, :, None] != labels[:, None, :]  # (nW, N, N)
    return torch.zeros(different.shape, device=device, dtype=dtype).masked_fill(different, mask_value)


def _forward(q, k, v, bias, scale, cosine_scale) -> tuple[torch.Tensor, tuple | None]:
    """Window attention through SDPA's CPU flash kernel: ``(B, nW, H, N, d)`` in any strides ->
    ``(B, nW, N, H, dv)`` (token-major). The kernel reads strided rows, so views of the projections
    go in uncopied, and writes its output token-major, the layout the output projection reads.
    ``bias`` ``(W, H, N, N)``: ``W`` 1 (one bias for every window: one call over all windows) or
    ``nW`` (one per window, the shift mask: one call per image). Also returns, for cosine attention,
    the norms of q and k ``(B, nW, H, N, 1)`` (a ``d``-th of their size: kept, not recomputed)."""
    b, nw, h, n, _ = q.shape
    norms = None
    if cosine_scale is not None:
        (q, q_norm), (k, k_norm) = _unit(q, cosine_scale), _unit(k)  # (B, nW, H, N, d): temporaries
        norms = (q_norm, k_norm)
    groups = [t.flatten(0, 1) for t in (q, k, v)]  # (B * nW, H, N, d), views
    step = nw if bias.shape[0] > 1 else b * nw  # windows per kernel call: the bias broadcasts over them
    with flushing(q):  # a shift mask of -100 puts probabilities in the denormal range (relpos.backends._denormals)
        outs = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t[i : i + step] for t in groups), 0.0, False, attn_mask=bias, scale=scale)[0].transpose(1, 2)
            for i in range(0, b * nw, step)]  # (step, N, H, dv) each
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (B * nW, N, H, dv)
    return out.view(b, nw, n, h, -1), norms  # (B, nW, N, H, dv)


def _backward(q, k, v, bias, scale, cosine_scale, norms, grad_out, need_bias, grads=None):
    """Gradients of :func:`_forward` for q, k, v (written into ``grads``, by default new token-major
    tensors seen as ``(B, nW, H, N, d)``), the bias and the cosine scale. Each chunk of windows
    recomputes its probabilities with one ``softmax`` (a window's row is short: one pass over the
    scores) and takes softmax's own backward."""
    w, h, n = bias.shape[:3]
    if grads is None:  # written token-major: (B, nW, H, N, d) views of (B, nW, N, H, d)
        grads = [_token_major_like(t) for t in (q, k, v)]
    parts = [t.flatten(0, 1) for t in (q, k, v, *grads, *(norms or ()))] + [grad_out.flatten(0, 1).transpose(1, 2)]
    grad_bias = grad_scale = None
    step = w * max(1, _CHUNK_SCORES // (w * h * n * n))  # windows whose scores are recomputed at once
    with flushing(q):
        for i in range(0, parts[0].shape[0], step):
            qc, kc, vc, *dst, gc = (t[i : i + step] for t in parts)  # (g, H, N, d); norms (g, H, N, 1)
            dst, norm_chunks = dst[:3], dst[3:]
            g = qc.shape[0]
            if cosine_scale is None:
                q3, k3 = (qc * scale).reshape(g * h, n, -1), kc.reshape(g * h, n, -1)  # (gH, N, d)
            else:
                q_norm, k_norm = norm_chunks
                q3, k3 = _unit(qc, cosine_scale, norm=q_norm)[0], _unit(kc, norm=k_norm)[0]  # contiguous
                q3, k3 = q3.view(g * h, n, -1), k3.view(g * h, n, -1)  # (gH, N, d): as in the forward
            gq, gk, gv, gb = _window_grads(q3, k3, vc.reshape(g * h, n, -1), gc.reshape(g * h, n, -1), bias,
                                           need_bias)  # (gH, N, d) x 3, (W, H, N, N)
            gq, gk = gq.view(g, h, n, -1), gk.view(g, h, n, -1)  # gradients of the kernel's q, k
            if cosine_scale is None:
                dst[0].copy_(gq.mul_(scale))
                dst[1].copy_(gk)
            else:
                gs = _unit_backward(gq, q3.view(g, h, n, -1), q_norm, cosine_scale, out=dst[0])  # (H,)
                _unit_backward(gk, k3.view(g, h, n, -1), k_norm, None, out=dst[1])
                grad_scale = gs if grad_scale is None else grad_scale.add_(gs)
            dst[2].copy_(gv.view(g, h, n, -1))  # into the token-major gradients
            if gb is not None:
                grad_bias = gb if grad_bias is None else grad_bias.add_(gb)
    return (*grads, grad_bias, grad_scale)


class _WindowSDPA(torch.autograd.Function):
    """:func:`_forward` keeping only q, k, v as given (views of the projections: no copies) and the
    bias; no probabilities, no normalised q or k."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, cosine_scale):  # q, k, v (B, nW, H, N, d); bias (W, H, N, N)
        out, norms = _forward(q, k, v, bias, scale, cosine_scale)  # (B, nW, N, H, dv)
        ctx.save_for_backward(q, k, v, bias, cosine_scale, *(norms or ()))
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (B, nW, N, H, dv)
        q, k, v, bias, cosine_scale, *norms = ctx.saved_tensors
        gq, gk, gv, grad_bias, grad_scale = _backward(q, k, v, bias, ctx.scale, cosine_scale, norms, grad_out,
                                                      ctx.needs_input_grad[3])
        return gq, gk, gv, grad_bias, None, grad_scale


class _ProjectedWindowSDPA(torch.autograd.Function):
    """The q, k, v projections (one matmul with the three weights stacked) and :func:`_forward`, keeping
    only the projections' input: the backward projects again instead of keeping q, k and v."""

    @staticmethod
    def forward(ctx, x, wq, bq, wk, bk, wv, bv, bias, scale, cosine_scale, heads):  # x (B, nW, N, C)
        out, norms = _forward(*_project(x, (wq, bq, wk, bk, wv, bv), heads), bias, scale, cosine_scale)  # (B, nW, N, H, dv)
        ctx.save_for_backward(x, wq, bq, wk, bk, wv, bv, bias, cosine_scale, *(norms or ()))
        ctx.scale, ctx.heads = scale, heads
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (B, nW, N, H, dv)
        x, *params, bias, cosine_scale = ctx.saved_tensors[:9]
        norms = ctx.saved_tensors[9:]
        q, k, v = _project(x, params, ctx.heads)  # (B, nW, H, N, d), recomputed
        b, nw, n, c = x.shape
        sizes = [w.shape[0] for w in params[0::2]]  # C' of q, k, v
        grad_qkv = x.new_empty(b, nw, n, sum(sizes))  # (B, nW, N, 3C'): the gradients of q, k, v side by side
        views = [g.view(b, nw, n, ctx.heads, -1).transpose(2, 3) for g in grad_qkv.split(sizes, -1)]  # (B, nW, H, N, d)
        *_, grad_bias, grad_scale = _backward(q, k, v, bias, ctx.scale, cosine_scale, norms, grad_out, ctx.needs_input_grad[7],
                                             grads=views)
        g2, x2 = grad_qkv.view(-1, sum(sizes)), x.reshape(-1, c)  # (M, 3C'), (M, C)
        grad_x = _project_back(g2, params[0::2], sizes).view(x.shape) if ctx.needs_input_grad[0] else None  # (B, nW, N, C)
        grad_w = (g2.t() @ x2).split(sizes) if any(ctx.needs_input_grad[1:7:2]) else (None,) * 3  # 3 x (C', C)
        grad_b = g2.sum(0).split(sizes) if any(ctx.needs_input_grad[2:7:2]) else (None,) * 3  # 3 x (C',)
        weight_grads = []
        for i, (gw, gb, b_) in enumerate(zip(grad_w, grad_b, params[1::2])):
            weight_grads += [gw if ctx.needs_input_grad[1 + 2 * i] else None,
                             gb if b_ is not None and ctx.needs_input_grad[2 + 2 * i] else None]
        return (grad_x, *weight_grads, grad_bias, None, grad_scale, None)


def _project(x: torch.Tensor, params, heads: int) -> list[torch.Tensor]:
    """``(B, nW, N, C)`` -> q, k, v ``(B, nW, H, N, d)``, views of the projections (one matmul with the
    weights stacked where the rows outnumber :data:`_STACK_ROWS_PER_CHANNEL` x C, three otherwise)."""
    b, nw, n, c = x.shape
    weights, biases = params[0::2], params[1::2]
    if b * nw * n >= _STACK_ROWS_PER_CHANNEL * c:
        stacked_bias = None if all(t is None for t in biases) else torch.cat(
            [t if t is not None else w.new_zeros(w.shape[0]) for w, t in zip(weights, biases)])  # (3C',)
        qkv = F.linear(x, torch.cat(weights), stacked_bias).split([w.shape[0] for w in weights], -1)  # 3 x (B, nW, N, C')
    else:
        qkv = [F.linear(x, w, t) for w, t in zip(weights, biases)]  # 3 x (B, nW, N, C')
    return [t.view(b, nw, n, heads, -1).transpose(2, 3) for t in qkv]


def _project_back(g2: torch.Tensor, weights, sizes) -> torch.Tensor:
    """``(M, 3C') @ [Wq; Wk; Wv]``: the projections' input gradient ``(M, C)``, stacked as in :func:`_project`."""
    if g2.shape[0] >= _STACK_ROWS_PER_CHANNEL * weights[0].shape[1]:
        return g2 @ torch.cat(weights)  # (M, C)
    parts = g2.split(sizes, -1)  # 3 x (M, C'), strided
    out = parts[0] @ weights[0]  # (M, C)
    for g, w in zip(parts[1:], weights[1:]):
        out.addmm_(g, w)
    return out


def _token_major_like(t: torch.Tensor) -> torch.Tensor:
    """An empty ``(B, nW, H, N, d)`` stored as ``(B, nW, N, H, d)``: the projections' layout."""
    b, nw, h, n, d = t.shape
    return t.new_empty(b, nw, n, h, d).transpose(2, 3)


def _unit(x: torch.Tensor, scale: torch.Tensor | None = None, *, norm: torch.Tensor | None = None):
    """``F.normalize(x, dim=-1) * scale_h`` (``x * scale_h / max(|x|, 1e-12)``) and ``|x|`` ``(..., 1)``.
    Given ``norm`` (the backward), the result is written in the standard layout, for its matmuls."""
    given = norm is not None
    norm = norm if given else torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (..., H, N, 1)
    factor = norm.clamp_min(_NORM_EPS).reciprocal()  # (..., H, N, 1)
    if scale is not None:
        factor = factor.mul_(scale.view(-1, 1, 1))
    return torch.mul(x, factor, out=torch.empty(x.shape, dtype=x.dtype, device=x.device)) if given else x * factor, norm


def _unit_backward(grad, y, norm, scale, *, out):
    """Gradient of ``y = x * scale_h / max(|x|, eps)`` from the output's ``grad``, written into ``out``:
    ``(g - y <g, y> / scale^2) * scale / |x|`` (``g * scale / eps`` where ``|x| < eps``: the clamp holds
    the denominator). Returns the gradient of ``scale`` ``(H,)`` (``<g, y> / scale`` summed), or None."""
    dot = (grad * y).sum(-1, keepdim=True)  # (g, H, N, 1)
    grad_scale = None if scale is None else dot.sum(dim=(0, 2, 3)).div_(scale)  # (H,)
    s = 1.0 if scale is None else scale.view(-1, 1, 1)
    coeff = dot.masked_fill_(norm < _NORM_EPS, 0.0).div_(s * s if scale is not None else 1.0)  # (g, H, N, 1)
    torch.mul(grad.sub_(y * coeff), s / norm.clamp_min(_NORM_EPS), out=out)  # (g, H, N, d)
    return grad_scale


def _window_grads(q3, k3, v3, go3, bias, need_bias):
    """Gradients of ``softmax(q3 k3^T + bias) v3`` for one chunk of windows (``(gH, N, d)``, q3 carrying
    the scale), bias ``(W, H, N, N)`` repeating every ``W`` windows, summed over the chunk for its own."""
    w, h, n = bias.shape[:3]
    scores = torch.bmm(q3, k3.transpose(1, 2))  # (gH, N, N)
    scores.view(-1, w, h, n, n).add_(bias)  # (g / W, W, H, N, N)
    probs = torch.softmax(scores, dim=-1)  # (gH, N, N): the forward's, recomputed
    del scores
    grad_v = torch.bmm(probs.transpose(1, 2), go3)  # (gH, N, dv)
    grad_probs = torch.bmm(go3, v3.transpose(1, 2))  # (gH, N, N)
    grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)  # (gH, N, N)
    del grad_probs, probs
    grad_bias = None
    if need_bias:
        per = grad_scores.view(-1, w, h, n, n)  # (g / W, W, H, N, N)
        grad_bias = per[0].clone() if per.shape[0] == 1 else per.sum(0)  # (W, H, N, N)
    grad_q = torch.bmm(grad_scores, k3)  # (gH, N, d): of the scaled q
    grad_k = torch.bmm(grad_scores.transpose(1, 2), q3)  # (gH, N, d)
    return grad_q, grad_k, grad_v, grad_bias


def _cosine(q, k, scale, cosine_scale):
    """Swin V2's cosine attention as plain dot products: unit q (times the head's scale) and unit k, scale 1;
    ``(q, k, scale)`` unchanged without a cosine scale."""
    if cosine_scale is None:
        return q, k, scale
    return F.normalize(q, dim=-1) * cosine_scale.view(-1, 1, 1), F.normalize(k, dim=-1), 1.0


def _reference(q, k, v, bias, scale, cosine_scale, dropout_p, training):
    """The eager formula, the oracle: (B, nW, H, N, d) with bias (nW | 1, H, N, N) broadcast over B."""
    q, k, scale = _cosine(q, k, scale, cosine_scale)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, nW, H, N, N)
    if bias is not None:
        scores = scores + bias  # broadcast over the batch
    probs = F.dropout(scores.softmax(-1), p=dropout_p, training=training)  # (B, nW, H, N, N)
    return probs @ v  # (B, nW, H, N, d)


#: devices where the unfused path is one SDPA call (:func:`_sdpa_windows`): CUDA, whose memory-efficient kernel
#: takes a float mask broadcast over the batch, its gradient and dropout; elsewhere the eager reference
SDPA_DEVICES = {"cuda"}


def _unfused(q, k, v, bias, scale, cosine_scale, dropout_p, training):
    """Off the fused path: one SDPA call on :data:`SDPA_DEVICES`, the eager reference elsewhere."""
    if q.device.type in SDPA_DEVICES:
        return _sdpa_windows(q, k, v, bias, scale, cosine_scale, dropout_p, training)
    return _reference(q, k, v, bias, scale, cosine_scale, dropout_p, training)


def _sdpa_windows(q, k, v, bias, scale, cosine_scale, dropout_p, training):
    """One SDPA call, windows x heads as SDPA's heads: q, k, v ``(B, nW H, N, d)`` and the bias ``(nW | 1, H, N, N)``
    as one ``(1, nW H, N, N)`` mask in the inputs' dtype, broadcast over the batch (no ``(B, nW, H, N, N)`` scores
    in the forward or the backward); gradients, the bias's included, by SDPA's own backward."""
    b, nw, h, n, _ = q.shape
    q, k, scale = _cosine(q, k, scale, cosine_scale)
    q, k, v = (t.reshape(b, nw * h, n, t.shape[-1]) for t in (q, k, v))  # (B, nW H, N, d)
    mask = None if bias is None else bias.expand(nw, h, n, n).reshape(1, nw * h, n, n).to(q.dtype)  # (1, nW H, N, N)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p if training else 0.0,
                                         scale=scale)  # (B, nW H, N, dv)
    return out.view(b, nw, h, n, -1)  # (B, nW, H, N, dv)


def _fusable(q: torch.Tensor, dropout_p: float, training: bool) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and not (
        dropout_p > 0 and training
    )


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cosine_scale: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    fused: bool = True,
) -> torch.Tensor:
    """Attention inside windows: ``(B, nW, H, N, d)`` in and out.

    ``bias`` is one ``(nW, H, N, N)`` or ``(1, H, N, N)`` tensor (position bias plus shift mask,
    built once per layer) added to every example's scores; it is broadcast, never expanded to
    ``(B, nW, H, N, N)``. ``cosine_scale`` (``(H,)`` or ``(H, 1, 1)``) selects Swin V2's cosine
    attention: the scores are ``cos(q_i, k_j) * cosine_scale[h]`` (Swin V2 passes
    ``exp(min(logit_scale, log 100))``), and ``scale`` must then be left ``None``. ``fused=False``
    runs the eager reference. Off the CPU (and on it for low precision or attention dropout in
    training) the fused path is replaced: on CUDA by one SDPA call with windows x heads as its heads
    and the bias as a mask broadcast over the batch (:func:`_sdpa_windows`), elsewhere by the reference.

    The fused path keeps q, k, v as given for the backward (pass views of the projections: nothing
    is copied), the bias and, with cosine attention, the norms of q and k (the normalised q and k
    are recomputed); the output comes back as a view of a ``(B, nW, N, H, d)`` tensor, so
    ``out.transpose(2, 3).flatten(3)`` for the output projection copies nothing.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, shape="(B, nW, H, N, d)")
        if t.dim() != 5:
            raise ValueError(f"{name} must be (B, nW, H, N, d) (5 dims), got shape {tuple(t.shape)}")
    if not (q.shape == k.shape and q.shape[:4] == v.shape[:4]):
        raise ValueError(f"q, k, v must share (B, nW, H, N) and q, k their d: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, nw, h, n, d = q.shape
    _check_bias(bias, nw, h, n)
    dropout_p = check_probability("dropout_p", dropout_p)
    scale, cosine_scale = _scales(scale, cosine_scale, h, d)
    if not check_bool("fused", fused):
        return _reference(q, k, v, bias, scale, cosine_scale, dropout_p, training)
    if not _fusable(q, dropout_p, check_bool("training", training)):
        return _unfused(q, k, v, bias, scale, cosine_scale, dropout_p, training)
    bias, cosine_scale = _fused_terms(bias, cosine_scale, q, h, n)
    return _WindowSDPA.apply(q, k, v, bias, scale, cosine_scale).transpose(2, 3)  # (B, nW, H, N, dv)


def projected_window_attention(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    bias: torch.Tensor | None = None,
    *,
    heads: int,
    scale: float | None = None,
    cosine_scale: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = False,
    fused: bool = True,
) -> torch.Tensor:
    """Window attention of the windows ``x`` ``(B, nW, N, C)`` through their q, k, v projections
    (``F.linear(x, weights[i], biases[i])``, split into ``heads``), keeping only ``x`` for the
    backward: ``(B, nW, N, H * dv)``, the input of the output projection.

    The same attention as :func:`window_attention` on the three projections (``bias``, ``scale``,
    ``cosine_scale``, dropout as there); the fused path recomputes the projections in the backward
    (three matmuls) instead of keeping q, k and v: three ``(B, nW, N, C)`` tensors less per layer in
    training. Other paths (GPU, low precision, attention dropout) project and keep as autograd does.
    """
    check_tensor("x", x, shape="(B, nW, N, C)")
    if x.dim() != 4:
        raise ValueError(f"x must be (B, nW, N, C) (4 dims), got shape {tuple(x.shape)}")
    heads = check_int("heads", heads, minimum=1)
    params = _projection_params(weights, biases, x.shape[-1], heads)
    b, nw, n, _ = x.shape
    d = params[0].shape[0] // heads
    _check_bias(bias, nw, heads, n)
    dropout_p = check_probability("dropout_p", dropout_p)
    scale, cosine_scale = _scales(scale, cosine_scale, heads, d)
    fused = check_bool("fused", fused)
    if not (fused and _fusable(x, dropout_p, check_bool("training", training))):
        q, k, v = _project(x, params, heads)  # (B, nW, H, N, d)
        attend = _unfused if fused else _reference
        out = attend(q, k, v, bias, scale, cosine_scale, dropout_p, training)  # (B, nW, H, N, dv)
        return out.transpose(2, 3).flatten(3)  # (B, nW, N, H * dv)
    bias, cosine_scale = _fused_terms(bias, cosine_scale, x, heads, n)
    out = _ProjectedWindowSDPA.apply(x, *params, bias, scale, cosine_scale, heads)  # (B, nW, N, H, dv)
    return out.flatten(3)  # (B, nW, N, H * dv)


def _check_bias(bias, nw: int, h: int, n: int) -> None:
    if bias is None:
        return
    check_tensor("bias", bias, shape="(nW | 1, H, N, N)")
    if bias.dim() != 4 or bias.shape[0] not in (1, nw) or tuple(bias.shape[1:]) != (h, n, n):
        raise ValueError(f"bias must be (nW or 1, H, N, N) = ({nw} or 1, {h}, {n}, {n}), got {tuple(bias.shape)}")


def _scales(scale, cosine_scale, h: int, d: int) -> tuple[float, torch.Tensor | None]:
    """The dot-product scale (``d ** -0.5`` by default; 1 for cosine attention) and the cosine scale ``(H,)``."""
    scale = check_scale("scale", scale)
    if cosine_scale is None:
        return (d**-0.5 if scale is None else scale), None
    check_tensor("cosine_scale", cosine_scale, shape="(H,)")
    if cosine_scale.numel() != h or cosine_scale.dim() not in (1, 3) or not cosine_scale.is_floating_point():
        raise ValueError(f"cosine_scale must be a floating (H,) or (H, 1, 1) tensor with H = {h}, "
                         f"got {cosine_scale.dtype} of shape {tuple(cosine_scale.shape)}")
    if scale is not None:
        raise ValueError(f"scale must be None with cosine_scale (cosine scores are scaled by cosine_scale alone), got {scale}")
    return 1.0, cosine_scale.reshape(h)


def _fused_terms(bias, cosine_scale, like: torch.Tensor, h: int, n: int):
    """The fused path's bias ``(W, H, N, N)`` (zeros broadcast if none) and cosine scale, in ``like``'s dtype."""
    bias = like.new_zeros(1, 1, n, n).expand(1, h, n, n) if bias is None else bias.to(like.dtype)
    return bias, None if cosine_scale is None else cosine_scale.to(like.dtype)


def _projection_params(weights, biases, c: int, heads: int) -> list:
    """``[wq, bq, wk, bk, wv, bv]`` checked: 2-D weights reading ``C`` channels, q and k alike, every
    output a multiple of ``heads``, biases ``None`` or matching their weight."""
    if not isinstance(weights, (list, tuple)) or len(weights) != 3 or not isinstance(biases, (list, tuple)) or len(biases) != 3:
        raise TypeError(f"weights and biases must be sequences of three (q, k, v), got {type(weights).__name__} "
                        f"and {type(biases).__name__}")
    params = []
    for name, w, bias in zip("qkv", weights, biases):
        check_tensor(f"weights[{name}]", w, shape="(C', C)")
        if w.dim() != 2 or w.shape[1] != c or w.shape[0] % heads:
            raise ValueError(f"weights[{name}] must be (C', C) with C = {c} and C' a multiple of heads = {heads}, "
                             f"got shape {tuple(w.shape)}")
        if bias is not None and (check_tensor(f"biases[{name}]", bias, shape="(C',)").shape != w.shape[:1]):
            raise ValueError(f"biases[{name}] must be None or ({w.shape[0]},), got shape {tuple(bias.shape)}")
        params += [w, bias]
    if params[0].shape != params[2].shape:
        raise ValueError(f"the q and k weights must have one shape, got {tuple(params[0].shape)} and {tuple(params[2].shape)}")
    return params


def _cosine_scale(cosine_scale, scale: float | None, heads: int) -> torch.Tensor:
    """``cosine_scale`` checked: a floating ``(H,)`` or ``(H, 1, 1)`` tensor, and no ``scale`` beside it."""
    check_tensor("cosine_scale", cosine_scale, shape="(H,)")
    if cosine_scale.numel() != heads or cosine_scale.dim() not in (1, 3) or not cosine_scale.is_floating_point():
        raise ValueError(f"cosine_scale must be a floating (H,) or (H, 1, 1) tensor with H = {heads}, "
                         f"got {cosine_scale.dtype} of shape {tuple(cosine_scale.shape)}")
    if scale is not None:
        raise ValueError(f"scale must be None with cosine_scale (cosine scores are scaled by cosine_scale alone), got {scale}")
    return cosine_scale.reshape(heads)  # (H,)


def _pad_to_windows(x: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """Zero-pad ``(B, Hf, Wf, C)`` at the bottom and right to whole windows (Swin, timm, transformers)."""
    pad_h = -x.shape[1] % window[0]
    pad_w = -x.shape[2] % window[1]
    return F.pad(x, (0, 0, 0, pad_w, 0, pad_h)) if pad_h or pad_w else x


class WindowAttention(nn.Module):
    """(Shifted) window self-attention over a ``(B, Hf, Wf, C)`` feature map, Swin V1 or V2.

    Args:
        dim: channels ``C`` (split into ``num_heads`` heads).
        num_heads: heads.
        window_size: ``W`` or ``(Wh, Ww)``.
        shift_size: the cyclic shift (0: plain windows; Swin uses ``W // 2`` every second block).
        position_bias: ``"table"`` (Swin V1's learned table), ``"factorized"`` (row + column
            tables), ``"continuous"`` (Swin V2's MLP) or ``"none"``.
        cosine: Swin V2's cosine attention: ``cos(q, k) * exp(min(logit_scale, log 100))``.
        pretrained_window_size: Swin V2: the window the continuous bias was trained at.
        qkv_bias: biases on the q, k, v projections (V2, as timm: ``q_bias`` and ``v_bias`` only).
        attn_drop, proj_drop: dropout on the attention weights and on the output.
        mask_value: the score added across shifted regions (Swin: -100).
        fused: the fused path (see :func:`window_attention`); ``False``: the eager reference.

    Parameter names are timm's (``qkv``, ``proj``, ``logit_scale``, ``q_bias``, ``v_bias``); the
    position bias lives in ``position_bias``, and timm's flat names (``relative_position_bias_table``,
    ``cpb_mlp.*``) and transformers' ``continuous_position_bias_mlp.*`` load into it.

    >>> layer = WindowAttention(dim=32, num_heads=2, window_size=4, shift_size=2)
    >>> layer(torch.randn(2, 8, 10, 32)).shape  # 10 columns: padded to 12, cropped back
    torch.Size([2, 8, 10, 32])
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        window_size: int | Sequence[int],
        shift_size: int | tuple[int, int] = 0,
        *,
        position_bias: PositionBiasKind = "table",
        cosine: bool = False,
        pretrained_window_size: int | tuple[int, int] = 0,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        mask_value: float = SWIN_MASK_VALUE,
        fused: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": check_device("device", device), "dtype": check_dtype("dtype", dtype)}
        self.dim = check_int("dim", dim, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        if dim % num_heads:
            raise ValueError(f"dim must be a multiple of num_heads, got dim={dim}, num_heads={num_heads}")
        self.window_size = normalize_window_size(window_size, ndim=2)
        self.shift_size = _shift(shift_size, self.window_size, name="shift_size")
        self.position_bias_kind = check_choice("position_bias", position_bias, ("table", "factorized", "continuous", "none"))
        self.cosine = check_bool("cosine", cosine)
        self.mask_value = check_real("mask_value", mask_value)
        qkv_bias = check_bool("qkv_bias", qkv_bias)
        self.fused = check_bool("fused", fused)
        self.attn_drop = check_probability("attn_drop", attn_drop)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias and not cosine, **factory)
        self.q_bias = nn.Parameter(torch.zeros(dim, **factory)) if qkv_bias and cosine else None
        self.v_bias = nn.Parameter(torch.zeros(dim, **factory)) if qkv_bias and cosine else None
        self.logit_scale = nn.Parameter(torch.full((num_heads, 1, 1), math.log(10), **factory)) if cosine else None
        self.position_bias = self._make_bias(position_bias, pretrained_window_size, factory)
        self.proj = nn.Linear(dim, dim, **factory)
        self.proj_drop = nn.Dropout(check_probability("proj_drop", proj_drop))

    def _make_bias(self, kind: str, pretrained, factory) -> nn.Module | None:
        if kind == "table":
            return RelativePositionBias(self.num_heads, self.window_size, **factory)
        if kind == "factorized":
            return FactorizedRelativePositionBias(self.num_heads, self.window_size, **factory)
        if kind == "continuous":
            return ContinuousPositionBias(self.num_heads, self.window_size, pretrained, **factory)
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """timm's flat names for the bias (``relative_position_bias_table``, ``cpb_mlp.*``) go to ``position_bias``."""
        flat = ("relative_position_bias_table", "relative_position_index", "relative_coords_table", "cpb_mlp.",
                "continuous_position_bias_mlp.")
        for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):].startswith(flat)]:
            state_dict[prefix + "position_bias." + key[len(prefix):]] = state_dict.pop(key)
        state_dict.pop(prefix + "k_bias", None)  # timm V2: a zero buffer
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, window_size={self.window_size}, shift_size={self.shift_size}, "
                f"position_bias={self.position_bias_kind!r}, cosine={self.cosine}")

    def window_bias(self, height: int, width: int, *, device=None, dtype=None) -> torch.Tensor | None:
        """``(nW | 1, H, N, N)``: the position bias plus the shift mask of a padded map, combined once."""
        bias = None if self.position_bias is None else self.position_bias()[None]  # (1, H, N, N)
        if any(self.shift_size):
            mask = shift_mask(height, width, self.window_size, self.shift_size, mask_value=self.mask_value,
                              device=device, dtype=dtype or torch.float32)[:, None]  # (nW, 1, N, N)
            bias = mask.expand(-1, self.num_heads, -1, -1) if bias is None else bias + mask  # (nW, H, N, N)
        return bias

    def project(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(B, nW, N, C)`` -> q, k, v ``(B, nW, H, N, d)`` (views of one projection) and, for cosine
        attention, the per-head scale ``exp(min(logit_scale, log 100))`` ``(H,)`` (else ``None``)."""
        b, nw, n, c = windows.shape
        bias = None
        if self.q_bias is not None:
            bias = torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])  # (3C,)
        qkv = F.linear(windows, self.qkv.weight, self.qkv.bias if bias is None else bias)  # (B, nW, N, 3C)
        q, k, v = qkv.view(b, nw, n, 3, self.num_heads, -1).permute(3, 0, 1, 4, 2, 5)  # 3 x (B, nW, H, N, d)
        if not self.cosine:
            return q, k, v, None
        return q, k, v, torch.clamp(self.logit_scale, max=math.log(100.0)).exp().view(-1)  # (H,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, Hf, Wf, C) -> (B, Hf, Wf, C)``."""
        check_tensor("x", x, shape="(B, Hf, Wf, C)")
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (B, Hf, Wf, C={self.dim}), got shape {tuple(x.shape)}")
        b, height, width, c = x.shape
        padded = _pad_to_windows(x, self.window_size)  # (B, Hp, Wp, C)
        hp, wp = padded.shape[1:3]
        if any(self.shift_size):
            padded = torch.roll(padded, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2))
        q, k, v, cosine_scale = self.project(window_partition(padded, self.window_size))  # (B, nW, H, N, d)
        bias = self.window_bias(hp, wp, device=x.device, dtype=x.dtype)  # (nW | 1, H, N, N)
        out = window_attention(q, k, v, bias, cosine_scale=cosine_scale, dropout_p=self.attn_drop,
                               training=self.training, fused=self.fused)  # (B, nW, H, N, d)
        out = self.proj_drop(self.proj(out.transpose(2, 3).flatten(3)))  # (B, nW, N, C)
        merged = window_merge(out, self.window_size, hp, wp)  # (B, Hp, Wp, C)
        if any(self.shift_size):
            merged = torch.roll(merged, shifts=self.shift_size, dims=(1, 2))
        return merged[:, :height, :width]  # (B, Hf, Wf, C)
