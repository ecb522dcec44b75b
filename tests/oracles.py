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
