"""CoPE (Golovneva et al. 2024): contextual positions, eager, against the paper's algorithm in fp64."""

import math

import pytest
import torch

from relpos import CoPE, MultiheadAttention

from oracles import decode_matches_parallel, oracle, padding_mask, qkv


def paper_cope(q, k, v, pos_emb, *, causal, q_offset, key_mask=None):
    """fp64, term by term: gates g_it = sigmoid(q_i k_t / sqrt(d)) on visible keys, p_ij = sum_{t >= j} g_it,
    e[p] interpolated between floor and ceil, logits += q_i . e[p_ij]."""
    q, k, v, e = q.double(), k.double(), v.double(), pos_emb.double()[0]  # e: (d, npos)
    b, h, lq, d = q.shape
    lk, npos = k.shape[2], e.shape[1]
    logits = torch.full((b, h, lq, lk), float("-inf"), dtype=torch.float64)
    for r in range(lq):
        i = q_offset + r
        visible = [t for t in range(lk) if (not causal or t <= i)]
        for bb in range(b):
            seen = [t for t in visible if key_mask is None or key_mask[bb, t]]
            for hh in range(h):
                s = {t: float(q[bb, hh, r] @ k[bb, hh, t]) / math.sqrt(d) for t in seen}
                for j in seen:
                    p = min(sum(1 / (1 + math.exp(-s[t])) for t in seen if t >= j), npos - 1)
                    lo, hi = math.floor(p), math.ceil(p)
                    w = p - lo
                    pos_logit = w * float(q[bb, hh, r] @ e[:, hi]) + (1 - w) * float(q[bb, hh, r] @ e[:, lo])
                    logits[bb, hh, r, j] = s[j] + pos_logit
    weights = torch.softmax(logits, -1).nan_to_num(0.0)
    return weights @ v


@pytest.mark.parametrize("lq, lk, causal, q_offset, padded", [
    (6, 6, True, 0, False), (6, 6, False, 0, False), (6, 6, True, 0, True), (1, 6, True, 5, False), (3, 6, True, 3, True),
])
def test_equals_the_papers_algorithm(lq, lk, causal, q_offset, padded):
    torch.manual_seed(0)
    cope = CoPE(8, max_positions=4, init_std=1.0)  # few positions: the clamp at npos - 1 is exercised
    q, k, v = qkv(lq=lq, lk=lk, d=8)
    key_mask = padding_mask(2, lk) if padded else None
    out = cope.attention(q, k, v, causal=causal, key_mask=key_mask, q_offset=q_offset)
    expected = paper_cope(q, k, v, cope.pos_emb.detach(), causal=causal, q_offset=q_offset, key_mask=key_mask)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert (oracle(q, k, v, causal=causal, q_offset=q_offset, key_mask=key_mask) - expected).abs().max() > 0.05


def test_gradcheck_fp64():
    torch.manual_seed(0)
    cope = CoPE(4, max_positions=8, init_std=1.0).double()
    q, k, v = (t.double().requires_grad_() for t in qkv(b=1, h=2, lq=4, lk=4, d=4, seed=2))
    pos_emb = cope.pos_emb.detach().clone().requires_grad_()
    run = lambda q, k, v, e: torch.func.functional_call(cope, {"pos_emb": e}, (q, k, v), {"causal": True})  # noqa: E731

    assert torch.autograd.gradcheck(run, (q, k, v, pos_emb))


def test_decode_equals_parallel():
    torch.manual_seed(0)
    full = decode_matches_parallel(CoPE(8, max_positions=16, init_std=1.0))
    assert (full - decode_matches_parallel(None)).abs().max() > 0.01


def test_layer_with_padding_trains_pos_emb():
    layer = MultiheadAttention(32, 4, position=CoPE(8, max_positions=16), causal=True)
    layer(torch.randn(2, 10, 32), key_mask=padding_mask(2, 10))[0].square().sum().backward()
    assert layer.position.pos_emb.grad.abs().max() > 0  # zero-initialised like the paper's code, still trained
    with pytest.raises(ValueError, match="CoPE layers take key_mask="):
        layer(torch.randn(2, 10, 32), attn_mask=torch.ones(10, 10, dtype=torch.bool))


def test_bad_inputs():
    with pytest.raises(ValueError, match="max_positions must be positive"):
        CoPE(8, 0)
    with pytest.raises(ValueError, match="init_std must be a finite number > 0"):
        CoPE(8, 4, init_std=-1.0)
    q, k, v = qkv(d=8)
    with pytest.raises(ValueError, match="head_dim=4"):
        CoPE(4, 8).attention(q, k, v)
    with pytest.raises(ValueError, match="position has head_dim=4, this layer has head_dim=8"):
        MultiheadAttention(32, 4, position=CoPE(4, 8))
    with pytest.raises(ValueError, match="dropout must be 0 with a CoPE position"):
        MultiheadAttention(32, 4, position=CoPE(8, 8), dropout=0.1)
