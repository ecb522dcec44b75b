"""MultiheadAttention with every encoding: decoding with a KV cache equals the parallel forward."""

import pytest
import torch

import relpos
from relpos import KVCache, MultiheadAttention, T5Stack

from oracles import assert_bias_matters
from test_mha_matrix import oracle


def encodings(heads=4, head_dim=8):
    return {
        "none": lambda: None,
        "t5": lambda: relpos.RelativePositionalBias(heads, bidirectional=False),
        "clipped": lambda: relpos.ClippedRelativeBias(heads, 3),
        "alibi": lambda: relpos.ALiBi(heads),
        "log_decay": lambda: relpos.LogDecayBias(0.3),
        "rope": lambda: relpos.RotaryEmbedding(head_dim),
        "rope_interleaved": lambda: relpos.RotaryEmbedding(head_dim, interleaved=True),
        "shaw": lambda: relpos.ShawRelativePosition(head_dim, 3, init_std=0.5),
    }


@pytest.mark.parametrize("name", list(encodings()))
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_decode_with_cache_equals_parallel(name, num_kv_heads):
    torch.manual_seed(0)
    position = encodings()[name]()
    for p in [] if position is None else position.parameters():
        torch.nn.init.normal_(p, std=0.5)
    layer = MultiheadAttention(32, 4, position=position, num_kv_heads=num_kv_heads, causal=True)
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        full, _ = layer(x)
        cache = KVCache()
        steps = [layer(x[:, :3], cache=cache)[0]]  # a prompt of 3 tokens, then one token at a time
        for t in range(3, 11):
            steps.append(layer(x[:, t : t + 1], cache=cache)[0])
    assert cache.length == 11
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


@pytest.mark.parametrize("name", list(encodings()))
def test_every_encoding_trains(name):
    torch.manual_seed(0)
    position = encodings()[name]()
    layer = MultiheadAttention(32, 4, position=position, causal=True)
    for p in [] if position is None else position.parameters():
        torch.nn.init.normal_(p, std=1.0)
    x = torch.randn(2, 9, 32)
    layer(x)[0].square().mean().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.backend = "eager"  # the reference path (checked against the fp64 oracle in test_mha_matrix.py)
    layer(x)[0].square().mean().backward()
    for pname, p in layer.named_parameters():
        assert got[pname].abs().sum() > 0 and torch.allclose(got[pname], p.grad, atol=1e-5, rtol=1e-4), pname


def test_cross_attention_and_shared_bias():
    torch.manual_seed(0)
    shared = relpos.RelativePositionalBias(4, init_std=1.5)
    a = MultiheadAttention(32, 4, position=shared)
    b = MultiheadAttention(32, 4, position=shared)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 12, 32)
    out, ob = a(x, memory=memory)
    assert (ob.query_length, ob.key_length) == (5, 12)
    expected = oracle(a, x, memory)  # fp64, bias from the table at explicit j - i, queries at 0.., keys at 0..
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(a, x, memory, with_position=False), 1e-5)
    out2, same = b(x, memory=memory, position_bias=ob)
    assert same is ob
    assert torch.allclose(out2.double(), oracle(b, x, memory), atol=1e-5)  # the handed-on bias is b's own
    assert sum(p.numel() for p in torch.nn.ModuleList([a, b]).parameters()) == 2 * (32 * 96 + 32 * 32) + 32 * 4


def test_rope_cross_attention_positions_start_at_zero():
    torch.manual_seed(0)
    rope = relpos.RotaryEmbedding(8)
    layer = MultiheadAttention(32, 4, position=rope)
    x, memory = torch.randn(1, 3, 32), torch.randn(1, 7, 32)
    out, _ = layer(x, memory=memory)
    expected = oracle(layer, x, memory)  # queries rotated at 0, 1, 2 and keys at 0 .. 6
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(layer, x, memory, with_position=False), 1e-5)
    shifted = oracle(layer, x, memory, q_offset=4)  # queries placed after the memory would differ
    assert (shifted - expected).abs().max() > 1e-3


def test_bad_construction():
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        MultiheadAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="position has head_dim=16, this layer has head_dim=8"):
        MultiheadAttention(32, 4, position=relpos.RotaryEmbedding(16))
    with pytest.raises(TypeError, match="position must be a relpos additive bias"):
        MultiheadAttention(32, 4, position="rope")
    with pytest.raises(ValueError, match="position bias has num_heads=3"):
        MultiheadAttention(32, 4, position=relpos.ALiBi(3))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_t5_decoder_stack_decodes_token_by_token(backend):
    torch.manual_seed(0)
    encoder = T5Stack(2, 32, 4, 64, bidirectional=True, backend=backend)
    decoder = T5Stack(3, 32, 4, 64, bidirectional=False, cross_attention=True, backend=backend)
    assert sum(p.numel() for n, p in decoder.named_parameters() if "relative_attention_bias" in n) == 32 * 4
    src, tgt = torch.randn(2, 9, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        memory = encoder(src)
        full = decoder(tgt, memory=memory)
        caches = decoder.new_caches()
        steps = [decoder(tgt[:, t : t + 1], memory=memory, caches=caches) for t in range(7)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    assert all(self_c.length == 7 and cross_c.length == 9 for self_c, cross_c in caches)  # memory cached once
    with torch.no_grad():  # plain self-attention caches, one per layer, still work
        plain = [KVCache() for _ in decoder.blocks]
        steps = [decoder(tgt[:, t : t + 1], memory=memory, caches=plain) for t in range(7)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    with pytest.raises(ValueError, match="one KVCache per layer"):
        decoder(tgt, memory=memory, caches=caches[:1])


def test_t5_stack_trains_the_shared_table():
    torch.manual_seed(0)
    stack = T5Stack(2, 32, 4, 64, bidirectional=False).double()
    table = stack.relative_bias.relative_attention_bias.weight
    torch.nn.init.normal_(table, std=1.0)
    x, w = torch.randn(2, 16, 32, dtype=torch.float64), torch.randn(2, 16, 32, dtype=torch.float64)
    (stack(x) * w).sum().backward()
    grad = table.grad.clone()
    with torch.no_grad():  # central differences at three table entries, in fp64
        for row, head in ((0, 0), (1, 2), (3, 1)):
            saved, losses = table[row, head].item(), []
            for shift in (1e-6, -1e-6):
                table[row, head] = saved + shift
                losses.append((stack(x) * w).sum().item())
            table[row, head] = saved
            assert grad[row, head].item() == pytest.approx((losses[0] - losses[1]) / 2e-6, rel=1e-5, abs=1e-8)
    assert grad.abs().sum() > 0


def test_cross_attention_cache_holds_the_memory_once():
    torch.manual_seed(0)
    layer = MultiheadAttention(32, 4, position=relpos.RelativePositionalBias(4))
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 10, 32)
    with torch.no_grad():
        full, _ = layer(x, memory=memory)
        cache = KVCache()
        steps = [layer(x[:, t : t + 1], memory=memory, cache=cache, q_offset=t)[0] for t in range(6)]
    assert cache.length == 10  # stored once, not once per step
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
