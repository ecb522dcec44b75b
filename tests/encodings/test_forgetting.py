"""Forgetting gates (FoX, Lin et al. 2025; data-dependent ALiBi): c_i - c_j folded into the dot product."""

import pytest
import torch

import relpos.encodings.forgetting
from relpos import ForgettingGate, gated_attention

from oracles import decode_matches_parallel, oracle, padding_layout, padding_mask, qkv

CASES = [(12, 12, True, 0, False), (12, 12, True, 0, True), (1, 12, True, 11, False), (4, 12, True, 8, True)]


def gates(b=2, h=4, length=12, seed=3):
    """log f (B, H, L): strong gates on some heads, weak on others."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, h, length, generator=g) + torch.tensor([-1.0, 0.0, 1.0, 3.0])[:h, None]
    return torch.nn.functional.logsigmoid(logits)


def fox_bias(log_f, lq, q_offset):
    """fp64 (B, H, Lq, Lk): sum_{l=j+1}^{i} log f_l, summed term by term (0 for j >= i)."""
    log_f = log_f.double()
    lk = log_f.shape[-1]
    bias = torch.zeros(*log_f.shape[:2], lq, lk, dtype=torch.float64)
    for r in range(lq):
        i = q_offset + r
        for j in range(min(i, lk)):
            bias[..., r, j] = log_f[..., j + 1 : i + 1].sum(-1)
    return bias


@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
@pytest.mark.parametrize("lq, lk, causal, q_offset, padded", CASES)
def test_every_backend_equals_the_fp64_oracle(backend, lq, lk, causal, q_offset, padded):
    q, k, v = qkv(lq=lq, lk=lk, grad=True)
    log_f = gates(length=lk).requires_grad_()
    key_mask = padding_mask(2, lk) if padded else None
    kw = dict(causal=causal, q_offset=q_offset, key_mask=key_mask)
    out = gated_attention(q, k, v, log_f.cumsum(-1), backend=backend, **kw)
    expected = oracle(q, k, v, fox_bias(log_f.detach(), lq, q_offset), **kw)
    assert torch.allclose(out.double(), expected, atol=2e-5)
    assert (oracle(q, k, v, **kw) - expected).abs().max() > 0.1  # the gates matter
    out.square().sum().backward()
    q2, k2, v2, f2 = (t.detach().requires_grad_() for t in (q, k, v, log_f))
    gated_attention(q2, k2, v2, f2.cumsum(-1), backend="eager", **kw).square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad, log_f.grad), (q2.grad, k2.grad, v2.grad, f2.grad)):
        assert torch.allclose(got, want, atol=1e-4)
    assert log_f.grad.abs().max() > 0


def test_flex_equals_eager_on_cpu_inference():
    q, k, v = qkv(lq=64, lk=64)
    c = gates(length=64).cumsum(-1)
    with torch.no_grad():
        for lq, q_offset in ((64, 0), (1, 63)):  # a prompt and a decoding row
            qq = q[:, :, -lq:]
            out = gated_attention(qq, k, v, c, q_offset=q_offset, backend="flex")
            assert torch.allclose(out, gated_attention(qq, k, v, c, q_offset=q_offset, backend="eager"), atol=1e-5)


def test_gradcheck_fp64():
    q, k, v = (t.double().requires_grad_() for t in qkv(b=1, h=2, lq=5, lk=5, d=4))
    c = gates(b=1, h=2, length=5).double().cumsum(-1).requires_grad_()
    for backend in ("eager", "sdpa"):
        fn = lambda *t: gated_attention(*t, backend=backend)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v, c))


def test_one_sdpa_call_no_square_tensor(monkeypatch):
    """The fold hands relpos.attention q', k', v' with no bias and no dense mask: key padding stays key_mask."""
    seen = {}
    real = relpos.encodings.forgetting.attention

    def spy(q, k, v, **kw):
        seen.update(kw, shapes=(q.shape, k.shape, v.shape))
        return real(q, k, v, **kw)

    monkeypatch.setattr(relpos.encodings.forgetting, "attention", spy)
    q, k, v = qkv(lq=12, lk=12, d=16)
    gated_attention(q, k, v, gates().cumsum(-1), key_mask=padding_mask(2, 12))
    assert "bias" not in seen and seen["attn_mask"] is None and seen["key_mask"] is not None
    assert seen["shapes"] == ((2, 4, 12, 24),) * 3  # d + 1 = 17 rounded up to 24; v padded alike (CPU flash kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_is_one_flash_call_with_a_per_key_mask(monkeypatch, dtype):
    """Causal self-attention without grad: no fold (width d), -c_j as a row-stride-0 view; equals the oracle."""
    calls = []
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def spy(q, k, v, *args, attn_mask=None, **kw):
        calls.append((q.shape, attn_mask.stride(), args))
        return real(q, k, v, *args, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(relpos.encodings.forgetting.torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", spy)
    monkeypatch.setattr(relpos.encodings.forgetting, "attention", None)  # the fold's path must not run
    q, k, v = qkv(lq=40, lk=40)
    log_f = gates(length=40)
    with torch.no_grad():
        out = gated_attention(q.to(dtype), k.to(dtype), v.to(dtype), log_f.cumsum(-1))
    expected = oracle(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), fox_bias(log_f, 40, 0), causal=True)
    assert out.dtype == dtype
    assert torch.allclose(out.double(), expected, atol=2e-5 if dtype == torch.float32 else 2e-2)
    assert (oracle(q, k, v, causal=True) - expected).abs().max() > 0.1  # the gates matter
    (shape, stride, args), = calls
    assert shape == (2, 4, 40, 16) and stride[2] == 0 and args == (0.0, True)  # width d, no (B, H, L, L), is_causal


def test_inference_edges_take_the_fold():
    """No tokens, or values narrower than the keys (the flash kernel takes one width): the fold, still exact."""
    q, k, v = qkv(lq=10, lk=10)
    log_f = gates(length=10)
    with torch.no_grad():
        narrow = gated_attention(q, k, v[..., :5], log_f.cumsum(-1))
        empty = gated_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], log_f[..., :0])
    assert torch.allclose(narrow.double(), oracle(q, k, v[..., :5], fox_bias(log_f, 10, 0), causal=True), atol=2e-5)
    assert empty.shape == (2, 4, 0, 16)


