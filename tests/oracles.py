"""Shared helpers for the encodings' tests: an fp64 attention oracle written from the formula,
inputs, and the decode-equals-parallel check through MultiheadAttention with a KVCache."""

import math

import torch

from relpos import KVCache, MultiheadAttention


def qkv(b=2, h=4, lq=12, lk=12, d=16, *, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, h, lq, d), (b, h, lk, d), (b, h, lk, d))
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes]


def oracle(q, k, v, bias=None, *, causal=False, q_offset=0, key_mask=None, scale=None):
    """softmax(q k^T scale + bias + mask) v in fp64, every step written out; bias broadcastable to (B, H, Lq, Lk)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.double()
    lq, lk = q.shape[2], k.shape[2]
    i = torch.arange(lq)[:, None] + q_offset
    j = torch.arange(lk)[None, :]
    blocked = torch.zeros(lq, lk, dtype=torch.bool)
    if causal:
        blocked = j > i
    if key_mask is not None:
        blocked = blocked | ~key_mask[:, None, None, :]
    scores = scores.masked_fill(blocked, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ v


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
    layer = MultiheadAttention(embed_dim, heads, position=position, causal=True).double()
    x = torch.randn(2, length, embed_dim, dtype=torch.float64)
    with torch.no_grad():
        full, _ = layer(x)
        cache = KVCache()
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
