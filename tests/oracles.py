"""Independent references for the tests: biases from their formulas, fp64 attention, dropout masks.

Nothing here calls the code under test to build an expected value: a bias is rebuilt from the
module's parameters (its table, its slopes) at explicit offsets ``j - i`` made with
``torch.arange``, through each paper's formula. The only relpos function used is
:func:`relpos.t5_bucket` (the issue's "table and t5_bucket of explicit j - i"), which
tests/test_buckets.py checks against transformers' own bucket function for every small config.
"""

from __future__ import annotations

import math

import torch

import relpos

__all__ = [
    "assert_bias_matters",
    "attend",
    "bias_oracle",
    "dropout_keep",
    "offsets",
    "paper_slopes",
]


def offsets(query_length: int, key_length: int, q_offset: int = 0) -> torch.Tensor:
    """(Lq, Lk) ``j - i`` for queries at positions ``q_offset .. q_offset + Lq - 1``."""
    i = torch.arange(query_length)[:, None] + q_offset  # (Lq, 1)
    j = torch.arange(key_length)[None, :]  # (1, Lk)
    return j - i  # (Lq, Lk)


def paper_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's slopes for a power-of-two head count: ``2 ** (-8 k / n)``, k = 1..n (Press et al., 2022)."""
    assert num_heads & (num_heads - 1) == 0, "the closed form holds for powers of two"
    return torch.tensor([2.0 ** (-8.0 * k / num_heads) for k in range(1, num_heads + 1)], dtype=torch.float64)


def _window_pairs(window_size: tuple[int, ...]) -> torch.Tensor:
    """(ndim, N, N) query - key coordinate differences over a window, row-major (Swin)."""
    grids = torch.meshgrid(*[torch.arange(w) for w in window_size], indexing="ij")
    coords = torch.stack([g.reshape(-1) for g in grids])  # (ndim, N)
    return coords[:, :, None] - coords[:, None, :]  # (ndim, N, N)


def bias_oracle(module, query_length: int, key_length: int, q_offset: int = 0, *, slopes=None, grad=False) -> torch.Tensor:
    """(1, H, Lq, Lk) fp64 bias of ``module`` rebuilt from its parameters and the paper's formula.

    ``grad=True`` keeps the parameters in the graph (a reference gradient for the table).
    """
    param = (lambda t: t.double()) if grad else (lambda t: t.detach().double())  # noqa: E731
    rel = offsets(query_length, key_length, q_offset)  # (Lq, Lk)
    if isinstance(module, relpos.RelativePositionalBias):
        assert module.strategy == "log", "the oracle knows T5's log buckets"
        buckets = relpos.t5_bucket(
            rel, bidirectional=module.bidirectional, num_buckets=module.num_buckets, max_distance=module.max_distance
        )  # (Lq, Lk)
        table = param(module.relative_attention_bias.weight)  # (buckets, H)
        return table[buckets].permute(2, 0, 1)[None]  # (1, H, Lq, Lk)
    if isinstance(module, relpos.ClippedRelativeBias):
        r = module.max_distance
        table = param(module.relative_bias)  # (H, 2R + 1), column c = offset c - R
        return table[:, rel.clamp(-r, r) + r][None]  # (1, H, Lq, Lk)
    if isinstance(module, relpos.ALiBi):
        s = paper_slopes(module.num_heads) if slopes is None else torch.tensor(slopes, dtype=torch.float64)
        distance = (-rel).clamp(min=0) if module.mode == "causal" else rel.abs()  # (Lq, Lk): how far back / away
        return (-s[:, None, None] * distance.double())[None]  # (1, H, Lq, Lk)
    if isinstance(module, relpos.LogDecayBias):
        values = -module.scale * torch.log1p(rel.abs().double())  # (Lq, Lk)
        return values.expand(module.num_heads, -1, -1)[None]  # (1, H, Lq, Lk)
    if isinstance(module, relpos.RelativePositionBias):
        assert (query_length, key_length, q_offset) == (module.window_area,) * 2 + (0,)
        d = _window_pairs(module.window_size)  # (ndim, N, N): query - key
        if len(module.window_size) == 1:
            index = d[0] + module.window_size[0] - 1  # (N, N)
        else:
            wh, ww = module.window_size
            index = (d[0] + wh - 1) * (2 * ww - 1) + (d[1] + ww - 1)  # (N, N)
        table = param(module.relative_position_bias_table)  # (table_size, H)
        return table[index].permute(2, 0, 1)[None]  # (1, H, N, N)
    if isinstance(module, relpos.FactorizedRelativePositionBias):
        d = _window_pairs(module.window_size)  # (2, N, N)
        wh, ww = module.window_size
        h = param(module.height_bias_table)[d[0] + wh - 1]  # (N, N, H)
        w = param(module.width_bias_table)[d[1] + ww - 1]  # (N, N, H)
        return (h + w).permute(2, 0, 1)[None]  # (1, H, N, N)
    if isinstance(module, relpos.ContinuousPositionBias):  # Swin V2: 16 sigmoid(MLP(log-spaced query - key))
        d = _window_pairs(module.window_size).double()  # (2, N, N)
        spans = [(p if p > 0 else w) - 1 for w, p in zip(module.window_size, module.pretrained_window_size)]
        x = torch.stack([d[a] / max(spans[a], 1) * (8 if spans[a] > 0 else 1) for a in range(2)], -1)  # (N, N, 2)
        x = torch.sign(x) * torch.log2(1 + x.abs()) / 3  # log2(8) = 3
        first, last = module.cpb_mlp[0], module.cpb_mlp[2]
        hidden = torch.relu(x @ param(first.weight).T + param(first.bias))  # (N, N, hidden)
        return (16 * torch.sigmoid(hidden @ param(last.weight).T)).permute(2, 0, 1)[None]  # (1, H, N, N)
    raise TypeError(f"no oracle for {type(module).__name__}: add its formula to tests/oracles.py")


