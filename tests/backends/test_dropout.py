"""Dropout masks (relpos/backends/_dropout.py): rebuilt from torch.Generator, independent across examples, rows and heads.

The mask a backend really applies is read off its output: with q = k = 0 every weight is 1/Lk,
and with v = I the output row is the (scaled) keep-mask itself. So these tests check what each
backend drops, not what a helper says it would drop.
"""

import math

import pytest
import torch

from relpos import ShawRelativePosition, attention
from relpos.backends._dropout import keep_dense, keep_rows

from oracles import dropout_keep

B, H, L, LK = 2, 3, 130, 32  # 130 rows: three 64-row generator groups, the last one partial


def realized(backend: str, p: float, seed: int = 0, batch=B, heads=H, rows=L, keys=LK) -> torch.Tensor:
    """(B, H, Lq, Lk) the weights a backend scales by 1 / (1 - p), i.e. its keep-mask times its scale."""
    q = torch.zeros(batch, heads, rows, keys)
    v = torch.eye(keys).expand(batch, heads, keys, keys)  # identity values: output = weights
    shaw = ShawRelativePosition(keys, 2, values=False)  # built before seeding: its init draws from the RNG
    shaw.rel_keys.data.zero_()
    torch.manual_seed(seed)
    with torch.no_grad():
        if backend == "shaw":
            out = shaw.attention(q, q[:, :, :keys], v, dropout_p=p)
        else:
            out = attention(q, q[:, :, :keys], v, dropout_p=p, backend=backend)
    return out * keys  # kept: 1 / (1 - p), dropped: 0


def first_seed(seed: int) -> int:
    """The one seed a dropout call takes from torch's global RNG after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return int(torch.randint(0, 2**62, (1,)).item())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.37])
def test_keep_mask_rebuilt_from_torch_generator(p):
    seed = first_seed(3)
    expected = dropout_keep(seed, B, H, L, 7, p)  # H * 64 * 7 draws per group: odd, so one int16 is unused
    assert torch.equal(keep_dense(seed, B, H, L, 7, p), expected)
    assert torch.equal(keep_rows(seed, 1, 60, 70, H, 7, p), expected[1, :, 60:70])


@pytest.mark.parametrize("backend", ["eager", "fused", "shaw"])
def test_backend_drops_exactly_the_documented_mask(backend):
    p = 0.3
    got = realized(backend, p, seed=5)
    want = dropout_keep(first_seed(5), B, H, L, LK, p).double() / (1 - p)
    assert torch.allclose(got.double(), want, atol=1e-5)


def _agreement_and_correlation(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    a, b = a.flatten().double(), b.flatten().double()
    agree = float((a == b).double().mean())
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    return agree, corr, a.numel()


@pytest.mark.parametrize("backend", ["eager", "fused", "shaw", "sdpa"])
def test_masks_are_independent_across_examples_rows_and_heads(backend):
    """Two independent Bernoulli(1 - p) masks agree with probability p^2 + (1 - p)^2 and are uncorrelated."""
    p = 0.3
    weights = realized(backend, p, seed=9)
    kept = weights > 0  # (B, H, Lq, Lk)
    scale = weights[kept]
    assert torch.allclose(scale, torch.full_like(scale, 1 / (1 - p)), rtol=1e-5)  # kept weights scaled by 1 / (1 - p)
    n = kept.numel()
    assert abs(float(kept.double().mean()) - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    pairs = {
        "examples": (kept[0], kept[1]),
        "heads": (kept[:, 0], kept[:, 1]),
        "adjacent rows": (kept[:, :, :-1], kept[:, :, 1:]),
        "rows 64 apart (generator groups)": (kept[:, :, :64], kept[:, :, 64:128]),
        "adjacent keys": (kept[..., :-1], kept[..., 1:]),
    }
    expected = p**2 + (1 - p) ** 2
    for what, (a, b) in pairs.items():
        agree, corr, m = _agreement_and_correlation(a, b)
        sigma = math.sqrt(expected * (1 - expected) / m)
        assert abs(agree - expected) < 6 * sigma, (what, agree, expected)
        assert abs(corr) < 6 / math.sqrt(m), (what, corr)


def test_calls_draw_fresh_masks():
    torch.manual_seed(0)
    a, b = realized("fused", 0.5, seed=1), realized("fused", 0.5, seed=2)
    agree, _, m = _agreement_and_correlation(a > 0, b > 0)
    assert abs(agree - 0.5) < 6 * math.sqrt(0.25 / m)
