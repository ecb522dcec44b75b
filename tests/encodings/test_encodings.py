"""The other encodings: clipped, ALiBi, log-decay, RoPE, Shaw keys/values, absolute baselines."""

import math

import numpy as np
import pytest
import torch

import relpos
from relpos import (
    ALiBi,
    ClippedRelativeBias,
    LearnedAbsolutePositionEmbedding,
    LogDecayBias,
    RotaryEmbedding,
    ShawRelativePosition,
    SinusoidalPositionEmbedding,
    alibi_slopes,
    attention,
    relative_positions,
)

from oracles import assert_bias_matters, attend, bias_oracle, offsets

transformers = pytest.importorskip("transformers")

# Seed 003's shared setup: x0 = [1, 0], x1 = [0, 1], x2 = [1, 1], Q = K = X, d = 2.
X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
CONTENT = X @ X.T / math.sqrt(2)


def logits_with_bias(bias_module, q=X, k=X):
    return q @ k.T / math.sqrt(2) + bias_module.materialize(3, 3)[0, 0]


# --- clipped (Shaw scalar form) --------------------------------------------------------------


def seed_table_to_ours(seed_values_by_query_minus_key):
    """The seeds index by r = i - j; relpos by d = j - i = -r: reverse the table."""
    return list(reversed(seed_values_by_query_minus_key))


def test_clipped_tutorial_grid():
    # L = 7, R_max = 2, b_r for r = i - j in (-2..2) = (-0.3, -0.2, 0, 0.2, 0.3)
    bias = ClippedRelativeBias(num_heads=1, max_distance=2)
    with torch.no_grad():
        bias.relative_bias.copy_(torch.tensor([seed_table_to_ours([-0.3, -0.2, 0.0, 0.2, 0.3])]))
    grid = bias.materialize(7, 7)[0, 0]
    expected = torch.tensor(
        [
            [0.0, -0.2, -0.3, -0.3, -0.3, -0.3, -0.3],
            [0.2, 0.0, -0.2, -0.3, -0.3, -0.3, -0.3],
            [0.3, 0.2, 0.0, -0.2, -0.3, -0.3, -0.3],
            [0.3, 0.3, 0.2, 0.0, -0.2, -0.3, -0.3],
            [0.3, 0.3, 0.3, 0.2, 0.0, -0.2, -0.3],
            [0.3, 0.3, 0.3, 0.3, 0.2, 0.0, -0.2],
            [0.3, 0.3, 0.3, 0.3, 0.3, 0.2, 0.0],
        ]
    )
    assert torch.equal(grid, expected)
    assert bias.relative_bias.shape == (1, 2 * 2 + 1)  # 2 R_max + 1 values (seed 003 says "+ 14")


def test_clipped_equals_naive_and_trains():
    torch.manual_seed(0)
    bias = ClippedRelativeBias(num_heads=3, max_distance=4)
    torch.nn.init.normal_(bias.relative_bias)
    dense = bias.materialize(10, 13, q_offset=2)
    rel = offsets(10, 13, q_offset=2).clamp(-4, 4) + 4
    assert torch.equal(dense[0], bias.relative_bias[:, rel])
    q, k, v = (torch.randn(2, 3, 10, 8) for _ in range(3))
    out = attention(q, k[:, :, :10], v[:, :, :10], bias=bias, causal=True, backend="sdpa")
    out.sum().backward()
    assert torch.isfinite(bias.relative_bias.grad).all() and bias.relative_bias.grad.abs().sum() > 0


# --- ALiBi ------------------------------------------------------------------------------------


def test_alibi_slopes_match_paper_and_bloom():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    assert alibi_slopes(8) == [2.0 ** -(k + 1) for k in range(8)]
    assert alibi_slopes(16) == pytest.approx([2.0 ** -(0.5 * (k + 1)) for k in range(16)], rel=1e-12, abs=0)
    for n in range(1, 65):
        ours = torch.tensor(alibi_slopes(n))
        assert len(ours) == n and torch.all(ours > 0)
        assert torch.allclose(ours.float(), _get_alibi_slopes(n, "cpu"), rtol=1e-6, atol=0), n


