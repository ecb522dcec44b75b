"""Bad values at the public boundary: each raises TypeError/ValueError naming the argument, none is silently accepted.

A table of cases (constructor or call, expected exception, a phrase the message must contain). This
covers the silent acceptances and unclear errors found by probing relpos as an adversary would.
"""

import pytest
import torch

import relpos
from relpos import (
    LearnedAbsolutePositionEmbedding,
    MultiheadAttention,
    RelativePositionalBias,
    RotaryEmbedding,
    ShawRelativePosition,
    SinusoidalPositionEmbedding,
    T5Attention,
    T5Block,
    T5Stack,
    attention,
    t5_bucket,
)

Q = torch.randn(2, 4, 5, 8)

CASES = [
    # strings are not booleans
    ("attention causal='no'", lambda: attention(Q, Q, Q, causal="no"), TypeError, "causal must be a bool"),
    ("MHA causal='yes'", lambda: MultiheadAttention(16, 4, causal="yes"), TypeError, "causal must be a bool"),
    ("T5Block causal='yes'", lambda: T5Block(16, 4, 32, relative_bias=None, causal="yes"), TypeError, "causal must be a bool"),
    ("T5Attention has_relative_bias='no'", lambda: T5Attention(16, 4, has_relative_bias="no"), TypeError, "has_relative_bias must be a bool"),
    ("Shaw attention causal='no'", lambda: ShawRelativePosition(8, 2).attention(Q, Q, Q, causal="no"), TypeError, "causal must be a bool"),
    ("T5Stack bidirectional='no'", lambda: T5Stack(1, 16, 4, 32, bidirectional="no"), TypeError, "bidirectional must be a bool"),
    # non-finite numbers
    ("attention scale=nan", lambda: attention(Q, Q, Q, scale=float("nan")), ValueError, "scale must be finite"),
    ("MHA scale=inf", lambda: MultiheadAttention(16, 4, scale=float("inf")), ValueError, "scale must be finite"),
    ("T5 bias init_std=nan", lambda: RelativePositionalBias(4, init_std=float("nan")), ValueError, "init_std must be a finite number > 0"),
    ("Shaw init_std=inf", lambda: ShawRelativePosition(8, 2, init_std=float("inf")), ValueError, "init_std must be a finite number > 0"),
    ("learned absolute init_std=nan", lambda: LearnedAbsolutePositionEmbedding(8, 4, init_std=float("nan")), ValueError, "init_std"),
    ("window bias init_std=-1", lambda: relpos.RelativePositionBias(2, (3, 3), init_std=-1.0), ValueError, "init_std"),
    ("dropout_p=1", lambda: attention(Q, Q, Q, dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)"),
    ("dropout_p rounding to 1", lambda: attention(Q, Q, Q, dropout_p=0.999996), ValueError, "dropout_p must be below 1 - 2**-17"),
    ("MHA dropout rounding to 1", lambda: MultiheadAttention(16, 4, dropout=0.999996), ValueError, "dropout must be below 1 - 2**-17"),
    ("Shaw dropout_p rounding to 1", lambda: ShawRelativePosition(8, 2).attention(Q, Q, Q, dropout_p=0.999996), ValueError, "dropout_p must be below"),
    # sizes
    ("MHA num_kv_heads=0", lambda: MultiheadAttention(16, 4, num_kv_heads=0), ValueError, "num_kv_heads must be positive"),
    ("T5Block ff_dim=0", lambda: T5Block(16, 4, 0, relative_bias=None, causal=False), ValueError, "ff_dim must be positive"),
    ("zero head dim", lambda: attention(Q[..., :0], Q[..., :0], Q[..., :0]), ValueError, "head dimension must be positive"),
    # dtypes and types
    ("integer q/k/v", lambda: attention(Q.long(), Q.long(), Q.long()), TypeError, "one floating dtype"),
    ("mixed dtypes", lambda: attention(Q, Q.double(), Q), TypeError, "one floating dtype"),
    ("integer mask", lambda: attention(Q, Q, Q, attn_mask=torch.ones(2, 1, 1, 5, dtype=torch.long)), TypeError, "refuses integer masks"),
    ("OffsetBias from a list", lambda: relpos.OffsetBias([[0.0] * 6], 3, 4), TypeError, "values must be a floating tensor"),
    ("learned absolute on integers", lambda: LearnedAbsolutePositionEmbedding(8, 4)(torch.ones(3, 4, dtype=torch.long)), TypeError, "floating tensor"),
    ("sinusoidal on integers", lambda: SinusoidalPositionEmbedding(4)(torch.ones(3, 4, dtype=torch.long)), TypeError, "floating tensor"),
    ("RoPE on integers", lambda: RotaryEmbedding(8)(Q.long(), Q.long()), TypeError, "floating tensor"),
    ("RoPE rotate start=1.5", lambda: RotaryEmbedding(8).rotate(Q, 1.5), TypeError, "start must be an int"),
    ("bias offset given positionally", lambda: RelativePositionalBias(4)(4, 4, 2), TypeError, "positional"),
    # meaningless combinations
    ("T5Block memory without cross-attention",
     lambda: T5Block(16, 4, 32, relative_bias=RelativePositionalBias(4), causal=False)(torch.randn(1, 3, 16), memory=torch.randn(1, 2, 16)),
     ValueError, "no cross-attention"),
    ("T5Stack memory without cross-attention",
     lambda: T5Stack(1, 16, 4, 32)(torch.randn(1, 3, 16), memory=torch.randn(1, 2, 16)), ValueError, "no cross-attention"),
]


@pytest.mark.parametrize("name, call, error, phrase", CASES, ids=[c[0] for c in CASES])
def test_refused_with_a_named_reason(name, call, error, phrase):
    with pytest.raises(error) as info:
        call()
    assert phrase in str(info.value), str(info.value)


def test_t5_bucket_int64_extremes_stay_in_range():
    extremes = torch.tensor([-(2**63), -(2**62) - 5, 2**63 - 1, 0, -1, 1])
    for bidirectional in (True, False):
        buckets = t5_bucket(extremes, bidirectional=bidirectional)
        assert ((buckets >= 0) & (buckets < 32)).all()
    assert t5_bucket(torch.tensor([-(2**63)])).item() == t5_bucket(torch.tensor([-1000])).item() == 15


def test_alibi_heads_are_bounded():
    with pytest.raises(ValueError, match="num_heads must be at most 65536"):
        relpos.alibi_slopes(10**9)
    assert len(relpos.alibi_slopes(1000)) == 1000


def test_from_t5_state_dict_validates_the_table():
    key = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    for bad in (torch.zeros(32), torch.zeros(32, 8, dtype=torch.long), None):
        with pytest.raises(ValueError, match="must be a floating \\(num_buckets, num_heads\\) tensor"):
            RelativePositionalBias.from_t5_state_dict({key: bad})


def test_older_swin_state_dicts_with_the_index_load():
    """timm and older Swin checkpoints carry relative_position_index: it is checked against ours, then dropped."""
    bias = relpos.RelativePositionBias(2, (3, 3))
    state = dict(bias.state_dict())
    state["relative_position_index"] = relpos.window_relative_position_index((3, 3))  # (9, 9), as timm stores it
    fresh = relpos.RelativePositionBias(2, (3, 3))
    fresh.load_state_dict(state)  # strict
    assert torch.equal(fresh.relative_position_bias_table, bias.relative_position_bias_table)
    state["relative_position_index"] = state["relative_position_index"].flatten()  # transformers' flat layout
    fresh.load_state_dict(state)
    state["relative_position_index"] = relpos.window_relative_position_index((2, 2))
    with pytest.raises(RuntimeError, match="another window"):
        fresh.load_state_dict(state)


@pytest.mark.parametrize("name,call,error,phrase", [
    ("dense bias of another shape", lambda: attention(Q, Q, Q, bias=torch.zeros(3, 5, 5)), ValueError, "bias of shape (3, 5, 5) does not broadcast"),
    ("(B, L, H, d) inputs with unequal lengths", lambda: attention(torch.randn(2, 12, 8, 16), torch.randn(2, 10, 8, 16), torch.randn(2, 10, 8, 16)), ValueError,
     "key/value heads (10) must divide query heads (12) for grouped-query attention; if your tensors are laid out (B, L, H, d), pass query.transpose(1, 2)"),
    ("dense bias with permuted dimensions", lambda: attention(Q, Q[:, :, :3], Q[:, :, :3], bias=torch.zeros(2, 5, 4, 3)), ValueError,
     "bias of shape (2, 5, 4, 3) does not broadcast to (B, H, Lq, Lk) = (2, 4, 5, 3); its dimensions look permuted: "
     "bias.permute(0, 2, 1, 3) has the shape relpos takes"),
    ("integer dense bias", lambda: attention(Q, Q, Q, bias=torch.zeros(1, 4, 5, 5, dtype=torch.long)), TypeError, "must be floating"),
    ("boolean dense bias", lambda: attention(Q, Q, Q, bias=torch.ones(1, 4, 5, 5, dtype=torch.bool)), TypeError, "belongs in attn_mask"),
    ("bias on another device", lambda: attention(Q, Q, Q, bias=torch.zeros(1, 4, 5, 5, device="meta")), ValueError, "bias is on meta but the query is on cpu"),
    ("attn_mask on another device", lambda: attention(Q, Q, Q, attn_mask=torch.ones(5, 5, dtype=torch.bool, device="meta")), ValueError, "attn_mask is on meta"),
    ("key_mask on another device", lambda: attention(Q, Q, Q, key_mask=torch.ones(2, 5, dtype=torch.bool, device="meta")), ValueError, "key_mask is on meta"),
    ("MHA input of another dtype", lambda: MultiheadAttention(16, 4)(torch.randn(1, 5, 16, dtype=torch.float64)), TypeError, "x is torch.float64 on cpu but this layer's weights are torch.float32"),
    ("MHA memory of another dtype", lambda: MultiheadAttention(16, 4)(torch.randn(1, 5, 16), memory=torch.randn(1, 3, 16).double()), TypeError, "memory is torch.float64"),
    ("RoPE module on another device", lambda: RotaryEmbedding(8, device="meta")(Q, Q), ValueError, "this RotaryEmbedding is on meta"),
])
def test_dtype_and_device_mismatches_are_named(name, call, error, phrase):
    with pytest.raises(error) as info:
        call()
    assert phrase in str(info.value), (name, str(info.value))


def test_autocast_still_mixes_dtypes_in_multihead_attention():
    layer = MultiheadAttention(16, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = layer(torch.randn(1, 5, 16).bfloat16())  # autocast casts the weights: no refusal
    assert out.dtype == torch.bfloat16
