"""RelativePositionalBias: exact to transformers' compute_bias, loads T5 checkpoints, per-offset forms."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import OffsetBias, RelativePositionalBias, t5_bucket

from oracles import bias_oracle, offsets

transformers = pytest.importorskip("transformers")
from transformers.models.t5.modeling_t5 import T5Attention as HFT5Attention  # noqa: E402


def hf_attention(num_heads=4, num_buckets=32, max_distance=128, is_decoder=False):
    config = transformers.T5Config(
        d_model=32,
        d_kv=8,
        num_heads=num_heads,
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
        is_decoder=is_decoder,
    )
    attn = HFT5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    torch.nn.init.normal_(attn.relative_attention_bias.weight)
    return attn


def ours_from(attn: HFT5Attention) -> RelativePositionalBias:
    bias = RelativePositionalBias(
        attn.n_heads,
        attn.relative_attention_num_buckets,
        attn.relative_attention_max_distance,
        bidirectional=not attn.is_decoder,
    )
    bias.relative_attention_bias.load_state_dict(attn.relative_attention_bias.state_dict())
    return bias


@settings(max_examples=40, deadline=None)
@given(
    is_decoder=st.booleans(),
    half=st.integers(2, 40),
    extra=st.integers(1, 300),
    lq=st.integers(1, 70),
    lk=st.integers(1, 300),
    past=st.integers(0, 500),
)
def test_equals_compute_bias(is_decoder, half, extra, lq, lk, past):
    num_buckets = 2 * half
    max_exact = (half if not is_decoder else num_buckets) // 2
    attn = hf_attention(num_buckets=num_buckets, max_distance=max_exact + extra, is_decoder=is_decoder)
    ours = ours_from(attn)
    with torch.no_grad():
        expected = attn.compute_bias(lq, lk, past_seen_tokens=past)
        assert torch.equal(ours(lq, lk, q_offset=past), expected)
        assert torch.equal(ours.offsets(lq, lk, q_offset=past).dense(), expected)


@pytest.mark.parametrize("is_decoder", [False, True])
def test_equals_compute_bias_t5_defaults_long(is_decoder):
    attn = hf_attention(num_heads=8, is_decoder=is_decoder)
    ours = ours_from(attn)
    with torch.no_grad():
        for lq, lk, past in [(512, 512, 0), (1, 1024, 1023), (300, 1000, 0), (1000, 7, 0), (16, 2048, 2032)]:
            assert torch.equal(ours(lq, lk, q_offset=past), attn.compute_bias(lq, lk, past_seen_tokens=past))


def test_loads_t5_checkpoint_state_dict():
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
    )
    model = transformers.T5Model(config).eval()
    state = model.state_dict()  # what torch.load of a T5 checkpoint gives
    enc = RelativePositionalBias.from_t5_state_dict(state)
    dec = RelativePositionalBias.from_t5_state_dict(state, prefix="decoder.block.0.layer.0.SelfAttention.")
    assert enc.bidirectional and not dec.bidirectional
    hf_enc = model.encoder.block[0].layer[0].SelfAttention
    hf_dec = model.decoder.block[0].layer[0].SelfAttention
    with torch.no_grad():
        assert torch.equal(enc(37, 41), hf_enc.compute_bias(37, 41))
        assert torch.equal(dec(5, 41, q_offset=36), hf_dec.compute_bias(5, 41, past_seen_tokens=36))
    # a plain load_state_dict of the sub-dict works too: the parameter has T5's name
    plain = RelativePositionalBias(4)
    prefix = "encoder.block.0.layer.0.SelfAttention."
    plain.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k == prefix + "relative_attention_bias.weight"})
    assert torch.equal(plain.relative_attention_bias.weight, enc.relative_attention_bias.weight)
    with pytest.raises(KeyError, match="relative bias tables found"):
        RelativePositionalBias.from_t5_state_dict(state, prefix="encoder.block.1.layer.0.SelfAttention.")


# --- the per-offset form --------------------------------------------------------------------


def test_offsets_are_one_per_distinct_offset():
    bias = RelativePositionalBias(4)
    ob = bias.offsets(100, 300, q_offset=5)
    assert ob.values.shape == (4, 100 + 300 - 1)
    rel = offsets(100, 300, q_offset=5)
    naive = bias.relative_attention_bias(t5_bucket(rel)).permute(2, 0, 1).unsqueeze(0)  # (1, H, Lq, Lk)
    assert torch.equal(ob.dense(), naive)


def test_hankel_is_a_zero_copy_view():
    bias = RelativePositionalBias(4)
    ob = bias.offsets(64, 96)
    view = ob.hankel()
    assert view.shape == (1, 4, 64, 96)
    assert view.untyped_storage().data_ptr() == ob.values.untyped_storage().data_ptr()
    assert view.untyped_storage().nbytes() == ob.values.numel() * ob.values.element_size()
    assert torch.equal(view.flip(-2), ob.dense())


def test_rows_and_decode_step():
    bias = RelativePositionalBias(4, bidirectional=False, init_std=1.0)
    full = bias_oracle(bias, 50, 50).float()  # from the table and t5_bucket of explicit j - i
    ob = bias.offsets(50, 50)
    for i in (0, 17, 49):
        assert torch.equal(ob.row(i), full[0, :, i])
    assert torch.equal(bias(50, 50), full)
    # decoding token 37 with 38 keys in the cache: one row, O(Lk) work
    step = bias.offsets(1, 38, q_offset=37)
    assert step.values.shape == (4, 38)
    assert torch.equal(step.dense()[0, :, 0], full[0, :, 37, :38])
    with pytest.raises(ValueError, match="i must be < query_length=50"):
        ob.row(50)


def test_mask_future_folds_causality():
    bias = RelativePositionalBias(2, bidirectional=False)
    ob = bias.offsets(6, 9, q_offset=3).mask_future()
    dense = ob.dense()[0]
    rel = offsets(6, 9, q_offset=3)
    assert torch.all(torch.isneginf(dense[:, rel > 0]))
    assert torch.equal(dense[:, rel <= 0], bias_oracle(bias, 6, 9, 3).float()[0][:, rel <= 0])


def test_offset_bias_validates_shape():
    with pytest.raises(ValueError, match=r"\(H, 6\)"):
        OffsetBias(torch.zeros(2, 5), query_length=3, key_length=4)


# --- training, dtypes, state dict ------------------------------------------------------------


@pytest.mark.parametrize("form", ["dense", "hankel", "forward"])
def test_gradients_reach_the_table(form):
    torch.manual_seed(0)
    bias = RelativePositionalBias(3, num_buckets=16, max_distance=40)
    weights = torch.randn(1, 3, 30, 50)
    ob = bias.offsets(30, 50)
    out = {"dense": lambda: ob.dense(), "hankel": lambda: ob.hankel().flip(-2), "forward": lambda: bias(30, 50)}[form]()
    (out * weights).sum().backward()
    grad = bias.relative_attention_bias.weight.grad
    # reference: naive lookup of every (i, j) pair
    table = bias.relative_attention_bias.weight.detach().clone().requires_grad_(True)
    buckets = t5_bucket(offsets(30, 50), num_buckets=16, max_distance=40)
    (table[buckets].permute(2, 0, 1).unsqueeze(0) * weights).sum().backward()
    assert torch.allclose(grad, table.grad, atol=1e-5)
    assert torch.isfinite(grad).all()


def test_state_dict_round_trip():
    a = RelativePositionalBias(4, 64, 256, bidirectional=False)
    b = RelativePositionalBias(4, 64, 256, bidirectional=False)
    b.load_state_dict(a.state_dict())
    assert list(a.state_dict()) == ["relative_attention_bias.weight"]
    assert torch.equal(a(10, 20), b(10, 20))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_round_trip(dtype):
    bias = RelativePositionalBias(4, init_std=1.5)  # at the 0.02 init a zero bias would pass atol=1e-2
    before = bias(40, 200).detach()
    low = bias.to(dtype)
    out = low(40, 200)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert before.abs().max() > 1
    assert torch.allclose(out.float(), before, rtol=1e-2 if dtype != torch.float64 else 0, atol=0)
    assert torch.equal(low.to(torch.float32)(40, 200), before) == (dtype == torch.float64)
    made = RelativePositionalBias(4, dtype=dtype)
    assert made.relative_attention_bias.weight.dtype == dtype


def test_other_strategies_in_module():
    bias = RelativePositionalBias(2, strategy="linear")
    assert "strategy='linear'" in repr(bias)
    assert bias(8, 300).shape == (1, 2, 8, 300)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(num_heads=0), ValueError, ["num_heads", "positive", "0"]),
        (dict(num_heads=4, num_buckets=7), ValueError, ["num_buckets", "even", "7"]),
        (dict(num_heads=4, num_buckets=32, max_distance=4), ValueError, ["max_distance", "exact range"]),
        (dict(num_heads=4.0), TypeError, ["num_heads", "int"]),
    ],
)
def test_bad_construction(kwargs, exc, words):
    with pytest.raises(exc) as info:
        RelativePositionalBias(**kwargs)
    for w in words:
        assert w in str(info.value)


def test_bad_lengths():
    bias = RelativePositionalBias(4)
    with pytest.raises(ValueError, match="query_length must be positive, got 0"):
        bias(0, 4)
    with pytest.raises(ValueError, match="key_length must be positive, got -3"):
        bias(2, -3)
    with pytest.raises(ValueError, match="q_offset must be non-negative, got -1"):
        bias(2, 3, q_offset=-1)


def test_offset_buckets_are_a_view_of_kept_ones(monkeypatch):
    """offsets() reads its buckets from one kept ramp (a view, no bucket function per call): equal values (and table
    gradients) to the bucket function at every shape, every decoding position and beyond the first ramp's reach (it
    grows); two calls share storage; under torch.compile's rule (nothing kept) the same values; nothing of it in the
    state dict."""
    from relpos._reuse import may_reuse
    from relpos.encodings import buckets as buckets_module

    bias = relpos.RelativePositionalBias(4, num_buckets=16, max_distance=32)

    def expected(lq, lk, q_offset):
        return bias.relative_attention_bias(bias.bucket(relpos.relative_offsets(lq, lk, q_offset=q_offset))).T

    first = bias.offsets(40, 50, q_offset=3)
    assert torch.equal(first.values, expected(40, 50, 3)) and first.flat == (-32, 32)
    first.values.sum().backward()
    assert bias.relative_attention_bias.weight.grad.abs().sum() > 0
    for q_offset in range(10):  # decoding: one query at every position of a cache of 10 keys
        torch.testing.assert_close(bias.offsets(1, 10, q_offset=q_offset).values, expected(1, 10, q_offset))
    long = bias.offsets(3, 3000, q_offset=2000)  # past the first ramp (offsets up to 1023): it grows
    torch.testing.assert_close(long.values, expected(3, 3000, 2000))
    a, b = bias._offset_buckets(5, 9, 2), bias._offset_buckets(1, 9, 8)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one kept ramp
    assert may_reuse(torch.device("cpu"))
    monkeypatch.setattr(buckets_module, "may_reuse", lambda device: False)  # inside a compiled graph
    fresh = bias._offset_buckets(5, 9, 2)
    assert torch.equal(fresh, a) and fresh.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert set(bias.state_dict()) == {"relative_attention_bias.weight"}
