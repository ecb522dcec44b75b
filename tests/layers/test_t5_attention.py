"""Seed 000's T5Attention and cross-attention: equal to transformers, bias shared across layers."""

import pytest
import torch
from torch import nn

from relpos import OffsetBias, RelativePositionalBias, T5Attention, attention, cross_attention_with_bias

from oracles import assert_bias_matters, bias_oracle

transformers = pytest.importorskip("transformers")
from transformers.models.t5.modeling_t5 import T5Attention as HFT5Attention  # noqa: E402


def hf_layer(is_decoder=False, has_bias=True, d_model=48, d_kv=8, heads=4):
    config = transformers.T5Config(
        d_model=d_model, d_kv=d_kv, num_heads=heads, is_decoder=is_decoder, dropout_rate=0.0,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
    )
    config._attn_implementation = "eager"
    layer = HFT5Attention(config, has_relative_attention_bias=has_bias, layer_idx=0).eval()
    for p in layer.parameters():
        nn.init.normal_(p, std=0.3)
    return layer


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("is_decoder", [False, True])
def test_equals_transformers_t5_attention(backend, is_decoder):
    torch.manual_seed(0)
    hf = hf_layer(is_decoder=is_decoder)
    ours = T5Attention.from_hf(hf, backend=backend)
    x = torch.randn(2, 150, 48)
    length = x.shape[1]
    mask = None
    if is_decoder:  # transformers' decoder receives its causal mask from outside
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, hf_bias, _ = hf(x, mask=mask)
        got, our_bias = ours(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert isinstance(our_bias, OffsetBias)
    assert torch.equal(our_bias.dense(), hf_bias)


def test_head_dim_differs_from_dim_over_heads():
    hf = hf_layer(d_model=40, d_kv=16, heads=3)  # inner dim 48 != d_model 40, as in some T5 sizes
    ours = T5Attention.from_hf(hf)
    x = torch.randn(1, 20, 40)
    with torch.no_grad():
        assert torch.allclose(ours(x)[0], hf(x)[0], atol=1e-5)


def test_shared_bias_counted_once_and_reused():
    shared = RelativePositionalBias(num_heads=4)
    layers = nn.ModuleList([T5Attention(64, 4, relative_bias=shared) for _ in range(6)])
    own = sum(p.numel() for n, p in layers.named_parameters() if "relative_attention_bias" in n)
    assert own == 32 * 4  # one table, not six
    assert sum(p.numel() for p in layers.parameters()) == 6 * 4 * 64 * 64 + 32 * 4
    x = torch.randn(2, 30, 64)
    h, position_bias = layers[0](x)
    for layer in layers[1:]:  # T5 style: layer 0 computes the bias, the others reuse it
        h2, same = layer(h, position_bias=position_bias)
        assert same is position_bias
        assert torch.allclose(h2, layer(h)[0], atol=1e-6)  # reusing equals recomputing
        h = h2
    h.sum().backward()
    assert shared.relative_attention_bias.weight.grad.abs().sum() > 0


def test_t5_explainer_usage_layer0_owns_bias():
    # seed 000: has_relative_bias only on the first layer, later layers take position_bias
    first = T5Attention(64, 8, has_relative_bias=True)
    later = T5Attention(64, 8, has_relative_bias=False)
    assert later.relative_bias is None
    x = torch.randn(1, 16, 64)
    out, bias = first(x)
    out2, bias2 = later(out, position_bias=bias)
    assert bias2 is bias and out2.shape == (1, 16, 64)
    no_bias, none = later(out)  # without a bias the layer is plain attention
    assert none is None and not torch.allclose(no_bias, out2)


def test_cross_attention_lq_ne_lk():
    torch.manual_seed(0)
    bias = RelativePositionalBias(num_heads=8, init_std=1.5)
    q = torch.randn(2, 8, 7, 16)
    k = torch.randn(2, 8, 19, 16)
    v = torch.randn(2, 8, 19, 16)
    out = cross_attention_with_bias(q, k, v, bias)
    scores = q.double() @ k.double().transpose(-2, -1) / 4.0  # the seed's computation, in fp64
    expected = torch.softmax(scores + bias_oracle(bias, 7, 19), -1) @ v.double()
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert_bias_matters(expected, torch.softmax(scores, -1) @ v.double(), 1e-5)



@pytest.mark.parametrize("has_bias", [True, False])
def test_key_value_states_equal_transformers(has_bias):
    """Cross-attention (key_value_states) against transformers' T5Attention with the same weights."""
    torch.manual_seed(0)
    hf = hf_layer(has_bias=has_bias)  # every weight, the bias table included, at std 0.3
    ours = T5Attention.from_hf(hf)
    enc, dec = torch.randn(2, 19, 48), torch.randn(2, 7, 48)
    with torch.no_grad():
        expected, hf_bias, _ = hf(dec, key_value_states=enc)
        got, ob = ours(dec, key_value_states=enc)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    if has_bias:
        assert (ob.query_length, ob.key_length) == (7, 19) and torch.equal(ob.dense(), hf_bias)
        with torch.no_grad():
            without = hf(dec, key_value_states=enc, position_bias=torch.zeros_like(hf_bias))[0]
        assert_bias_matters(expected, without, 1e-5)
    else:
        assert ob is None


def test_causal_self_attention_ignores_future():
    layer = T5Attention(32, 4, bidirectional=False)
    x = torch.randn(1, 10, 32)
    y = layer(x)[0]
    x2 = x.clone()
    x2[:, 6:] = torch.randn(1, 4, 32)  # change the future of position 5
    assert torch.allclose(layer(x2)[0][:, :6], y[:, :6], atol=1e-6)


def test_decode_step_with_offset_equals_parallel():
    torch.manual_seed(0)
    layer = T5Attention(32, 4, bidirectional=False)
    x = torch.randn(1, 12, 32)
    full = layer(x)[0]
    q, k, v = layer._project(x, None)  # (B, H, L, dh) each
    t = 9
    step = attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], bias=layer.relative_bias,
                     causal=True, scale=1.0, q_offset=t)
    step = layer.out(step.transpose(1, 2).reshape(1, 1, -1))
    assert torch.allclose(step[:, 0], full[:, t], atol=1e-5)


def test_scale_none_is_seed_sqrt_d():
    layer = T5Attention(32, 4, scale=None, has_relative_bias=False)
    x = torch.randn(1, 5, 32)
    q, k, v = layer._project(x, None)
    ref = torch.softmax(q @ k.transpose(-2, -1) / 8 ** 0.5, -1) @ v
    ref = layer.out(ref.transpose(1, 2).reshape(1, 5, 32))
    assert torch.allclose(layer(x)[0], ref, atol=1e-6)


def test_bad_construction():
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads"):
        T5Attention(30, 4)
    with pytest.raises(ValueError, match="position bias has num_heads=2 but this layer has 4 heads"):
        T5Attention(32, 4, relative_bias=RelativePositionalBias(2))
    with pytest.raises(ValueError, match=r"x must be \(B, L, embed_dim=32\)"):
        T5Attention(32, 4)(torch.randn(2, 5, 31))
