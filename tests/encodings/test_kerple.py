"""KERPLE (Chi et al. 2022): the paper's log and power kernels, on every backend, with gradients."""

import pytest
import torch

from relpos import KerpleBias, OffsetBias, attention, select_backend

from oracles import CASES, decode_matches_parallel, oracle, padding_mask, qkv

R1 = [0.5, 1.0, 2.0, 3.0]
R2 = {"log": [0.2, 1.0, 2.5, 0.05], "power": [0.5, 1.0, 1.5, 2.0]}


def formula(kind, r1, r2, lq, lk, q_offset=0):
    """fp64 (H, Lq, Lk) from the paper: -r1 log(1 + r2 |i - j|) or -r1 |i - j|^r2."""
    i = torch.arange(lq, dtype=torch.float64)[:, None] + q_offset
    j = torch.arange(lk, dtype=torch.float64)[None, :]
    dist = (i - j).abs()
    r1 = torch.tensor(r1, dtype=torch.float64)[:, None, None]
    r2 = torch.tensor(r2, dtype=torch.float64)[:, None, None]
    return -r1 * torch.log(1 + r2 * dist) if kind == "log" else -r1 * dist**r2


@pytest.mark.parametrize("kind", ["log", "power"])
def test_equals_the_papers_formula(kind):
    bias = KerpleBias(4, kind, r1=R1, r2=R2[kind])
    for lq, lk, q_offset in ((7, 7, 0), (3, 9, 6), (1, 12, 11)):
        got = bias.materialize(lq, lk, q_offset=q_offset)[0].double()
        assert torch.allclose(got, formula(kind, R1, R2[kind], lq, lk, q_offset), atol=1e-5)
    # golden numbers, head 2 at distance 3: log: -2 log(1 + 2.5 * 3) = -4.2801; power: -2 * 3^1.5 = -10.3923
    assert bias.materialize(4, 4)[0, 2, 3, 0].item() == pytest.approx(-4.280132 if kind == "log" else -10.392305, rel=1e-6)


@pytest.mark.parametrize("kind", ["log", "power"])
def test_parameters_out_of_range_are_clamped_where_the_bias_is_computed(kind):
    # training can push r1, r2 negative (or r2 of power past 2): the bias uses them clamped as the authors' code does
    bias = KerpleBias(2, kind, r1=[1.0, 1.0], r2=[1.0, 1.0])
    with torch.no_grad():
        bias.r1.copy_(torch.tensor([-3.0, 0.001]))
        bias.r2.copy_(torch.tensor([-1.0, 5.0]))
    r2 = [1e-2, 5.0] if kind == "log" else [1e-2, 2.0]
    got = bias.materialize(6, 6)[0].double()
    assert torch.allclose(got, formula(kind, [1e-2, 1e-2], r2, 6, 6), atol=1e-6)
    assert (got <= 0).all()  # distance is never rewarded


@pytest.mark.parametrize("kind", ["log", "power"])
def test_per_offset_form(kind):
    offsets = KerpleBias(4, kind).offsets(16, 16)
    assert isinstance(offsets, OffsetBias) and offsets.values.shape == (4, 31)  # O(L), never (H, L, L)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
@pytest.mark.parametrize("kind", ["log", "power"])
@pytest.mark.parametrize("lq, lk, causal, q_offset, padded", CASES)
def test_every_backend_equals_the_fp64_oracle(backend, kind, lq, lk, causal, q_offset, padded):
    bias = KerpleBias(4, kind, r1=R1, r2=R2[kind])
    q, k, v = qkv(lq=lq, lk=lk, grad=True)
    key_mask = padding_mask(2, lk) if padded else None
    out = attention(q, k, v, bias=bias, causal=causal, q_offset=q_offset, key_mask=key_mask, backend=backend)
    expected = oracle(q, k, v, formula(kind, R1, R2[kind], lq, lk, q_offset), causal=causal, q_offset=q_offset, key_mask=key_mask)
    assert torch.allclose(out.double(), expected, atol=2e-5)
    without = oracle(q, k, v, causal=causal, q_offset=q_offset, key_mask=key_mask)
    assert (without - expected).abs().max() > 0.05  # the position term matters far beyond the tolerance
    # gradients into q, k, v and both parameters equal the eager path's
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, bias.r1, bias.r2)]
    ref_bias = KerpleBias(4, kind, r1=R1, r2=R2[kind])
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    attention(q2, k2, v2, bias=ref_bias, causal=causal, q_offset=q_offset, key_mask=key_mask, backend="eager").square().sum().backward()
    for got, want in zip(grads, [q2.grad, k2.grad, v2.grad, ref_bias.r1.grad, ref_bias.r2.grad]):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert bias.r1.grad.abs().min() > 0 and bias.r2.grad.abs().min() > 0


def test_flex_equals_eager_on_cpu_inference():
    bias = KerpleBias(4, "log", r1=R1, r2=R2["log"])
    q, k, v = qkv(lq=64, lk=64)
    with torch.no_grad():
        out = attention(q, k, v, bias=bias, causal=True, backend="flex")
        assert torch.allclose(out, attention(q, k, v, bias=bias, causal=True, backend="eager"), atol=1e-5)


@pytest.mark.parametrize("kind", ["log", "power"])
def test_gradcheck_fp64(kind):
    bias = KerpleBias(3, kind, r1=[0.5, 1.0, 2.0], r2=[0.3, 1.0, 1.7], dtype=torch.float64)
    r1, r2 = (p.detach().clone().requires_grad_() for p in (bias.r1, bias.r2))
    dense = lambda a, b: torch.func.functional_call(bias, {"r1": a, "r2": b}, (5, 7), {"q_offset": 2})  # noqa: E731
    assert torch.autograd.gradcheck(dense, (r1, r2))


def test_fused_trains_without_dense_bias():
    """Training picks the fused CPU path: the bias stays per-offset, its gradient is computed blockwise."""
    bias = KerpleBias(8, "log")
    q, k, v = qkv(b=1, h=8, lq=512, lk=512, d=32, grad=True)
    assert select_backend(q, k, v, bias=bias, causal=True).backend == "fused"


@pytest.mark.parametrize("kind", ["log", "power"])
def test_decode_equals_parallel(kind):
    full = decode_matches_parallel(KerpleBias(4, kind, r1=R1, r2=R2[kind]))
    assert full.abs().max() > 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"r1": 0.0}, ValueError, "r1 must be finite and > 0"),
        ({"r2": -1.0}, ValueError, "r2 must be finite and > 0"),
        ({"r1": [1.0, 2.0]}, ValueError, "r1 must have num_heads=4 entries"),
        ({"kind": "power", "r2": 2.5}, ValueError, r"r2 must be finite and > 0 and <= 2.0"),
        ({"kind": "cubic"}, ValueError, "kind must be one of 'log', 'power'"),
        ({"r1": "1"}, TypeError, "r1 must be a number or a sequence"),
        ({"r1": float("nan")}, ValueError, "r1 must be finite"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    with pytest.raises(error, match=match):
        KerpleBias(4, **kwargs)