def dropout_keep(seed: int, batch: int, heads: int, query_length: int, key_length: int, p: float) -> torch.Tensor:
    """(B, H, Lq, Lk) keep-mask rebuilt from torch.Generator as relpos/_dropout.py documents it.

    Example ``b``, query rows ``64 g .. 64 g + 63``: a generator seeded with
    ``hash((seed, b, g)) & (2**63 - 1)`` fills ``ceil(H * 64 * Lk / 2)`` int32 values; read as
    int16 pairs, laid out (H, 64, Lk), a weight is dropped when ``u + 2**15 < round(p * 2**16)``.
    """
    rows = 64
    out = torch.empty(batch, heads, query_length, key_length, dtype=torch.bool)
    threshold = round(p * 65536)
    for b in range(batch):
        for g in range(math.ceil(query_length / rows)):
            gen = torch.Generator().manual_seed(hash((seed, b, g)) & (2**63 - 1))
            count = heads * rows * key_length
            words = torch.empty((count + 1) // 2, dtype=torch.int32).random_(-(2**31), 2**31 - 1, generator=gen)
            u = words.view(torch.int16)[:count].view(heads, rows, key_length).int() + 32768  # (H, 64, Lk) in [0, 2**16)
            r1 = min(query_length, (g + 1) * rows)
            out[b, :, g * rows : r1] = (u >= threshold)[:, : r1 - g * rows]
    return out


def attend(q, k, v, bias=None, *, causal=False, keep=None, mask=None, scale=None, q_offset=0, drop=None, p=0.0):
    """Naive fp64 attention; a row with no visible key gives 0.

    ``bias`` (.., Lq, Lk) additive; ``keep`` (B, Lk) real keys; ``mask`` (.., Lq, Lk) boolean keeps;
    ``drop`` (B, H, Lq, Lk) keep-mask applied after the softmax, kept weights scaled by 1 / (1 - p).
    k and v may have fewer heads than q (grouped-query attention).
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, H, Lk, d)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale  # (B, H, Lq, Lk)
    if bias is not None:
        s = s + bias.double()
    allowed = torch.ones(s.shape, dtype=torch.bool)
    if causal:
        allowed = allowed & (offsets(q.shape[2], k.shape[2], q_offset) <= 0)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    if mask is not None:
        allowed = allowed & mask
    w = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)  # (B, H, Lq, Lk)
    if drop is not None:
        w = w * drop / (1 - round(p * 65536) / 65536)
    return w @ v  # (B, H, Lq, dv)


def assert_bias_matters(with_bias: torch.Tensor, without_bias: torch.Tensor, tol: float, factor: float = 10.0) -> None:
    """The position term moves the result by more than ``factor`` times the test's tolerance.

    A test whose bias changes the output by less than its tolerance would pass with the bias dropped.
    """
    moved = float((with_bias.detach().double() - without_bias.detach().double()).abs().max())
    assert moved > factor * tol, f"the bias moves the result by only {moved:.3g}; tolerance {tol:.3g} x {factor}"