def test_alibi_equals_bloom_in_causal_attention():
    # BLOOM adds slope * key_position to every row (softmax-equivalent to slope * (j - i)).
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    torch.manual_seed(0)
    heads, length = 6, 17
    q, k, v = (torch.randn(1, heads, length, 8) for _ in range(3))
    bloom = build_alibi_tensor(torch.ones(1, length), heads, torch.float32).view(1, heads, 1, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    expected = attention(q, k, v, bias=bloom, attn_mask=causal, backend="eager")
    for backend in ("eager", "sdpa"):
        assert torch.allclose(attention(q, k, v, bias=ALiBi(heads), causal=True, backend=backend), expected, atol=1e-5)


def test_alibi_forms_and_decoding():
    alibi = ALiBi(2, slopes=[0.5, 0.25])
    rel = offsets(4, 4)
    dense = alibi.materialize(4, 4)[0]
    assert torch.equal(dense[0], 0.5 * rel.clamp(max=0).float())
    sym = ALiBi(2, mode="symmetric", slopes=[0.5, 0.25]).materialize(4, 4)[0]
    assert torch.equal(sym[1], -0.25 * rel.abs().float())
    full = ALiBi(4).materialize(9, 9)
    step = ALiBi(4).offsets(1, 9, q_offset=8).dense()
    assert torch.equal(step[0, :, 0], full[0, :, 8])
    assert list(ALiBi(4).parameters()) == [] and ALiBi(4).state_dict() == {}


def test_alibi_keeps_its_last_offsets_until_the_call_or_the_slopes_change():
    """A model's layers share one ALiBi and ask for the same offsets in turn: the second ask returns the first's
    values; another shape, other slopes (changed in place, or a module cast) give fresh values, equal to the formula."""
    alibi = ALiBi(2, slopes=[0.5, 0.25])
    first = alibi.offsets(1, 9, q_offset=8)
    assert alibi.offsets(1, 9, q_offset=8) is first
    other = alibi.offsets(2, 9, q_offset=7)
    assert other is not first and torch.equal(other.dense()[0, :, 1], first.dense()[0, :, 0])
    alibi.slopes.mul_(2)  # in place
    doubled = alibi.offsets(2, 9, q_offset=7)
    assert torch.equal(doubled.values, 2 * other.values) and torch.equal(doubled.linear.slopes, torch.tensor([1.0, 0.5]))
    alibi.double()  # a new buffer (as .to(device) makes)
    assert alibi.offsets(2, 9, q_offset=7).values.dtype == torch.float64


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_heads=0), ["num_heads", "positive"]),
        (dict(num_heads=2, slopes=[0.5]), ["slopes", "num_heads=2", "1"]),
        (dict(num_heads=2, slopes=[0.5, -1.0]), ["slopes", "> 0"]),
        (dict(num_heads=2, mode="left"), ["mode", "'causal'"]),
    ],
)
def test_alibi_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as info:
        ALiBi(**kwargs)
    for w in words:
        assert w in str(info.value)


# --- log-decay (seed 004) ---------------------------------------------------------------------


def test_log_decay_cat_sat_tables_through_attention():
    from cat_sat import BIASED, BIASED_SCORES, DIFFERENCE, RAW, STANDARD  # seed 004's printed tables

    raw = torch.tensor(RAW)
    q = (raw * math.sqrt(5) / 2)[None, None]  # (1, 1, 5, 5): q k^T / sqrt(5) = RAW / 2 with k = I
    k = torch.eye(5, dtype=torch.float64)[None, None]
    v = torch.eye(5, dtype=torch.float64)[None, None]  # identity values: the output is the weights
    bias = LogDecayBias(scale=0.3)
    assert torch.allclose(raw / 2 + bias.materialize(5, 5)[0, 0].double(), torch.tensor(BIASED_SCORES, dtype=torch.float64), atol=5e-5)
    for backend in ("eager", "sdpa"):
        standard = attention(q, k, v, backend=backend)[0, 0]
        biased = attention(q, k, v, bias=bias, backend=backend)[0, 0]
        assert torch.allclose(standard, torch.tensor(STANDARD, dtype=torch.float64), atol=5e-5)
        assert torch.allclose(biased, torch.tensor(BIASED, dtype=torch.float64), atol=5e-5)
        assert torch.allclose(biased - standard, torch.tensor(DIFFERENCE, dtype=torch.float64), atol=1e-4)


