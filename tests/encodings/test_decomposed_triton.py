"""Decomposed 2D positions in the Triton kernel (``impl="triton"``), under Triton's interpreter on CPU tensors:
outputs and every gradient (q, k, v and both position tables, through ``decomposed_terms``) against the dense
fp64 reference, on grids whose key rows span one, two and a partial column block, keys on another grid than the
queries, batch 1; fp16; bad inputs; no (B, H, N, K) tensor. The GPU test at SAM's size: tests/backends/test_triton_gpu.py."""

import pytest
import torch

pytest.importorskip("triton")

from relpos.encodings.decomposed import decomposed_attention, decomposed_terms  # noqa: E402
from operators import LargestTensor  # noqa: E402  (the largest tensor an operator returns)

# the interpreter's tiles are 16 x 16: a key row of 6 fills part of one column block, of 17 one and a single column
CASES = {  # name -> (query grid, key grid, batch, heads, head dim)
    "5x6": ((5, 6), (5, 6), 2, 2, 8),
    "batch of one, 3x3": ((3, 3), (3, 3), 1, 3, 8),
    "rows of 17 keys": ((4, 17), (4, 17), 2, 2, 16),
    "queries 3x4, keys 5x6": ((3, 4), (5, 6), 2, 2, 8),
    "one key row": ((2, 9), (1, 20), 1, 2, 8),
    "16 queries, 15 keys": ((4, 4), (3, 5), 1, 2, 8),  # one query block exactly; keys one short of a block
    "17 queries and keys": ((1, 17), (1, 17), 2, 1, 8),  # one past a query block and a column block
}


def _leaves(q_grid, k_grid, batch, heads, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, keys = q_grid[0] * q_grid[1], k_grid[0] * k_grid[1]
    q = torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, heads, keys, d, generator=g, dtype=torch.float64) for _ in range(2))
    tables = [torch.randn(2 * max(a, b) - 1, d, generator=g, dtype=torch.float64) for a, b in zip(q_grid, k_grid)]
    return [t.to(dtype).requires_grad_() for t in (q, k, v, *tables)]


def _run(impl, q_grid, k_grid, batch, heads, d, dtype):
    leaves = _leaves(q_grid, k_grid, batch, heads, d, dtype)
    rel_h, rel_w = decomposed_terms(leaves[0], leaves[3], leaves[4], q_grid, k_grid)
    out = decomposed_attention(*leaves[:3], rel_h, rel_w, impl=impl)
    weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)  # every output element matters
    return out.detach().double(), [g.double() for g in torch.autograd.grad((out * weights).sum(), leaves)]


def _assert_triton_equals_the_reference(case) -> torch.Tensor:
    """The kernel in fp32 against the fp64 reference: the output and every gradient; returns the reference output."""
    ref, ref_grads = _run("reference", *case, torch.float64)
    out, grads = _run("triton", *case, torch.float32)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    for name, got, want in zip(("q", "k", "v", "rel_pos_h", "rel_pos_w"), grads, ref_grads):
        # one key row: rel_h shifts whole softmax rows, its true gradient is 0 (fp32 sums leave ~1e-6)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * max(1.0, float(want.abs().max())), msg=name)
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_and_every_gradient_equal_the_fp64_reference(case):
    ref = _assert_triton_equals_the_reference(CASES[case])
    leaves = _leaves(*CASES[case], torch.float64)
    plain = torch.softmax(leaves[0] @ leaves[1].transpose(-2, -1) * leaves[0].shape[-1] ** -0.5, -1) @ leaves[2]
    assert (plain.detach() - ref).abs().max() > 0.3  # the positions change the result far beyond the tolerance


@pytest.mark.parametrize("grid", [(9, 40), (3, 64)])
def test_the_gpus_tiles_equal_the_fp64_reference(grid, monkeypatch):
    """The tiles a GPU launches (64 query rows, a column block as wide as a key row up to 64; its warps and stages),
    here under the interpreter: a key row of 40 in one padded column block, of 64 in one whole block; 360 and 192 queries
    cross a partial last query block."""
    from relpos.backends import _triton_decomposed

    monkeypatch.setattr(_triton_decomposed, "INTERPRETED", False)  # the launch options a GPU gets (not 16 x 16)
    assert _triton_decomposed._launch_options(grid[1])["BM"] == 64
    _assert_triton_equals_the_reference((grid, grid, 1, 2, 16))


def test_fp16_within_the_rounding_of_its_inputs():
    ref, ref_grads = _run("reference", (4, 5), (4, 5), 2, 2, 16, torch.float64)
    out, grads = _run("triton", (4, 5), (4, 5), 2, 2, 16, torch.float16)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_never_holds_the_dense_bias():
    grid, batch, heads = (16, 16), 2, 2
    q, k, v, table_h, table_w = _leaves(grid, grid, batch, heads, 16, torch.float32)
    rel_h, rel_w = (t.detach().requires_grad_() for t in decomposed_terms(q, table_h, table_w, grid))
    dense = batch * heads * (grid[0] * grid[1]) ** 2 * 4  # bytes of the fp32 (B, H, N, K) bias
    with LargestTensor() as probe:  # the attention call and its backward (the terms' einsums are not the kernel's)
        decomposed_attention(q, k, v, rel_h, rel_w, impl="triton").sum().backward()
    assert probe.largest_bytes <= dense / 16, (probe.largest_bytes, dense)  # one (B, H, N, d = 16) tensor
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v, rel_h, rel_w))
    with LargestTensor() as probe:
        decomposed_attention(q, k, v, rel_h, rel_w, impl="reference")
    assert probe.largest_bytes >= dense  # the probe sees the reference's dense bias


def test_bad_inputs_are_refused_before_any_launch(monkeypatch):
    q, k, v, table_h, table_w = _leaves((3, 3), (3, 3), 1, 2, 8, torch.float32)
    rel_h, rel_w = decomposed_terms(q, table_h, table_w, (3, 3))
    with pytest.raises(ValueError, match="impl='triton' cannot run this call: its kernel has no dropout; use impl='auto'"):
        decomposed_attention(q, k, v, rel_h, rel_w, impl="triton", dropout_p=0.1)
    with pytest.raises(ValueError, match="takes float16, bfloat16 or float32, got torch.float64"):
        decomposed_attention(*(t.double() for t in (q, k, v, rel_h, rel_w)), impl="triton")
    with pytest.raises(ValueError, match="must share one dtype"):
        decomposed_attention(q, k, v, rel_h.half(), rel_w, impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="only under its interpreter"):
        decomposed_attention(q, k, v, rel_h, rel_w, impl="triton")


@pytest.mark.parametrize("batch,queries", [(0, 9), (2, 0)])
def test_empty_batches_and_no_queries_return_empty_results(batch, queries):
    q = torch.randn(batch, 2, queries, 8, requires_grad=True)
    k, v = (torch.randn(batch, 2, 9, 8, requires_grad=True) for _ in range(2))
    rel_h, rel_w = (torch.randn(batch, 2, queries, 3, requires_grad=True) for _ in range(2))
    out = decomposed_attention(q, k, v, rel_h, rel_w, impl="triton")
    assert out.shape == (batch, 2, queries, 8)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v, rel_h, rel_w))
    assert float(k.grad.abs().sum()) == 0.0  # no query: no gradient reaches the keys
