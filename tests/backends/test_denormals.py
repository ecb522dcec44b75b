"""relpos.backends._denormals: CPU attention flushes denormal probabilities inside its own kernels (forward and
backward), restores the caller's setting, and stays equal to the fp64 oracle on inputs whose
probabilities fall into the denormal range."""

import pytest
import torch

import relpos.backends._denormals as dn
import relpos.backends._fused as fused
from relpos import OffsetBias
from relpos.backends.dispatch import attention, select_backend

from oracles import attend


def _flush_on() -> bool:
    return dn._flush_is_on()


def _alibi_case(length=600, heads=4, seed=0):
    """Causal ALiBi with steep slopes and left padding: far keys' probabilities are denormal (or 0) in fp32."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, length, 16, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = 2.0 ** -torch.arange(0, heads, dtype=torch.float64)  # 1, 1/2, 1/4, 1/8
    values = (slopes[:, None] * torch.arange(-(length - 1), length, dtype=torch.float64).clamp(max=0))  # (H, 2L-1)
    keep = torch.ones(2, length, dtype=torch.bool)
    keep[0, :50] = False
    return q, k, v, values, keep


def test_flushing_restores_the_callers_setting():
    assert not _flush_on()
    with dn.flushing(torch.ones(1)):
        assert _flush_on()
    assert not _flush_on()
    torch.set_flush_denormal(True)  # a caller who flushes keeps flushing after relpos's block
    try:
        with dn.flushing(torch.ones(1)):
            assert _flush_on()
        assert _flush_on()
    finally:
        torch.set_flush_denormal(False)
    with dn.flushing(torch.ones(1, dtype=torch.float64)):  # fp64 (the oracles' dtype) is left alone
        assert not _flush_on()


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(dn, "ENABLED", False)
    with dn.flushing(torch.ones(1)):
        assert not _flush_on()


def test_training_runs_its_backward_flushed_and_restores(monkeypatch):
    q, k, v, values, keep = _alibi_case()
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    bias = OffsetBias(values.float(), q.shape[2], k.shape[2])
    choice = select_backend(q, k, v, bias=bias, causal=True, key_mask=keep)
    assert choice.backend == "fused" and "denormals flushed" in choice.reason
    seen = []
    flash_backward = fused._flash_backward

    def spy(ctx, grad_out):
        seen.append(_flush_on())
        return flash_backward(ctx, grad_out)

    monkeypatch.setattr(fused, "_flash_backward", spy)
    attention(q, k, v, bias=bias, causal=True, key_mask=keep).sum().backward()
    assert seen == [True] and not _flush_on()


def test_denormal_probabilities_stay_equal_to_the_fp64_oracle():
    """fp32 logits span thousands of units here (slope 1 at distance 600): flushing the denormal tail
    changes nothing beyond fp32 rounding, in the output or any gradient."""
    q, k, v, values, keep = _alibi_case()
    length = q.shape[2]
    offsets = torch.arange(length)[None, :] - torch.arange(length)[:, None]  # (L, L) j - i
    dense = values[:, offsets + length - 1]  # (H, L, L) the oracle's bias, gathered from the table
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    want = attend(q64, k64, v64, dense, causal=True, keep=keep)
    want.square().sum().backward()
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    got = attention(q32, k32, v32, bias=OffsetBias(values.float(), length, length), causal=True, key_mask=keep)
    got.square().sum().backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    for ours, theirs in ((q32, q64), (k32, k64), (v32, v64)):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_backward_equals_the_blockwise_backward(dtype):
    """The no-bias-gradient training path (SDPA's flash backward per tile) equals the blockwise one."""
    q, k, v, values, keep = _alibi_case(length=300)
    outs = []
    for bias_grad in (False, True):
        qs, ks, vs = (t.to(dtype).requires_grad_() for t in (q, k, v))
        table = values.float().requires_grad_(bias_grad)  # a table needing grad forces the blockwise backward
        out = attention(qs, ks, vs, bias=OffsetBias(table, 300, 300), causal=True, key_mask=keep, backend="fused")
        out.float().square().sum().backward()
        outs.append((out, qs.grad, ks.grad, vs.grad))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("causal", [False, True])
def test_unbiased_training_is_sdpa_with_a_flushed_backward(monkeypatch, causal):
    """No bias (a forgetting gate folded into q and k): the flash kernel SDPA runs, equal in the forward
    and every gradient; the backward runs with denormals flushed."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 700, 16, generator=g) * 6 for _ in range(3))  # wide logits: a denormal tail
    results = []
    for run in ("sdpa", "relpos"):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal) if run == "sdpa" else attention(qs, ks, vs, causal=causal)
        out.square().sum().backward()
        results.append((out, qs.grad, ks.grad, vs.grad))
    for a, b in zip(*results):  # equal up to the flushed denormal tail (far below fp32 rounding)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    seen = []
    real_op = fused._flash_backward_op

    def spy(*args):
        seen.append(_flush_on())
        return real_op(*args)

    monkeypatch.setattr(fused, "_flash_backward_op", spy)
    qs = q.clone().requires_grad_()
    attention(qs, k, v, causal=causal).sum().backward()
    assert seen == [True] and not _flush_on()


def _team_states() -> list[bool]:
    """Each OpenMP thread's flush state (torch's GNU OpenMP team, 2 threads)."""
    import ctypes

    states = []

    @dn._REGION
    def probe(_data):
        states.append(_flush_on())

    dn._TEAM[0](probe, None, ctypes.c_uint(2), ctypes.c_uint(0))
    return states


def test_every_openmp_thread_flushes_inside_and_none_after(monkeypatch):
    """torch's workers keep their own flag: relpos sets it on each thread of the team and restores it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with dn.flushing(torch.ones(1)):
            assert dn._TEAM and dn._TEAM[0] is not None, "this Linux torch runs GNU OpenMP: the team must be found"
            inside = _team_states()
        after = _team_states()
    finally:
        torch.set_num_threads(threads)
    assert inside == [True, True] and after == [False, False]
