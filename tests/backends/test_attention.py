"""attention(): every backend equals the eager reference and an fp64 oracle; masks; decoding."""

import math

import pytest
import torch

from relpos import OffsetBias, RelativePositionalBias, RelativePositionBias, attention, relative_positions

from operators import dispatched
from oracles import assert_bias_matters, bias_oracle


def oracle(q, k, v, bias_dense=None, causal=False, mask=None, scale=None, q_offset=0):
    """Naive fp64 attention, one loop-free line per step."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if bias_dense is not None:
        s = s + bias_dense.double()
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = relative_positions(q.shape[2], k.shape[2], q_offset=q_offset) <= 0
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def qkv(b=2, h=4, lq=9, lk=13, d=8, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(lq * 100 + lk)
    make = lambda L: torch.randn(b, h, L, d, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return make(lq), make(lk), make(lk)


CASES = [  # (lq, lk, causal, q_offset)
    (9, 9, False, 0),
    (9, 9, True, 0),
    (5, 13, False, 0),
    (5, 13, True, 8),
    (1, 13, True, 12),
    (13, 5, False, 0),
]


@pytest.mark.parametrize("backend", ["eager", "sdpa", "auto"])
@pytest.mark.parametrize("lq, lk, causal, q_offset", CASES)
def test_backends_equal_oracle(backend, lq, lk, causal, q_offset):
    torch.manual_seed(0)
    bias = RelativePositionalBias(4, num_buckets=8, max_distance=10, bidirectional=not causal)
    torch.nn.init.normal_(bias.relative_attention_bias.weight, std=1.5)
    q, k, v = qkv(lq=lq, lk=lk)
    out = attention(q, k, v, bias=bias, causal=causal, q_offset=q_offset, backend=backend)
    expected = oracle(q, k, v, bias_oracle(bias, lq, lk, q_offset), causal=causal, q_offset=q_offset)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(q, k, v, causal=causal, q_offset=q_offset), 1e-5)


@pytest.mark.parametrize("lq, lk, causal, q_offset", CASES)
def test_sdpa_gradients_equal_eager(lq, lk, causal, q_offset):
    grads = {}
    for backend in ("eager", "sdpa"):
        torch.manual_seed(0)
        bias = RelativePositionalBias(4, num_buckets=8, max_distance=10, bidirectional=not causal)
        q, k, v = qkv(lq=lq, lk=lk, grad=True)
        out = attention(q, k, v, bias=bias, causal=causal, q_offset=q_offset, backend=backend)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[backend] = [q.grad, k.grad, v.grad, bias.relative_attention_bias.weight.grad]
    for a, b in zip(*grads.values()):
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_ratio(dtype):
    # Like PyTorch's own attention tests: the low-precision error against an fp64 oracle must be
    # within a small factor of the error of a plain low-precision eager computation.
    torch.manual_seed(0)
    bias = RelativePositionalBias(4, init_std=1.5)
    q, k, v = qkv(lq=64, lk=64, d=32)
    expected = oracle(q, k, v, bias_oracle(bias, 64, 64))
    ql, kl, vl = q.to(dtype), k.to(dtype), v.to(dtype)
    eager_err = (attention(ql, kl, vl, bias=bias, backend="eager").double() - expected).abs().max()
    sdpa_out = attention(ql, kl, vl, bias=bias, backend="sdpa")
    assert sdpa_out.dtype == dtype and torch.isfinite(sdpa_out).all()
    tol = 3 * eager_err + 1e-3
    assert (sdpa_out.double() - expected).abs().max() <= tol
    assert_bias_matters(expected, oracle(q, k, v), tol)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_bias_forms_are_interchangeable(backend):
    bias = RelativePositionalBias(4, init_std=1.5)
    q, k, v = qkv(lq=7, lk=11)
    via_module = attention(q, k, v, bias=bias, backend=backend)
    via_offsets = attention(q, k, v, bias=bias.offsets(7, 11), backend=backend)
    via_dense = attention(q, k, v, bias=bias(7, 11), backend=backend)
    assert torch.allclose(via_module, via_offsets, atol=1e-6)
    assert torch.allclose(via_module, via_dense, atol=1e-6)
    assert torch.allclose(via_module.double(), oracle(q, k, v, bias_oracle(bias, 7, 11)), atol=1e-5)
    assert_bias_matters(via_module, attention(q, k, v, backend=backend), 1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_masks_and_fully_masked_rows(backend):
    bias = RelativePositionalBias(4, init_std=1.5)
    q, k, v = qkv(lq=6, lk=10, grad=True)
    keep = torch.rand(6, 10, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[2] = False  # a query that may attend to nothing
    out = attention(q, k, v, bias=bias, attn_mask=keep, backend=backend)
    expected = oracle(q, k, v, bias_oracle(bias, 6, 10), mask=keep)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(q, k, v, mask=keep), 1e-5)
    assert torch.all(out[:, :, 2] == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    additive = torch.zeros(6, 10).masked_fill(~keep, float("-inf"))
    assert torch.allclose(attention(q, k, v, bias=bias, attn_mask=additive, backend=backend), out, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_window_bias_and_no_bias(backend):
    rpb = RelativePositionBias(4, window_size=(3, 3), init_std=1.5)
    q, k, v = qkv(lq=9, lk=9)
    expected = oracle(q, k, v, bias_oracle(rpb, 9, 9))
    assert torch.allclose(attention(q, k, v, bias=rpb, backend=backend).double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(q, k, v), 1e-5)
    assert torch.allclose(attention(q, k, v, backend=backend).double(), oracle(q, k, v), atol=1e-5)
    assert torch.allclose(
        attention(q, k, v, causal=True, scale=1.0, backend=backend).double(), oracle(q, k, v, causal=True, scale=1.0), atol=1e-5
    )


def test_decode_rows_equal_parallel():
    torch.manual_seed(0)
    bias = RelativePositionalBias(4, bidirectional=False, init_std=1.5)
    q, k, v = qkv(lq=12, lk=12)
    full = attention(q, k, v, bias=bias, causal=True)
    assert torch.allclose(full.double(), oracle(q, k, v, bias_oracle(bias, 12, 12), causal=True), atol=1e-5)
    for t in range(12):  # query t sees keys 0..t: the KV cache at step t
        step = attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], bias=bias, causal=True, q_offset=t)
        assert torch.allclose(step, full[:, :, t : t + 1], atol=1e-6)


def _dispatched(fn):
    """The torch operators ``fn()`` dispatches without gradients, counted by name (tests/operators.py)."""
    with torch.no_grad():
        return dispatched(fn)


def test_a_decoding_row_is_one_sdpa_call_on_a_view(monkeypatch):
    """One query over a cache (Lq = 1, q_offset = Lk - 1): no key lies in its future, so ``causal`` hides nothing and
    is dropped; the per-offset values reach SDPA as a view, with no flip of the query or the output and, under the
    GPU's rule (the mask in the query's dtype), no dtype conversion of bf16 values. Equal to the causal oracle."""
    from relpos.backends import dispatch

    torch.manual_seed(0)
    bias = RelativePositionalBias(4, bidirectional=False, init_std=1.5).to(torch.bfloat16).requires_grad_(False)
    q, k, v = qkv(lq=1, lk=20, dtype=torch.bfloat16)
    offsets = bias.offsets(1, 20, q_offset=19)
    assert dispatch._prepare(q, k, v, offsets, True, None, None, 0.0, None, 19).causal is False
    earlier = bias.offsets(1, 20, q_offset=18)
    assert dispatch._prepare(q, k, v, earlier, True, None, None, 0.0, None, 18).causal is True  # key 19 is later
    out = attention(q, k, v, bias=offsets, causal=True, q_offset=19)
    expected = oracle(q, k, v, bias_oracle(bias, 1, 20, q_offset=19), causal=True, q_offset=19)
    assert (out.double() - expected).abs().max() < 2e-2  # bf16 output
    ops = _dispatched(lambda: attention(q, k, v, bias=offsets, causal=True, q_offset=19))
    assert "flip" not in ops and sum(n for op, n in ops.items() if "scaled_dot_product" in op) == 1, ops
    monkeypatch.setattr(dispatch, "_sdpa_mask_dtype", lambda query: query.dtype)  # CUDA's rule
    ops = _dispatched(lambda: attention(q, k, v, bias=offsets, causal=True, q_offset=19))
    assert "_to_copy" not in ops, ops  # was bf16 -> fp32 -> bf16: two launches per layer on a GPU
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1, :6] = False  # a left-padded example: the bias and the padding in one mask, built in the query's dtype
    ops = _dispatched(lambda: attention(q, k, v, bias=offsets, causal=True, q_offset=19, key_mask=keep))
    assert "_to_copy" not in ops, ops
    padded = attention(q, k, v, bias=offsets, causal=True, q_offset=19, key_mask=keep)
    expected = oracle(q, k, v, bias_oracle(bias, 1, 20, q_offset=19), causal=True, q_offset=19, mask=keep[:, None, None, :])
    assert (padded.double() - expected).abs().max() < 2e-2


def test_layers_asking_for_the_same_mask_build_it_once():
    """A padded decoding row in every layer of a step: the same bias values and the same padding mask (a view of one
    storage). The second layer builds no mask (only SDPA, and zeroing the rows with no key); a mask changed in place,
    another bias, or values that train are built again; every output equals the oracle."""
    torch.manual_seed(0)
    bias = RelativePositionalBias(4, bidirectional=False, init_std=1.5).requires_grad_(False)
    q, k, v = qkv(lq=1, lk=20)
    offsets = bias.offsets(1, 20, q_offset=19)
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1] = False  # an example with no key: its output is zero

    def layer(mask=keep, values=offsets):
        return attention(q, k, v, bias=values, causal=True, q_offset=19, key_mask=mask)

    def want(mask):
        return oracle(q, k, v, bias_oracle(bias, 1, 20, q_offset=19), causal=True, q_offset=19, mask=mask[:, None, None, :])

    first = layer()
    ops = _dispatched(layer)
    assert set(ops) <= {"_scaled_dot_product_flash_attention_for_cpu", "masked_fill.Scalar", "view", "promote_types"}, ops
    assert torch.allclose(layer().double(), want(keep), atol=1e-5) and torch.equal(first, layer())
    keep[1, 5:] = True  # in place: built again
    assert "isneginf" in _dispatched(layer) and torch.allclose(layer().double(), want(keep), atol=1e-5)
    doubled = OffsetBias(offsets.values * 2, 1, 20, 19)
    assert "isneginf" in _dispatched(lambda: layer(values=doubled))
    trained = OffsetBias(offsets.values.clone().requires_grad_(), 1, 20, 19)
    assert "isneginf" in _dispatched(lambda: layer(values=trained)) and "isneginf" in _dispatched(lambda: layer(values=trained))


def test_a_boolean_key_mask_becomes_one_additive_mask_kept_between_calls():
    """No position term and a key padding mask on a small call (T5's cross-attention in a decoding step): the first call
    builds one additive mask in SDPA's dtype; the next layers' calls with the same mask build nothing (SDPA would convert
    a boolean mask on every call, two operators). An example with no kept key returns zeros, the others equal the
    oracle; a mask changed in place is built again."""
    q, k, v = qkv(lq=3, lk=13)
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[0, 9:] = False
    keep[1] = False  # fully padded
    out = attention(q, k, v, key_mask=keep)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.allclose(out[0].double(), oracle(q[:1], k[:1], v[:1], mask=keep[:1, None, None, :])[0], atol=1e-5)
    ops = _dispatched(lambda: attention(q, k, v, key_mask=keep))
    assert set(ops) <= {"_scaled_dot_product_flash_attention_for_cpu", "masked_fill.Scalar", "view"}, ops
    assert ops["masked_fill.Scalar"] == 1, ops  # only the dead row's output is zeroed
    keep[1, :4] = True  # in place: built again, and the example now sees its first four keys
    assert "isneginf" in _dispatched(lambda: attention(q, k, v, key_mask=keep))
    out = attention(q, k, v, key_mask=keep)
    assert torch.allclose(out.double(), oracle(q, k, v, mask=keep[:, None, None, :]), atol=1e-5)


def test_bad_inputs():
    q, k, v = qkv()
    bias = RelativePositionalBias(3)
    with pytest.raises(ValueError, match="num_heads=3 but the query has 4 heads"):
        attention(q, k, v, bias=bias)
    with pytest.raises(ValueError, match="query must be a 4-D tensor"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="backend must be one of"):
        attention(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="was built for"):
        attention(q, k, v, bias=RelativePositionalBias(4).offsets(9, 9))
    with pytest.raises(TypeError, match="bias must be a relpos bias module"):
        attention(q, k, v, bias="t5")
    with pytest.raises(ValueError, match="q_offset must be non-negative"):
        attention(q, k, v, q_offset=-2)
    with pytest.raises(ValueError, match="key's last dimension"):
        attention(q, k[..., :4], v)
    assert isinstance(RelativePositionalBias(4).offsets(9, 13), OffsetBias)


def test_sdpa_receives_a_view_not_a_dense_bias(monkeypatch):
    import torch.nn.functional as F

    seen = {}
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen["mask"] = attn_mask
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    bias = RelativePositionalBias(4, bidirectional=False)
    q, k, v = qkv(lq=64, lk=64)
    with torch.no_grad():
        attention(q, k, v, bias=bias, causal=True, backend="sdpa")
    mask = seen["mask"]
    assert mask.shape == (1, 4, 64, 64) and not mask.requires_grad
    assert mask.untyped_storage().nbytes() == 4 * (64 + 64 - 1) * mask.element_size()  # O(H (Lq + Lk))


LAYOUT_HINT = r"tensors are \(B, H, L, d\): a \(B, L, H, d\) tensor needs \.transpose\(1, 2\)"


@pytest.mark.parametrize("bias", [RelativePositionalBias(8), RelativePositionalBias(8).offsets(8, 8)])
def test_a_transposed_query_gets_the_layout_hint(bias):
    q = torch.randn(2, 8, 8, 16)  # (B, H, L, d) = (2, 8, 8, 16) ...
    swapped = torch.randn(2, 32, 8, 16)  # ... and (B, L, H, d) = (2, 32, 8, 16) passed as if it were (B, H, L, d)
    with pytest.raises(ValueError, match="bias has num_heads=8 but the query has 32 heads; .*" + LAYOUT_HINT):
        attention(swapped, swapped, swapped, bias=bias)
    assert attention(q, q, q, bias=bias).shape == q.shape  # the same bias, the right layout
    long = torch.randn(1, 128, 4, 16)  # (B, L=128, H=4, d) against a bias of 8 heads: 128 heads reads as a length
    with pytest.raises(ValueError, match="num_heads=8 but the query has 128 heads; .*" + LAYOUT_HINT):
        attention(long, long, long, bias=RelativePositionalBias(8))


def test_a_real_head_mismatch_gets_no_layout_hint():
    q = torch.randn(2, 4, 16, 8)
    with pytest.raises(ValueError, match="num_heads=3 but the query has 4 heads; .*num_heads=4 or 1$"):
        attention(q, q, q, bias=RelativePositionalBias(3))


def test_cross_attention_with_a_transposed_query_gets_the_layout_hint():
    from relpos import cross_attention_with_bias

    query, key = torch.randn(2, 24, 8, 16), torch.randn(2, 12, 8, 16)  # (B, L, H, d): Lq = 24, Lk = 12, H = 8
    with pytest.raises(ValueError, match="^relative_bias has num_heads=8 but the query has 24 heads; .*" + LAYOUT_HINT):
        cross_attention_with_bias(query, key, key, RelativePositionalBias(8))  # named by this function's argument
    out = cross_attention_with_bias(query.transpose(1, 2), key.transpose(1, 2), key.transpose(1, 2), RelativePositionalBias(8))
    assert out.shape == (2, 8, 24, 16)
