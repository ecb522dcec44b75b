"""The fast backends equal the eager reference: outputs and gradients into q, k, v and the bias table."""

import copy

import pytest
import torch

from relpos import ALiBi, ClippedRelativeBias, LogDecayBias, RelativePositionalBias, attention, select_backend
from relpos.backends._fused import antidiagonal_sums

from oracles import assert_bias_matters, bias_oracle
from test_attention import CASES, oracle, qkv


def make_bias(name, heads=4, causal=False):
    torch.manual_seed(1)
    bias = {
        "t5": lambda: RelativePositionalBias(heads, num_buckets=8, max_distance=10, bidirectional=not causal),
        "clipped": lambda: ClippedRelativeBias(heads, 3),
        "alibi": lambda: ALiBi(heads, mode="causal" if causal else "symmetric"),
        "log_decay": lambda: LogDecayBias(0.5),  # one bias shared by all heads
        "t5_shared": lambda: RelativePositionalBias(1, num_buckets=8, max_distance=10, bidirectional=not causal),  # learned, one head for all
    }[name]()
    for p in bias.parameters():
        torch.nn.init.normal_(p)
    return bias


def run(backend, bias_name, lq, lk, causal, q_offset, dtype=torch.float32):
    bias = make_bias(bias_name, causal=causal)
    q, k, v = qkv(lq=lq, lk=lk, dtype=dtype, grad=True)
    out = attention(q, k, v, bias=bias, causal=causal, q_offset=q_offset, backend=backend)
    weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad] + [p.grad for p in bias.parameters()]


@pytest.mark.parametrize("backend", ["fused", "sdpa"])
@pytest.mark.parametrize("bias_name", ["t5", "clipped", "alibi", "log_decay", "t5_shared"])
@pytest.mark.parametrize("lq, lk, causal, q_offset", CASES)
def test_backend_equals_eager_with_gradients(backend, bias_name, lq, lk, causal, q_offset):
    out_e, grads_e = run("eager", bias_name, lq, lk, causal, q_offset)
    out_f, grads_f = run(backend, bias_name, lq, lk, causal, q_offset)
    assert torch.allclose(out_f, out_e, atol=1e-5)
    q, k, v = qkv(lq=lq, lk=lk)
    bias = make_bias(bias_name, causal=causal)
    expected = oracle(q, k, v, bias_oracle(bias, lq, lk, q_offset), causal=causal, q_offset=q_offset)
    assert torch.allclose(out_f.double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(q, k, v, causal=causal, q_offset=q_offset), 1e-5)
    assert len(grads_f) == len(grads_e)
    for gf, ge in zip(grads_f, grads_e):
        assert torch.isfinite(gf).all()
        assert torch.allclose(gf, ge, atol=1e-4, rtol=1e-4)


def test_fused_fp64_exact_and_long():
    torch.manual_seed(0)
    bias = RelativePositionalBias(2, bidirectional=False)
    bias.double()
    q, k, v = qkv(b=1, h=2, lq=300, lk=300, d=16, dtype=torch.float64, grad=True)
    grads = {}
    for backend in ("eager", "fused"):
        for t in (q, k, v, bias.relative_attention_bias.weight):
            t.grad = None
        out = attention(q, k, v, bias=bias, causal=True, backend=backend)
        out.square().sum().backward()
        grads[backend] = [t.grad.clone() for t in (q, k, v, bias.relative_attention_bias.weight)]
    for a, b in zip(*grads.values()):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_low_precision_error_ratio(dtype):
    torch.manual_seed(0)
    bias = RelativePositionalBias(4, init_std=1.5)
    q, k, v = qkv(lq=64, lk=64, d=32)
    expected = oracle(q, k, v, bias_oracle(bias, 64, 64))
    lo = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    eager_err = (attention(*lo, bias=bias, backend="eager").double() - expected).abs().max()
    fused = attention(*lo, bias=bias, backend="fused")
    assert fused.dtype == dtype and torch.isfinite(fused).all()
    tol = 3 * eager_err + 1e-3
    assert (fused.double() - expected).abs().max() <= tol
    assert_bias_matters(expected, oracle(q, k, v), tol)
    fused.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in lo)
    assert torch.isfinite(bias.relative_attention_bias.weight.grad).all()