def test_log_decay_equals_numpy_reference():
    from relpos.encodings.reference import numpy_log_decay_bias

    ours = LogDecayBias(0.7, num_heads=3).materialize(9, 9)
    assert ours.shape == (1, 3, 9, 9)
    assert np.allclose(ours[0, 2].numpy(), numpy_log_decay_bias(9, 0.7), atol=1e-7)
    assert list(LogDecayBias().parameters()) == []
    for bad in (0.0, -0.3, float("nan")):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            LogDecayBias(bad)


# --- RoPE ----------------------------------------------------------------------------------------


def llama_rope(q, k, head_dim, base=10000.0, offset=0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_theta=base)
    rope = LlamaRotaryEmbedding(config)
    length = q.shape[-2]
    position_ids = torch.arange(offset, offset + length)[None]
    cos, sin = rope(q, position_ids)
    return apply_rotary_pos_emb(q, k, cos, sin)


@pytest.mark.parametrize("head_dim, base", [(64, 10000.0), (128, 500000.0), (8, 10.0)])
def test_rope_half_split_equals_llama(head_dim, base):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 300, head_dim), torch.randn(2, 4, 300, head_dim)
    ours = RotaryEmbedding(head_dim, base=base)
    got_q, got_k = ours(q, k)
    exp_q, exp_k = llama_rope(q, k, head_dim, base)
    assert torch.allclose(got_q, exp_q, atol=1e-5) and torch.allclose(got_k, exp_k, atol=1e-5)
    # a query block at an offset: Llama with position_ids starting there
    got_q2, _ = ours(q[:, :, :7], k, q_offset=200)
    exp_q2, _ = llama_rope(q[:, :, :7], q[:, :, :7], head_dim, base, offset=200)
    assert torch.allclose(got_q2, exp_q2, atol=1e-4)


def complex_rope(x, positions, inv_freq):
    """RoFormer's formula on interleaved pairs as complex numbers: (x0 + i x1) * exp(i p theta)."""
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    phase = torch.polar(torch.ones((), dtype=torch.float64), positions.double()[:, None] * inv_freq.double()[None, :])
    return torch.view_as_real(pairs * phase).flatten(-2)


def test_rope_interleaved_equals_complex_formula():
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, interleaved=True)
    q, k = torch.randn(3, 40, 16), torch.randn(3, 50, 16)
    got_q, got_k = rope(q, k, q_offset=10)
    assert torch.allclose(got_q.double(), complex_rope(q, torch.arange(10, 50), rope.inv_freq), atol=1e-5)
    assert torch.allclose(got_k.double(), complex_rope(k, torch.arange(50), rope.inv_freq), atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_only_on_offset(interleaved):
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, interleaved=interleaved)
    q, k = torch.randn(1, 32), torch.randn(1, 32)
    scores = []
    for shift in (0, 5, 1000):  # the same pair, query at shift + 3, key at shift + 1
        qr, _ = rope(q, k, q_offset=shift + 3)
        kr = rope(q, torch.cat([torch.zeros(shift + 1, 32), k]))[1][-1:]
        scores.append((qr @ kr.T).item())
    assert scores[0] == pytest.approx(scores[1], abs=1e-4) and scores[0] == pytest.approx(scores[2], abs=1e-3)


