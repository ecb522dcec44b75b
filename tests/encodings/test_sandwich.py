"""Sandwich (Chi et al. 2023): the inner product of sinusoidal embeddings as a bias."""

import pytest
import torch

from relpos import OffsetBias, SandwichBias, attention

from oracles import CASES, check_backend, decode_matches_parallel, padding_mask, qkv


def formula(heads, dim, lq, lk, q_offset=0):
    """fp64 (H, Lq, Lk): (p_i . p_j - d'/2) / (8 h' / H) with p_m = [sin(m w_k), cos(m w_k)], w_k = 10000^(-2k/d')."""
    w = 10000.0 ** (-2.0 * torch.arange(1, dim // 2 + 1, dtype=torch.float64) / dim)
    def embed(positions):
        angles = positions.double()[:, None] * w[None, :]
        return torch.cat([angles.sin(), angles.cos()], -1)  # (L, d')
    p_i, p_j = embed(torch.arange(lq) + q_offset), embed(torch.arange(lk))
    inner = p_i @ p_j.T - dim / 2  # (Lq, Lk)
    scale = 8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads
    return inner[None] / scale[:, None, None]


def test_equals_the_sinusoid_inner_product():
    bias = SandwichBias(4, dim=64)
    for lq, lk, q_offset in ((9, 9, 0), (3, 40, 37), (1, 100, 99)):
        assert torch.allclose(bias.materialize(lq, lk, q_offset=q_offset)[0].double(), formula(4, 64, lq, lk, q_offset), atol=1e-5)
    values = bias.materialize(200, 200)[0, 0, 199]  # last query row, head 0
    assert values[199] == 0 and values[0] < values[150] < values[198] < 0  # zero on the diagonal, decreasing with distance
    assert isinstance(bias.offsets(16, 16), OffsetBias) and list(bias.parameters()) == []  # no parameters, per-offset


@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
@pytest.mark.parametrize("lq, lk, causal, q_offset, padded", CASES)
def test_every_backend_equals_the_fp64_oracle(backend, lq, lk, causal, q_offset, padded):
    # d' = 8: higher frequencies, so the bias matters at these short lengths (H = 4: scales 2, 4, 6, 8)
    check_backend(lambda: _Scaled(SandwichBias(4, dim=8)), lambda a, b, o: 40 * formula(4, 8, a, b, o), backend, lq, lk,
                  causal, q_offset, padded)


class _Scaled(SandwichBias):
    """Sandwich times 40 (its own values at 12 tokens are too small to move the output far past the tolerance)."""

    def __init__(self, inner):
        super().__init__(inner.num_heads, inner.dim)

    def bias_at(self, relative_position):
        return 40 * super().bias_at(relative_position)


def test_decode_equals_parallel():
    decode_matches_parallel(SandwichBias(4, dim=8))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dim": 7}, ValueError, "dim must be even"),
    ({"dim": 0}, ValueError, "dim must be >= 2"),
    ({"dim": 8.0}, TypeError, "dim must be an int"),
])
def test_bad_inputs(kwargs, error, match):
    with pytest.raises(error, match=match):
        SandwichBias(4, **kwargs)


def test_flex_equals_eager_on_cpu_inference():
    bias = _Scaled(SandwichBias(4, dim=8))
    q, k, v = qkv(lq=64, lk=64)
    with torch.no_grad():
        out = attention(q, k, v, bias=bias, causal=True, key_mask=padding_mask(2, 64), backend="flex")
        expected = attention(q, k, v, bias=bias, causal=True, key_mask=padding_mask(2, 64), backend="eager")
    assert torch.allclose(out, expected, atol=1e-5)
    assert (expected - attention(q, k, v, causal=True, key_mask=padding_mask(2, 64), backend="eager")).abs().max() > 0.05


def test_the_per_distance_cache_equals_the_formula_as_it_grows():
    """bias_at keeps the per-distance sums and grows them: every call equals the paper's sum, in any order."""
    import math

    bias = SandwichBias(2, dim=12)

    def formula(r):  # (sum_k cos(r / 10000^(2k/d')) - d'/2) / (8 h'/H), fp64
        inner = sum(math.cos(r / 10000 ** (2 * k / 12)) for k in range(1, 7)) - 6
        return [inner / (8 * h / 2) for h in (1, 2)]

    for offsets in ([0, -3, 2], [4, -4], list(range(-40, 41)), [5, -1], [-300, 299, 7]):  # [4, -4]: exactly the cache's size
        got = bias.bias_at(torch.tensor(offsets))  # (H, n)
        want = torch.tensor([formula(r) for r in offsets], dtype=torch.float64).T.float()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    fractional = bias.bias_at(torch.tensor([0.5, -2.5]))  # not an index into the cache
    torch.testing.assert_close(fractional, torch.tensor([formula(0.5), formula(-2.5)]).T.float(), rtol=1e-6, atol=1e-6)
