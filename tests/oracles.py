"""Independent references for the tests: biases from their formulas, fp64 attention, dropout masks.

Nothing here calls the code under test to build an expected value: a bias is rebuilt from the
module's parameters (its table, its slopes) at explicit offsets ``j - i`` made with
``torch.arange``, through each paper's formula. The only relpos function used is
:func:`relpos.t5_bucket` (the issue's "table and t5_bucket of explicit j - i"), which
tests/encodings/test_buckets.py checks against transformers' own bucket function for every small config.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import relpos

__all__ = [
    "CASES",
    "check_backend",
    "decode_matches_parallel",
    "oracle",
    "padding_mask",
    "qkv",
    "assert_bias_matters",
    "attend",
    "bias_oracle",
    "dropout_keep",
    "offsets",
    "paper_slopes",
    "philox_keep",
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
    if isinstance(module, relpos.KerpleBias):  # Chi et al. 2022; r1, r2 > 0 (the module's floor 1e-2, power r2 <= 2)
        r1 = param(module.r1).clamp(min=1e-2)[:, None, None]  # (H, 1, 1)
        r2 = param(module.r2).clamp(min=1e-2, max=2.0 if module.kind == "power" else None)[:, None, None]
        distance = rel.abs().double()  # (Lq, Lk)
        kernel = torch.log(1 + r2 * distance) if module.kind == "log" else distance**r2  # (H, Lq, Lk)
        return (-r1 * kernel)[None]  # (1, H, Lq, Lk)
    if isinstance(module, relpos.SandwichBias):  # Chi et al. 2023: sinusoid inner product - d'/2, over 8 h' / H
        k = torch.arange(1, module.dim // 2 + 1, dtype=torch.float64)  # (d'/2,)
        inner = torch.cos(rel.double()[..., None] * 10000.0 ** (-2 * k / module.dim)).sum(-1) - module.dim / 2  # (Lq, Lk)
        heads = torch.arange(1, module.num_heads + 1, dtype=torch.float64)  # (H,)
        return (inner[None] / (8 * heads / module.num_heads)[:, None, None])[None]  # (1, H, Lq, Lk)
    if isinstance(module, relpos.FIREBias):  # Li et al. 2024: f(psi(i - j) / psi(max(L, i))), psi(x) = log(|c x| + 1)
        c, threshold = param(module.c), (param(module.L_multiplier) * module.init_L.double()).abs()
        psi = lambda x: torch.log((c * x).abs() + 1)  # noqa: E731
        i = (torch.arange(query_length) + q_offset).double()  # (Lq,)
        normalized = psi(rel.double()) / (psi(torch.maximum(i, threshold)) + module.eps)[:, None]  # (Lq, Lk)
        first, last = module.mlp[0], module.mlp[2]
        hidden = torch.relu(normalized[..., None] * param(first.weight)[:, 0] + param(first.bias))  # (Lq, Lk, width)
        return (hidden @ param(last.weight).T + param(last.bias)).permute(2, 0, 1)[None]  # (1, H, Lq, Lk)
    raise TypeError(f"no oracle for {type(module).__name__}: add its formula to tests/oracles.py")


def dropout_keep(seed: int, batch: int, heads: int, query_length: int, key_length: int, p: float) -> torch.Tensor:
    """(B, H, Lq, Lk) keep-mask rebuilt from torch.Generator as relpos/backends/_dropout.py documents it.

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


def _philox_words(seed: int, c0: np.ndarray, c1=0, c2=0, c3=0, rounds: int = 7) -> tuple[np.ndarray, ...]:
    """Philox4x32 with ``rounds`` rounds (Salmon et al., SC 2011; 7 in relpos's kernel, as in FlashAttention-2) of the
    counter ``(c0, c1, c2, c3)`` (32-bit words, broadcast together) under the 64-bit key ``seed`` ``(lo, hi)``: the
    four output words (uint32), as Triton's ``tl.philox(seed, c0, c1, c2, c3, n_rounds)`` documents it. numpy,
    written from the paper's round function."""
    m32 = np.uint64(0xFFFFFFFF)
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint64) & m32 for c in (c0, c1, c2, c3)))
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    for _ in range(rounds):
        prod_a, prod_b = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2  # exact: 32 x 32 bits fit in 64
        c0, c1, c2, c3 = ((prod_b >> np.uint64(32)) ^ c1 ^ k0, prod_b & m32, (prod_a >> np.uint64(32)) ^ c3 ^ k1,
                          prod_a & m32)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    return c0, c1, c2, c3