def test_antidiagonal_sums_equals_loop():
    a = torch.randn(3, 5, 7)
    got = antidiagonal_sums(a)
    for t in range(5 + 7 - 1):
        expected = sum(a[:, r, t - r] for r in range(5) if 0 <= t - r < 7)
        assert torch.allclose(got[:, t], expected, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
def test_grouped_query_attention(backend):
    torch.manual_seed(0)
    bias = RelativePositionalBias(8, init_std=1.5)
    q = torch.randn(2, 8, 10, 16, requires_grad=True)
    k = torch.randn(2, 2, 10, 16, requires_grad=True)
    v = torch.randn(2, 2, 10, 16, requires_grad=True)
    out = attention(q, k, v, bias=bias, causal=True, backend=backend)
    k4, v4 = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    expected = oracle(q, k4, v4, bias_oracle(bias, 10, 10), causal=True)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(q, k4, v4, causal=True), 1e-5)
    out.sum().backward()
    assert k.grad.shape == k.shape and torch.isfinite(k.grad).all()
    with pytest.raises(ValueError, match="must divide query heads"):
        attention(q, torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 16))


def test_auto_choices_and_reasons():
    bias = RelativePositionalBias(4)
    big = qkv(lq=512, lk=512)  # 2 * 4 * 512 * 512 = 2**21 scores: the fused path pays off
    learn = select_backend(*big, bias=bias.offsets(512, 512))
    assert learn.backend == "fused" and "math kernel" in learn.rejected["sdpa"]
    q, k, v = qkv(lq=16, lk=16)
    small = select_backend(q, k, v, bias=bias.offsets(16, 16))
    assert small.backend == "sdpa" and "faster at this size" in small.rejected["fused"]
    with torch.no_grad():
        frozen = select_backend(q, k, v, bias=bias.offsets(16, 16))
    assert frozen.backend == "sdpa" and "no gradient" in frozen.rejected["fused"]
    assert "eager" in str(frozen) and "reference" in frozen.rejected["eager"]
    dense = select_backend(q, k, v, bias=bias(16, 16))
    assert dense.backend == "sdpa" and "per-offset" in dense.rejected["fused"]
    masked = select_backend(q, k, v, bias=bias.offsets(16, 16), attn_mask=torch.ones(16, 16, dtype=torch.bool))
    assert masked.backend == "sdpa"
    qg = q.clone().requires_grad_()
    assert "no backward on CPU" in select_backend(qg, k, v, bias=bias.offsets(16, 16)).rejected["flex"]


def test_auto_trains_through_fused_without_dense_memory(monkeypatch):
    calls = []
    from relpos.backends import dispatch as attention_module

    real = attention_module.fused_attention
    monkeypatch.setattr(attention_module, "fused_attention", lambda *a: calls.append(1) or real(*a))
    bias = RelativePositionalBias(4, init_std=1.0)
    q, k, v = qkv(lq=512, lk=512, grad=True)
    weights = torch.randn(2, 4, 512, 8)
    (attention(q, k, v, bias=bias) * weights).sum().backward()
    assert calls
    got = [t.grad.clone() for t in (q, k, v, bias.relative_attention_bias.weight)]
    for t in (q, k, v, bias.relative_attention_bias.weight):
        t.grad = None
    (attention(q, k, v, bias=bias, backend="eager") * weights).sum().backward()
    for g, t in zip(got, (q, k, v, bias.relative_attention_bias.weight)):
        assert torch.allclose(g, t.grad, atol=1e-4, rtol=1e-4)


def test_forced_backends_refuse_what_they_cannot_do():
    bias = RelativePositionalBias(4)
    q, k, v = qkv(lq=8, lk=8)
    with pytest.raises(ValueError, match=r"backend='fused' cannot run this call \(needs a per-offset bias.*use backend='auto'"):
        attention(q, k, v, bias=bias(8, 8), backend="fused")
    with pytest.raises(ValueError, match=r"backend='flex' cannot run this call \(flex reads a per-offset bias"):
        attention(q, k, v, bias=bias, attn_mask=torch.ones(8, 8, dtype=torch.bool), backend="flex")
    with pytest.raises(ValueError, match="no backward on CPU"):
        attention(q.requires_grad_(), k, v, bias=bias, backend="flex")
    with pytest.raises(TypeError, match="one floating dtype"):  # refused at the boundary, for every backend
        attention(q.detach().long(), k.long(), v.long(), bias=bias, backend="fused", scale=1.0)


