"""xPos, CoPE and the forgetting gates against public reference code: x-transformers (a test-only
dependency, the `dev` extra), whose classes are used unmodified with the same weights.

x-transformers' ``RotaryEmbedding(use_xpos=True)``, ``CoPE`` (the paper's Appendix B listing) and
``DataDependentAlibi`` (FoX's gates, as a dense ``(B, H, L, L)`` bias) build the expected
logits or attention; relpos runs its own paths (rotary form, eager CoPE, the fold into SDPA).
"""

import math

import pytest
import torch

import relpos

from oracles import oracle, qkv

x_transformers = pytest.importorskip("x_transformers.x_transformers")


def test_xpos_logits_equal_x_transformers():
    torch.manual_seed(0)
    d, length, gamma = 16, 40, 8.0  # a small gamma: the scale moves the logits far (512 is gentler)
    q, k = torch.randn(1, 1, length, d), torch.randn(1, 1, length, d)
    rotary = x_transformers.RotaryEmbedding(d, use_xpos=True, scale_base=gamma)
    freqs, scale = rotary.forward_from_seq_len(length)
    ref_q = x_transformers.apply_rotary_pos_emb(q, freqs, scale)
    ref_k = x_transformers.apply_rotary_pos_emb(k, freqs, scale**-1.0)
    expected = ref_q @ ref_k.transpose(-2, -1)  # (1, 1, L, L): x-transformers centres positions at L // 2; logits do not depend on it
    ours_q, ours_k = relpos.XPos(d, scale_base=gamma)(q, k)
    got = ours_q @ ours_k.transpose(-2, -1)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3)
    rope_q, rope_k = relpos.RotaryEmbedding(d, interleaved=True)(q, k)
    assert ((rope_q @ rope_k.transpose(-2, -1)) - expected).abs().max() > 1.0  # the scale matters


@pytest.mark.parametrize("max_positions", [4, 64])  # clamped early, and never clamped
def test_cope_attention_equals_x_transformers(max_positions):
    torch.manual_seed(1)
    heads, d, length = 2, 8, 12
    q, k, v = (torch.randn(2, heads, length, d, dtype=torch.float64) for _ in range(3))
    ref = x_transformers.CoPE(d, heads, max_positions).double()
    with torch.no_grad():
        ref.pos_emb.normal_(std=1.0)
    ours = relpos.CoPE(d, max_positions).double()
    with torch.no_grad():
        ours.pos_emb.copy_(ref.pos_emb.T[None])  # (npos, d) -> the paper's (1, d, npos)
    sim = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, L, L), masked the way x-transformers' Attend does
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    sim = sim.masked_fill(future, -torch.finfo(sim.dtype).max)
    sim = sim + ref(q, sim)
    expected = sim.softmax(-1) @ v
    got = ours.attention(q, k, v, causal=True)
    assert torch.allclose(got, expected, atol=1e-10)
    assert (oracle(q, k, v, causal=True) - expected).abs().max() > 0.1  # the position term matters


def test_forgetting_gates_equal_x_transformers_data_dependent_alibi():
    torch.manual_seed(2)
    dim, heads, length = 24, 4, 40
    ref = x_transformers.DataDependentAlibi(dim, heads, bias_init=1.0)  # gates near sigmoid(1): a strong decay
    gate = relpos.ForgettingGate(dim, heads)
    with torch.no_grad():
        gate.fgate_proj.weight.copy_(ref.to_forget_gates[0].weight)
        gate.fgate_proj.bias.copy_(ref.to_forget_gates[0].bias)
    x = torch.randn(2, length, dim)
    q, k, v = qkv(b=2, h=heads, lq=length, lk=length, d=16, seed=3)
    expected = oracle(q.double(), k.double(), v.double(), ref(x).double(), causal=True)  # dense (B, H, L, L) bias
    for backend in ("eager", "sdpa", "fused"):
        got = relpos.gated_attention(q, k, v, gate.cumulative(x), causal=True, backend=backend)
        assert torch.allclose(got.double(), expected, atol=2e-5), backend
    assert (oracle(q.double(), k.double(), v.double(), causal=True) - expected).abs().max() > 0.1