def test_rope_tutorial_thirty_degrees():
    rope = RotaryEmbedding(2, inv_freq=[math.pi / 6])  # theta_p = 30 degrees * p
    qr, kr = rope(X, X)
    assert torch.allclose(kr[1], torch.tensor([-0.5, 0.8660]), atol=1e-4)
    assert torch.allclose(kr[2], torch.tensor([-0.3660, 1.3660]), atol=1e-4)  # the seed prints +0.366
    logits = qr @ kr.T / math.sqrt(2)
    expected = torch.tensor([[0.7071, -0.3536, -0.2588], [-0.3536, 0.7071, 0.9659], [-0.2588, 0.9659, 1.4142]])
    assert torch.allclose(logits, expected, atol=1e-4)  # seed: 0.259 and 0.707 where -0.259 and 0.966 are right


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_low_precision_is_computed_in_fp32(dtype):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64)
    q = torch.randn(1, 1, 4096, 64)
    exact_q, _ = rope(q.double(), q.double())
    got_q, _ = rope(q.to(dtype), q.to(dtype))
    hf_q, _ = llama_rope(q.to(dtype), q.to(dtype), 64)  # casts cos/sin to the low dtype first
    ours_err = (got_q.double() - exact_q).abs().max()
    hf_err = (hf_q.double() - exact_q).abs().max()
    assert got_q.dtype == dtype and torch.isfinite(got_q).all()
    assert ours_err <= hf_err


def test_rope_bad_arguments():
    with pytest.raises(ValueError, match="head_dim must be even"):
        RotaryEmbedding(63)
    with pytest.raises(ValueError, match="base must be a finite number > 0"):
        RotaryEmbedding(64, base=0)
    with pytest.raises(ValueError, match=r"q must be \(..., L, head_dim=64\)"):
        RotaryEmbedding(64)(torch.randn(3, 32), torch.randn(3, 64))
    with pytest.raises(ValueError, match="inv_freq must have head_dim/2=2 entries"):
        RotaryEmbedding(4, inv_freq=[1.0])
    assert RotaryEmbedding(8).state_dict() == {} and list(RotaryEmbedding(8).parameters()) == []


# --- Shaw relative keys and values -------------------------------------------------------------------


def naive_shaw(q, k, v, shaw, causal=False, q_offset=0, scale=None):
    """The (Lq, Lk, d) formulation of the paper, in fp64."""
    lq, lk = q.shape[-2], k.shape[-2]
    idx = offsets(lq, lk, q_offset).clamp(-shaw.max_distance, shaw.max_distance) + shaw.max_distance  # (Lq, Lk)
    ak = shaw.rel_keys.double()[idx]  # (Lq, Lk, d)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) + torch.einsum("bhid,ijd->bhij", q.double(), ak)) * scale
    if causal:
        scores = scores.masked_fill(offsets(lq, lk, q_offset) > 0, float("-inf"))
    p = scores.softmax(-1)
    out = p @ v.double()
    if shaw.rel_values is not None:
        out = out + torch.einsum("bhij,ijd->bhid", p, shaw.rel_values.double()[idx])
    return out


@pytest.mark.parametrize("lq, lk, causal, q_offset", [(9, 9, False, 0), (9, 9, True, 0), (4, 12, True, 8), (12, 5, False, 0)])
def test_shaw_equals_naive(lq, lk, causal, q_offset):
    torch.manual_seed(0)
    shaw = ShawRelativePosition(head_dim=8, max_distance=3, init_std=1.0)
    q, k, v = torch.randn(2, 3, lq, 8), torch.randn(2, 3, lk, 8), torch.randn(2, 3, lk, 8)
    got = shaw.attention(q, k, v, causal=causal, q_offset=q_offset)
    assert torch.allclose(got.double(), naive_shaw(q, k, v, shaw, causal, q_offset), atol=1e-5)


def test_shaw_tutorial_table():
    shaw = ShawRelativePosition(head_dim=2, max_distance=2, values=False)
    seed_rk = [[-1.0, 0.0], [-0.5, 0.0], [0.0, 0.0], [0.5, 0.0], [1.0, 0.0]]  # r = i - j from -2 to 2
    with torch.no_grad():
        shaw.rel_keys.copy_(torch.tensor(seed_table_to_ours(seed_rk)))
    logits = (X @ X.T + shaw.logits(X, 3)) / math.sqrt(2)
    expected = torch.tensor([[0.707, -0.354, 0.0], [0.0, 0.707, 0.707], [1.414, 1.061, 1.414]])
    assert torch.allclose(logits, expected, atol=1e-3)


