"""RotaryEmbedding(scaling=...): linear, dynamic NTK, YaRN and Llama 3 scaling equal to transformers'."""

import math

import pytest
import torch

from relpos import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

HEAD_DIM, ORIGINAL = 16, 64
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_betas_mscale": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 16,
        "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIGINAL, "attention_factor": 1.3,
    },
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
}


def transformers_rope(params, theta):
    """transformers' Llama rotary embedding with these rope parameters."""
    config_params = {**params, "rope_theta": theta}
    # transformers reads the dynamic-NTK original length from config.max_position_embeddings
    max_positions = ORIGINAL if params["rope_type"] == "dynamic" else 4 * ORIGINAL
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                         max_position_embeddings=max_positions, rope_parameters=config_params)
    return LlamaRotaryEmbedding(config)


def ours(params, theta):
    scaling = {**params, "rope_theta": theta}
    if params["rope_type"] == "dynamic":
        scaling["original_max_position_embeddings"] = ORIGINAL
    return RotaryEmbedding(HEAD_DIM, scaling=scaling)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("name", sorted(CASES))
def test_equal_to_transformers(name, theta):
    params = CASES[name]
    theirs, mine = transformers_rope(params, theta), ours(params, theta)
    length = 5 * ORIGINAL  # past the original length: the scaled regime
    q, k = torch.randn(2, 4, length, HEAD_DIM), torch.randn(2, 4, length, HEAD_DIM)
    cos, sin = theirs(q, torch.arange(length)[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    q_rot, k_rot = mine(q, k)
    assert mine.attention_factor == pytest.approx(theirs.attention_scaling)
    assert torch.allclose(mine.frequencies(length), theirs.inv_freq, rtol=1e-6)
    assert torch.allclose(q_rot, q_ref, atol=1e-5) and torch.allclose(k_rot, k_ref, atol=1e-5)


def test_yarn_attention_factor_and_dynamic_base_by_formula():
    yarn = RotaryEmbedding(HEAD_DIM, scaling=CASES["yarn"])
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    dyn = RotaryEmbedding(HEAD_DIM, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 10})
    assert torch.equal(dyn.frequencies(5), RotaryEmbedding(HEAD_DIM).inv_freq)  # within the original length: plain
    base = 10000.0 * (2.0 * 40 / 10 - 1.0) ** (HEAD_DIM / (HEAD_DIM - 2))
    expected = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    assert torch.allclose(dyn.frequencies(40), expected)


@pytest.mark.parametrize("name", ["linear", "yarn", "llama3"])
def test_decoding_equals_parallel_for_static_scalings(name):
    rope = RotaryEmbedding(HEAD_DIM, scaling={**CASES[name]})
    x = torch.randn(1, 2, 30, HEAD_DIM)
    steps = torch.cat([rope.rotate(x[:, :, t : t + 1], t) for t in range(30)], dim=2)
    assert torch.allclose(steps, rope.rotate(x, 0), atol=1e-6)


def test_bad_scaling_is_refused():
    with pytest.raises(ValueError, match="rope_type.*must be one of"):
        RotaryEmbedding(8, scaling={"rope_type": "ntk", "factor": 2.0})
    with pytest.raises(ValueError, match=r"missing \['original_max_position_embeddings'\]"):
        RotaryEmbedding(8, scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"unknown \['beta_fast'\]"):
        RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32})
    with pytest.raises(ValueError, match="factor'] must be >= 1"):
        RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": 0.5})
    with pytest.raises(ValueError, match="finite number > 0"):
        RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": float("nan")})
    with pytest.raises(ValueError, match="disagree"):
        RotaryEmbedding(8, base=500.0, scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(TypeError, match="dict of rope parameters"):
        RotaryEmbedding(8, scaling="yarn")
    with pytest.raises(ValueError, match="inv_freq or scaling"):
        RotaryEmbedding(2, inv_freq=[1.0], scaling={"rope_type": "linear", "factor": 2.0})
    assert RotaryEmbedding(8, scaling={"rope_type": "default", "rope_theta": 500.0}).base == 500.0
