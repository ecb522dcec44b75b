"""torch.compile(fullgraph=True) of a T5-style stack: forward, decoding with a growing offset, training."""

import torch

from relpos import T5Stack

from oracles import assert_bias_matters


def counting_inductor(counter):
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        counter.append(1)
        return compile_fx(gm, example_inputs)

    return backend


def test_compiled_stack_forward_decode_and_train():
    torch._dynamo.reset()
    torch.manual_seed(0)
    stack = T5Stack(1, 32, 4, 64, bidirectional=False).eval()
    table = stack.relative_bias.relative_attention_bias.weight
    torch.nn.init.normal_(table, std=1.5)
    x = torch.randn(1, 12, 32)
    with torch.no_grad():
        saved = table.clone()
        table.zero_()
        without = stack(x)
        table.copy_(saved)
        assert_bias_matters(stack(x), without, 1e-5)
    graphs = []
    compiled = torch.compile(stack, fullgraph=True, backend=counting_inductor(graphs))
    with torch.no_grad():
        full = compiled(x)
        assert torch.allclose(full, stack(x), atol=1e-5)
        assert len(graphs) == 1
        caches = stack.new_caches()
        steps = [compiled(x[:, t : t + 1], caches=caches) for t in range(12)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    # an empty cache, a cache of length 1 (size-1 dims are always specialised), then one dynamic graph
    assert len(graphs) <= 4, f"decoding compiled {len(graphs) - 1} graphs for 12 steps"

    stack.train()
    graphs.clear()
    trained = torch.compile(stack, fullgraph=True, backend=counting_inductor(graphs))
    trained(x).square().sum().backward()
    compiled_grad = stack.relative_bias.relative_attention_bias.weight.grad.clone()
    stack.zero_grad()
    stack(x).square().sum().backward()
    assert torch.allclose(compiled_grad, stack.relative_bias.relative_attention_bias.weight.grad, atol=1e-5)


def test_compiled_attention_with_a_padding_mask_has_no_data_dependent_branch():
    """A key padding mask (and a fully padded example) under fullgraph: one dense SDPA mask, no graph break."""
    import relpos

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 24, 8) for _ in range(3))
    values = torch.randn(2, 2 * 24 - 1)  # (H, Lq + Lk - 1)
    keep = torch.ones(3, 24, dtype=torch.bool)
    keep[1, 17:] = False  # right padding
    keep[2] = False  # nothing to attend to: zeros

    def run(q, k, v, values, keep):
        return relpos.attention(q, k, v, bias=relpos.OffsetBias(values, 24, 24), key_mask=keep, causal=True)

    compiled = torch.compile(run, fullgraph=True, backend="eager")
    expected = relpos.attention(q, k, v, bias=relpos.OffsetBias(values, 24, 24), key_mask=keep, causal=True, backend="eager")
    got = compiled(q, k, v, values, keep)
    assert torch.allclose(got, expected, atol=1e-5) and torch.equal(got[2], torch.zeros_like(got[2]))