def test_shaw_gradients_decode_and_dtypes():
    torch.manual_seed(0)
    shaw = ShawRelativePosition(head_dim=8, max_distance=2)
    q, k, v = (torch.randn(1, 2, 10, 8, requires_grad=True) for _ in range(3))
    full = shaw.attention(q, k, v, causal=True)
    full.square().sum().backward()
    for p in (shaw.rel_keys, shaw.rel_values, q, k, v):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    with torch.no_grad():
        step = shaw.attention(q[:, :, 6:7], k[:, :, :7], v[:, :, :7], causal=True, q_offset=6)
        assert torch.allclose(step, full[:, :, 6:7], atol=1e-6)
        half = shaw.to(torch.bfloat16).attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
        assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    state = ShawRelativePosition(8, 2).state_dict()
    assert set(state) == {"rel_keys", "rel_values"}
    with pytest.raises(ValueError, match="max_distance must be non-negative, got -1"):
        ShawRelativePosition(8, -1)


# --- absolute baselines ---------------------------------------------------------------------------------


def test_sinusoidal_equals_paper_formula():
    emb = SinusoidalPositionEmbedding(6)
    table = emb.table(torch.arange(50)).double()
    for pos in (0, 1, 7, 49):
        for c in range(3):
            angle = pos / 10000 ** (2 * c / 6)
            assert table[pos, 2 * c].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * c + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    x = torch.zeros(2, 5, 6)
    assert torch.allclose(emb(x, offset=7), emb.table(torch.arange(7, 12)).expand(2, -1, -1))
    with pytest.raises(ValueError, match="dim must be even"):
        SinusoidalPositionEmbedding(5)


def test_learned_absolute_refuses_past_its_table():
    emb = LearnedAbsolutePositionEmbedding(max_length=16, dim=4)
    x = torch.zeros(1, 16, 4, requires_grad=True)
    out = emb(x)
    assert torch.equal(out[0], emb.weight)
    out.sum().backward()
    assert torch.equal(emb.weight.grad, torch.ones(16, 4))
    with pytest.raises(ValueError, match=r"positions 0..16 are past the learned table of max_length=16"):
        emb(torch.zeros(1, 17, 4))
    with pytest.raises(ValueError, match="cannot extrapolate"):
        emb(torch.zeros(1, 4, 4), offset=13)
    with pytest.raises(ValueError, match=r"x must be \(..., L, dim=4\)"):
        emb(torch.zeros(1, 4, 5))


# --- across encodings -----------------------------------------------------------------------------------------


def every_bias():
    return {
        "t5": relpos.RelativePositionalBias(4),
        "clipped": ClippedRelativeBias(4, 8),
        "alibi": ALiBi(4),
        "alibi_symmetric": ALiBi(4, mode="symmetric"),
        "log_decay": LogDecayBias(0.3, num_heads=4),
    }


@pytest.mark.parametrize("name", list(every_bias()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_bias_low_precision_attention(name, dtype):
    torch.manual_seed(0)
    bias = every_bias()[name]
    for p in bias.parameters():
        torch.nn.init.normal_(p, std=1.5)  # a table at its 0.02 init would change the output by less than the tolerance
    q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
    expected = attend(q, k, v, bias_oracle(bias, 300, 300), causal=True)
    assert_bias_matters(expected, attend(q, k, v, causal=True), 0.05)
    for backend in ("eager", "sdpa"):
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), bias=bias, causal=True, backend=backend)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert (out.double() - expected).abs().max() < 0.05


@pytest.mark.parametrize("name", list(every_bias()))
def test_every_bias_offsets_equal_dense_and_decode_rows(name):
    bias = every_bias()[name]
    full = bias.materialize(20, 20)
    assert torch.allclose(full.double(), bias_oracle(bias, 20, 20), atol=1e-6)
    assert bias.offsets(20, 20).values.shape == (4, 39)  # O(Lq + Lk)
    for t in (0, 11, 19):
        assert torch.equal(bias.offsets(1, t + 1, q_offset=t).dense()[0, :, 0], full[0, :, t, : t + 1])


def test_learnable_get_gradients_fixed_have_none():
    learnable = {"t5": relpos.RelativePositionalBias(4), "clipped": ClippedRelativeBias(4, 3)}
    for bias in learnable.values():
        bias.offsets(6, 6).values.sum().backward()
        assert all(p.grad is not None for p in bias.parameters())
    for bias in (ALiBi(4), LogDecayBias(), RotaryEmbedding(8), SinusoidalPositionEmbedding(8)):
        assert list(bias.parameters()) == []
    assert not ALiBi(4).offsets(6, 6).values.requires_grad