def philox_keep(seed: int, batch: int, heads: int, query_length: int, key_length: int, p: float) -> torch.Tensor:
    """(B, H, Lq, Lk) keep-mask of the Triton kernel's dropout as relpos/backends/_triton.py documents it: query
    ``i = 16 u + 8 s + r`` and key ``j = 16 v + 8 t + c`` (``r, c < 8``) of (example, head) ``bh`` read word
    ``2 s + t`` of Philox4x32-7 at the counter ``(8 v + c, bh, 8 u + r, 0)``, and are kept when its high 16 bits
    reach ``round(p * 2**16)``."""
    bh = np.arange(batch * heads, dtype=np.uint64)[:, None, None]
    i = np.arange(query_length, dtype=np.uint64)[None, :, None]
    j = np.arange(key_length, dtype=np.uint64)[None, None, :]
    sixteen, eight = np.uint64(16), np.uint64(8)
    words = np.stack(_philox_words(seed, j // sixteen * eight + j % eight, bh, i // sixteen * eight + i % eight))
    word = (i // eight % np.uint64(2)) * np.uint64(2) + j // eight % np.uint64(2)  # (1, Lq, Lk): 2 s + t
    chosen = np.take_along_axis(words, np.broadcast_to(word, words.shape[1:]).astype(np.int64)[None], 0)[0]
    kept = (chosen >> sixteen) >= round(p * 65536)  # (B H, Lq, Lk)
    return torch.from_numpy(kept).reshape(batch, heads, query_length, key_length)


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


# --- shared by the encodings' tests (Kerple, Sandwich, FIRE, xPos, forgetting gates, CoPE) ---


def qkv(b=2, h=4, lq=12, lk=12, d=16, *, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, h, lq, d), (b, h, lk, d), (b, h, lk, d))
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes]


def oracle(q, k, v, bias=None, *, causal=False, q_offset=0, key_mask=None, scale=None):
    """:func:`attend` under the encodings' tests' argument names (``key_mask``: True = a real key)."""
    return attend(q, k, v, bias, causal=causal, keep=key_mask, scale=scale, q_offset=q_offset)


def padding_layout(layout: str, batch: int, length: int) -> torch.Tensor | None:
    """(B, L) boolean key mask (True = a real token) in one of the layouts the fuzzing tests draw.

    ``none`` (None), ``right`` (example 0 keeps its first L // 2 + 1), ``left`` (the last example drops its first
    L // 2), ``one_real_first`` / ``one_real_last`` (example 0 keeps only its first / last token), ``alike`` (every
    example drops its last 3, keeping at least one), ``all_padding`` (the last example keeps nothing).
    """
    if layout == "none":
        return None
    keep = torch.ones(batch, length, dtype=torch.bool)
    if layout == "right":
        keep[0, length // 2 + 1 :] = False
    elif layout == "left":
        keep[batch - 1, : length // 2] = False
    elif layout in ("one_real_first", "one_real_last"):
        keep[0] = False
        keep[0, 0 if layout == "one_real_first" else length - 1] = True
    elif layout == "alike":
        keep[:, max(1, length - 3) :] = False
    elif layout == "all_padding":
        keep[batch - 1] = False
    else:
        raise ValueError(f"unknown padding layout {layout!r}")
    return keep


def padding_mask(batch, length):
    """Example 0 right-padded by 3, example 1 left-padded by 2 (the rest full)."""
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, -3:] = False
    if batch > 1:
        mask[1, :2] = False
    return mask


def decode_matches_parallel(position, *, embed_dim=32, heads=4, length=10, prompt=4, atol=1e-5, seed=0):
    """A causal MultiheadAttention layer with ``position``: the prompt then one token per step through
    a KVCache equals one parallel call; returns the parallel output."""
    torch.manual_seed(seed)
    layer = relpos.MultiheadAttention(embed_dim, heads, position=position, causal=True).double()
    x = torch.randn(2, length, embed_dim, dtype=torch.float64)
    with torch.no_grad():
        full, _ = layer(x)
        cache = relpos.KVCache()
        steps = [layer(x[:, :prompt], cache=cache)[0]]
        steps += [layer(x[:, t : t + 1], cache=cache)[0] for t in range(prompt, length)]
    stepwise = torch.cat(steps, dim=1)
    assert torch.allclose(stepwise, full, atol=atol), (stepwise - full).abs().max()
    return full


CASES = [  # (lq, lk, causal, q_offset, padded): bidirectional, causal, padded both ways, a decoding row
    (12, 12, False, 0, False),
    (12, 12, True, 0, False),
    (12, 12, False, 0, True),
    (12, 12, True, 0, True),
    (1, 12, True, 11, False),
]


def check_backend(make_bias, expected_bias, backend, lq, lk, causal, q_offset, padded, *, atol=2e-5, matters=0.05,
                  unused=()):
    """attention(bias=make_bias()) on ``backend`` equals the fp64 oracle with ``expected_bias(lq, lk, q_offset)``
    (H, Lq, Lk), the bias changes the output by more than ``matters``, and the gradients into q, k, v and
    every parameter (but those named in ``unused``, which these rows do not depend on) equal the eager path's."""
    from relpos import attention

    bias = make_bias()
    q, k, v = qkv(lq=lq, lk=lk, grad=True)
    key_mask = padding_mask(2, lk) if padded else None
    kw = dict(causal=causal, q_offset=q_offset, key_mask=key_mask)
    out = attention(q, k, v, bias=bias, backend=backend, **kw)
    expected = oracle(q, k, v, expected_bias(lq, lk, q_offset), **kw)
    assert torch.allclose(out.double(), expected, atol=atol), (out.double() - expected).abs().max()
    assert (oracle(q, k, v, **kw) - expected).abs().max() > matters  # the position term matters
    out.square().sum().backward()
    reference = make_bias()
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    attention(q2, k2, v2, bias=reference, backend="eager", **kw).square().sum().backward()
    assert torch.allclose(q.grad, q2.grad, atol=1e-4) and torch.allclose(k.grad, k2.grad, atol=1e-4)
    assert torch.allclose(v.grad, v2.grad, atol=1e-4)
    for (name, p), p2 in zip(bias.named_parameters(), reference.parameters()):
        assert name in unused or (p.grad is not None and p.grad.abs().max() > 0), name
        assert name in unused or torch.allclose(p.grad, p2.grad, atol=1e-4, rtol=1e-4), name
    return bias