def test_grouped_kv_heads_and_bf16():
    q, k, v = qkv(lq=12, lk=12)
    c = gates().cumsum(-1)
    k2, v2 = k[:, ::2], v[:, ::2]  # 2 key/value heads for 4 query heads
    out = gated_attention(q, k2, v2, c)
    expected = gated_attention(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), c)
    assert torch.allclose(out, expected, atol=1e-6)
    half = gated_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), c)  # the gate column is kept in fp32
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.float(), gated_attention(q, k, v, c), atol=3e-2)


def test_gate_module_is_fox_formula():
    torch.manual_seed(0)
    gate = ForgettingGate(8, 4)
    x = torch.randn(2, 6, 8)
    expected = torch.log(torch.sigmoid(x.double() @ gate.fgate_proj.weight.double().T + gate.fgate_proj.bias.double()))
    assert torch.allclose(gate.log_forget(x).double(), expected.transpose(1, 2), atol=1e-6)
    c = gate.cumulative(x)
    assert torch.allclose(gate.cumulative(x[:, 3:], start=c[..., 2]), c[..., 3:], atol=1e-6)  # a cache's running sum


def test_decode_equals_parallel_with_gates_in_the_cache():
    torch.manual_seed(0)
    gate = ForgettingGate(32, 4)
    with torch.no_grad():
        gate.fgate_proj.bias.fill_(1.0)
    full = decode_matches_parallel(gate)
    without = decode_matches_parallel(None)
    assert (full - without).abs().max() > 0.01


def test_trains_through_a_layer():
    from relpos import MultiheadAttention

    layer = MultiheadAttention(32, 4, position=ForgettingGate(32, 4), causal=True)
    x = torch.randn(2, 20, 32)
    layer(x, key_mask=padding_mask(2, 20))[0].square().sum().backward()
    assert layer.position.fgate_proj.weight.grad.abs().max() > 0 and layer.position.fgate_proj.bias.grad.abs().max() > 0


def test_bad_inputs():
    q, k, v = qkv(lq=12, lk=12)
    with pytest.raises(ValueError, match=r"key_gate must have shape \(B, H, Lk\) = \(2, 4, 12\), got \(2, 4, 11\)"):
        gated_attention(q, k, v, torch.zeros(2, 4, 11))
    with pytest.raises(TypeError, match="key_gate must be a floating tensor"):
        gated_attention(q, k, v, torch.zeros(2, 4, 12, dtype=torch.long))
    with pytest.raises(TypeError, match="key_gate must be a torch.Tensor"):
        gated_attention(q, k, v, [0.0] * 12)
    with pytest.raises(ValueError, match="causal=False lets queries see them"):
        gated_attention(q, k, v, torch.zeros(2, 4, 12), causal=False)
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, dim\)"):
        ForgettingGate(8, 4).log_forget(torch.zeros(2, 5, 7))
    with pytest.raises(ValueError, match=r"start must have shape \(B, H\)"):
        ForgettingGate(8, 4).cumulative(torch.zeros(2, 5, 8), start=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="ForgettingGate\\) has dim=8"):
        from relpos import MultiheadAttention
        MultiheadAttention(16, 4, position=ForgettingGate(8, 4))


# --- differential fuzzing (tests/fuzz_profiles.py): shapes, offsets, padding and backends against the fp64 formula ---
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_profiles import examples  # noqa: E402


@examples(30, 500)
@given(batch=st.integers(1, 3), lq=st.sampled_from([1, 2, 5, 17, 33]), lk=st.sampled_from([1, 2, 5, 17, 33, 64, 65]),
       padded=st.sampled_from(["none", "right", "left", "all_padding"]), backend=st.sampled_from(["auto", "eager", "sdpa", "fused"]),
       seed=st.integers(0, 999))
def test_fuzz_gated_attention_equals_the_formula(batch, lq, lk, padded, backend, seed):
    """Queries at the end of the keys (q_offset = Lk - Lq), batch 1-3, padding layouts, every backend: equal to the
    fp64 oracle with the forget-gate bias summed term by term."""
    assume(lq <= lk)
    q_offset = lk - lq
    q, k, v = qkv(b=batch, lq=lq, lk=lk, seed=seed)
    log_f = gates(b=batch, length=lk, seed=seed)
    key_mask = padding_layout(padded, batch, lk)
    kw = dict(causal=True, q_offset=q_offset, key_mask=key_mask)
    out = gated_attention(q, k, v, log_f.cumsum(-1), backend=backend, **kw)
    torch.testing.assert_close(out.double(), oracle(q, k, v, fox_bias(log_f, lq, q_offset), **kw), atol=2e-5, rtol=1e-5)