def test_flex_equals_eager_on_cpu_inference():
    # compiled FlexAttention: a few seconds per new shape, so one bidirectional and one decoding case
    torch.manual_seed(0)
    bias = make_bias("t5", causal=True)
    q, k, v = qkv(lq=64, lk=64, d=16)
    with torch.no_grad():
        for causal, lq, q_offset in ((True, 64, 0), (True, 1, 63)):
            qq = q[:, :, -lq:]
            out = attention(qq, k, v, bias=bias, causal=causal, q_offset=q_offset, backend="flex")
            ref = attention(qq, k, v, bias=bias, causal=causal, q_offset=q_offset, backend="eager")
            assert torch.allclose(out, ref, atol=1e-5)
        shared = LogDecayBias(0.3)  # a single-head bias broadcast over heads
        assert torch.allclose(
            attention(q, k, v, bias=shared, backend="flex"), attention(q, k, v, bias=shared, backend="eager"), atol=1e-5
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flex trains only on GPU)")
def test_flex_trains_on_gpu():
    torch.manual_seed(0)
    made = RelativePositionalBias(4, bidirectional=False).cuda()
    inputs = [torch.randn(2, 4, 128, 32, device="cuda") for _ in range(3)]  # the same for both backends
    grads = {}
    for backend in ("eager", "flex"):
        bias = copy.deepcopy(made)
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        attention(q, k, v, bias=bias, causal=True, backend=backend).square().sum().backward()
        grads[backend] = [q.grad, k.grad, v.grad, bias.relative_attention_bias.weight.grad]
    for a, b in zip(*grads.values()):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)


def test_small_problems_take_one_sdpa_call():
    """Below 2**21 scores, dropout and padding take SDPA in one call (tiles and blocks would cost more calls)."""
    bias = RelativePositionalBias(4)
    q, k, v = qkv(lq=16, lk=16)
    choice = select_backend(q, k, v, bias=bias, dropout_p=0.1)
    assert choice.backend == "sdpa" and "fewer than" in choice.rejected["fused"]
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[1, 9:] = False
    out = attention(q, k, v, bias=bias, key_mask=keep)
    assert torch.allclose(out, attention(q, k, v, bias=bias, key_mask=keep, backend="eager"), atol=1e-5)


@pytest.mark.parametrize("causal,ranges,lq,lk,q_offset", [
    (True, None, 300, 300, 0),
    (False, ((0, 40, 7), (300, 211, 129)), 300, 300, 0),  # right padding, left+right, ends inside blocks
    (True, ((0, 128, 5), (256, 300, 300)), 300, 300, 0),
    (True, ((0, 3), (260, 200)), 44, 260, 216),  # the last rows of a longer sequence (decoding a chunk)
])
def test_flex_block_mask_equals_torchs(causal, ranges, lq, lk, q_offset):
    """relpos builds flex's block mask from block bounds; torch's create_block_mask evaluates every score."""
    from torch.nn.attention.flex_attention import create_block_mask

    from relpos.backends._flex import _block_mask

    batch = 1 if ranges is None else len(ranges[0])
    ours = _block_mask(batch, lq, lk, causal=causal, q_offset=q_offset, key_ranges=ranges, device="cpu")
    starts = torch.tensor(ranges[0] if ranges else [0])
    ends = torch.tensor(ranges[1] if ranges else [lk])

    def keep(b, h, q_idx, kv_idx):
        visible = kv_idx <= q_idx + q_offset if causal else kv_idx >= 0
        return visible & (kv_idx >= starts[b]) & (kv_idx < ends[b])

    theirs = create_block_mask(keep, batch, None, lq, lk, device="cpu")
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # (B, 1, nQ, nK) blocks that see some key
    full = lambda m: torch.zeros_like(m.to_dense()).scatter_(  # noqa: E731
        -1, m.full_kv_indices.long(), 1) * (torch.arange(m.full_kv_indices.shape[-1]) < m.full_kv_num_blocks[..., None])
    assert torch.equal(full(ours) > 0, full(theirs) > 0)  # and those that see every key (no per-score mask)
    bias = ALiBi(4, mode="causal") if causal else ALiBi(4, mode="symmetric")
    q, k, v = (torch.randn(batch, 4, n, 16) for n in (lq, lk, lk))
    key_mask = (torch.arange(lk) >= starts[:, None]) & (torch.arange(lk) < ends[:, None])  # (B, Lk)
    kw = dict(bias=bias, causal=causal, q_offset=q_offset, key_mask=None if ranges is None else key_mask)
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, backend="flex", **kw), attention(q, k, v, backend="eager", **kw),
                                   atol=2e-5, rtol=1e-5)
