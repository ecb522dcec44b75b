"""FIRE (Li et al. 2024): the paper's formula, per-offset up to the threshold L, exact past it."""

import pytest
import torch

from relpos import FIREBias, OffsetBias, attention, select_backend

from oracles import CASES, check_backend, decode_matches_parallel, padding_mask, qkv


def make_fire(init_L=512.0, seed=0, heads=4):  # noqa: N803
    torch.manual_seed(seed)
    fire = FIREBias(heads, mlp_width=16, init_c=0.5, init_L=init_L)
    with torch.no_grad():
        for p in fire.mlp.parameters():
            p.normal_(0, 1.5)  # a bias far from zero, so that it moves the output
    return fire


def formula(fire, lq, lk, q_offset=0):
    """fp64 (H, Lq, Lk) from the paper's listing: f(psi(i - j) / psi(max(L, i))), psi(x) = log(|c x| + 1)."""
    c = fire.c.double()
    L = (fire.L_multiplier.double() * fire.init_L.double()).abs()
    i = torch.arange(lq, dtype=torch.float64)[:, None] + q_offset
    j = torch.arange(lk, dtype=torch.float64)[None, :]
    psi = lambda x: torch.log(torch.abs(c * x) + 1)  # noqa: E731
    normalized = psi(i - j) / (psi(torch.maximum(i, L)) + fire.eps)  # (Lq, Lk)
    w1, b1 = fire.mlp[0].weight.double(), fire.mlp[0].bias.double()
    w2, b2 = fire.mlp[2].weight.double(), fire.mlp[2].bias.double()
    hidden = torch.relu(normalized[..., None] * w1[:, 0] + b1)  # (Lq, Lk, width)
    return (hidden @ w2.T + b2).permute(2, 0, 1)  # (H, Lq, Lk)


@pytest.mark.parametrize("init_L", [512.0, 5.0])
def test_equals_the_papers_formula(init_L):  # noqa: N803
    fire = make_fire(init_L)
    for lq, lk, q_offset in ((9, 9, 0), (3, 20, 17), (1, 30, 29)):
        got = fire.materialize(lq, lk, q_offset=q_offset)[0].double()
        assert torch.allclose(got, formula(fire, lq, lk, q_offset), atol=1e-5)


def test_per_offset_up_to_the_threshold_dense_past_it():
    fire = make_fire(init_L=8.0)
    assert fire.per_offset(9) and not fire.per_offset(10) and not fire.per_offset(1, q_offset=9)
    assert isinstance(fire.resolve(9, 9), OffsetBias)  # queries 0..8 <= L = 8: one value per offset
    dense = fire.resolve(12, 12)
    assert isinstance(dense, torch.Tensor) and dense.shape == (1, 4, 12, 12)  # rows past L: exact, dense
    assert torch.allclose(fire.resolve(1, 12, q_offset=11), dense[:, :, -1:])  # a decoding step: one row
    with pytest.raises(ValueError, match="per-offset only for query positions <= L=8"):
        fire.offsets(12, 12)
    # within the threshold the rows really are shifts of one another; past it they are not
    assert not torch.allclose(dense[0, :, 11, 1:], dense[0, :, 10, :-1], atol=1e-4)
    assert torch.allclose(dense[0, :, 8, 1:], dense[0, :, 7, :-1], atol=1e-6)


# L = 512: every row per-offset; L = 5: rows 6.. past the threshold, dense (which fused refuses, tested below)
@pytest.mark.parametrize("init_L, backend", [(512.0, "eager"), (512.0, "sdpa"), (512.0, "fused"), (5.0, "eager"), (5.0, "sdpa")])
@pytest.mark.parametrize("lq, lk, causal, q_offset, padded", CASES)
def test_every_backend_equals_the_fp64_oracle(init_L, backend, lq, lk, causal, q_offset, padded):  # noqa: N803
    past = q_offset > init_L  # a decoding row past L is normalized by psi(i): no gradient into L
    check_backend(lambda: make_fire(init_L), lambda a, b, o: formula(make_fire(init_L), a, b, o), backend, lq, lk,
                  causal, q_offset, padded, unused=("L_multiplier",) if past else ())


def test_fused_refuses_past_the_threshold():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"backend='fused' cannot run this call \(needs a per-offset bias"):
        attention(q, k, v, bias=make_fire(init_L=5.0), backend="fused")


def test_gradcheck_fp64():
    for init_L, length in ((512.0, 6), (3.0, 6)):  # per-offset, and rows past L (gradient into L through max)
        fire = make_fire(init_L).double()
        params = dict(fire.named_parameters())
        names = list(params)
        dense = lambda *values: torch.func.functional_call(fire, dict(zip(names, values)), (length, length))  # noqa: E731
        assert torch.autograd.gradcheck(dense, tuple(p.detach().clone().requires_grad_() for p in params.values()))


def test_training_within_the_threshold_is_fused():
    fire = make_fire(heads=8)  # L = 512: queries 0..511 are within it
    q, k, v = qkv(b=1, h=8, lq=512, lk=512, d=32, grad=True)
    assert select_backend(q, k, v, bias=fire, causal=True).backend == "fused"
    q, k, v = qkv(b=1, h=8, lq=600, lk=600, d=32, grad=True)
    assert "dense" in select_backend(q, k, v, bias=fire, causal=True).reason  # past L: the exact dense bias


@pytest.mark.parametrize("init_L", [512.0, 5.0])
def test_decode_equals_parallel(init_L):  # noqa: N803
    decode_matches_parallel(make_fire(init_L))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"init_L": 0.0}, ValueError, "init_L must be a finite number > 0"),
    ({"init_L": -512.0}, ValueError, "init_L must be a finite number > 0"),
    ({"init_c": float("inf")}, ValueError, "init_c must be a finite number > 0"),
    ({"mlp_width": 0}, ValueError, "mlp_width must be positive"),
    ({"eps": -1.0}, ValueError, "eps must be a finite number > 0"),
])
def test_bad_inputs(kwargs, error, match):
    with pytest.raises(error, match=match):
        FIREBias(4, **kwargs)


def test_flex_equals_eager_on_cpu_inference():
    fire = make_fire()  # L = 512: every query within the threshold, the per-offset form flex reads
    q, k, v = qkv(lq=64, lk=64)
    with torch.no_grad():
        out = attention(q, k, v, bias=fire, causal=True, key_mask=padding_mask(2, 64), backend="flex")
        expected = attention(q, k, v, bias=fire, causal=True, key_mask=padding_mask(2, 64), backend="eager")
    assert torch.allclose(out, expected, atol=1e-5)
    assert (expected - attention(q, k, v, causal=True, key_mask=padding_mask(2, 64), backend="eager")).abs().max() > 0.05