def test_tutorial_side_by_side():
    """Seed 003 section 14: one L = 3 example through four encodings (rows of logits)."""
    additive = ClippedRelativeBias(1, 2)
    with torch.no_grad():
        additive.relative_bias.copy_(torch.tensor([seed_table_to_ours([-0.3, -0.2, 0.0, 0.2, 0.3])]))
    assert torch.allclose(logits_with_bias(additive), torch.tensor([[0.707, -0.2, 0.407], [0.2, 0.707, 0.507], [1.007, 0.907, 1.414]]), atol=1e-3)

    shaw = ShawRelativePosition(2, 2, values=False)
    with torch.no_grad():
        shaw.rel_keys.copy_(torch.tensor(seed_table_to_ours([[-1.0, 0.0], [-0.5, 0.0], [0.0, 0.0], [0.5, 0.0], [1.0, 0.0]])))
    assert torch.allclose(((X @ X.T + shaw.logits(X, 3)) / math.sqrt(2))[0], torch.tensor([0.707, -0.354, 0.0]), atol=1e-3)

    qr, kr = RotaryEmbedding(2, inv_freq=[math.pi / 6])(X, X)
    assert torch.allclose((qr @ kr.T / math.sqrt(2))[0], torch.tensor([0.707, -0.354, -0.259]), atol=1e-3)  # seed: +0.259

    # ALiBi, m = 0.1: the paper's bias is causal; the seed's lower triangle is right, its upper
    # triangle (+0.1, +0.2: a reward for looking further ahead) is what causal masking removes.
    alibi_logits = CONTENT + ALiBi(1, slopes=[0.1]).materialize(3, 3)[0, 0]
    causal = relative_positions(3, 3) <= 0
    seed = torch.tensor([[0.707, 0.1, 0.907], [-0.1, 0.707, 0.807], [0.507, 0.607, 1.414]])
    assert torch.allclose(alibi_logits[causal], seed[causal], atol=1e-3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ClippedRelativeBias(4, 5),
        lambda: ShawRelativePosition(8, 3),
        lambda: LearnedAbsolutePositionEmbedding(32, 8),
        lambda: ALiBi(6),
        lambda: RotaryEmbedding(8),
    ],
)
def test_state_dict_round_trip(make):
    torch.manual_seed(0)
    a = make()
    for p in a.parameters():
        torch.nn.init.normal_(p)
    b = make()
    b.load_state_dict(a.state_dict())
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    for (name, ba), (_, bb) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(ba, bb), name  # fixed buffers are rebuilt, not loaded


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: ClippedRelativeBias(4, -1), ValueError, ["max_distance", "non-negative", "-1"]),
        (lambda: ClippedRelativeBias(0, 3), ValueError, ["num_heads", "positive", "0"]),
        (lambda: ClippedRelativeBias(4, 2.5), TypeError, ["max_distance", "int"]),
        (lambda: LogDecayBias(0.3, num_heads=0), ValueError, ["num_heads", "positive"]),
        (lambda: LearnedAbsolutePositionEmbedding(0, 8), ValueError, ["max_length", "positive"]),
        (lambda: SinusoidalPositionEmbedding(8, base=-1.0), ValueError, ["base", "> 0"]),
    ],
)
def test_bad_arguments_name_the_argument(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    for w in words:
        assert w in str(info.value)


def test_causal_alibi_is_refused_where_future_keys_are_visible():
    import relpos

    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match=r"defines no bias for future keys.*causal=True.*symmetric"):
        relpos.attention(q, q, q, bias=relpos.ALiBi(4))
    relpos.attention(q, q, q, bias=relpos.ALiBi(4), causal=True)  # the paper's setting
    relpos.attention(q, q, q, bias=relpos.ALiBi(4, mode="symmetric"))  # bidirectional
    relpos.attention(q[:, :, -1:], q, q, bias=relpos.ALiBi(4), q_offset=5)  # decoding: no future key exists
