"""Decomposed 2D relative positions: equal to transformers' SAM / ViTDet formulas, every path equal, no (B, H, N, N)."""

import types

import pytest
import torch
from operators import LargestTensor

import relpos.encodings.decomposed as decomposed
from relpos.backends import _head_dim as head_dim
from relpos.encodings.decomposed import (
    DecomposedRelPos,
    decomposed_attention,
    decomposed_bias,
    decomposed_terms,
    rel_pos_lookup,
    resize_rel_pos,
)

sam = pytest.importorskip("transformers.models.sam.modeling_sam")
vitdet = pytest.importorskip("transformers.models.vitdet.modeling_vitdet")


def _inputs(batch=2, heads=3, grid=(5, 6), d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1]
    q, k, v = (torch.randn(batch, heads, n, d, generator=g, dtype=dtype) for _ in range(3))
    table_h = torch.randn(2 * grid[0] - 1, d, generator=g, dtype=dtype)
    table_w = torch.randn(2 * grid[1] - 1, d, generator=g, dtype=dtype)
    return q, k, v, table_h, table_w


def _oracle_bias(q, table_h, table_w, grid):
    """fp64 loops over the formula: bias[q, k] = q . R_h[y - y' + Sh - 1] + q . R_w[x - x' + Sw - 1]."""
    sh, sw = grid
    bias = torch.zeros(*q.shape[:-1], sh * sw, dtype=torch.float64)
    for i in range(sh * sw):
        for j in range(sh * sw):
            (y, x), (yk, xk) = divmod(i, sw), divmod(j, sw)
            row = table_h[y - yk + sh - 1] + table_w[x - xk + sw - 1]  # (d,)
            bias[..., i, j] = (q[..., i, :].double() * row.double()).sum(-1)
    return bias


@pytest.mark.parametrize("q_size,k_size,length", [(5, 5, 9), (3, 7, 13), (7, 3, 13), (8, 8, 9), (4, 6, 5), (14, 14, 27)])
def test_lookup_equals_sam_and_vitdet(q_size, k_size, length):
    table = torch.randn(length, 4, generator=torch.Generator().manual_seed(1))
    ours = rel_pos_lookup(q_size, k_size, table)
    assert torch.equal(ours, sam.SamVisionAttention.get_rel_pos(None, q_size, k_size, table))
    assert torch.equal(ours, vitdet.get_rel_pos(q_size, k_size, table))


def test_resize_is_linear_interpolation():
    table = torch.tensor([[0.0, 10.0], [4.0, 30.0]])
    assert torch.equal(resize_rel_pos(table, 2), table)
    assert torch.allclose(resize_rel_pos(table, 4), torch.tensor([[0.0, 10.0], [1.0, 15.0], [3.0, 25.0], [4.0, 30.0]]))


@pytest.mark.parametrize("grid", [(5, 6), (4, 4)])
def test_bias_equals_oracle_and_sam(grid):
    q, _, _, table_h, table_w = _inputs(grid=grid)
    rel_h, rel_w = decomposed_terms(q, table_h, table_w, grid)
    ours = decomposed_bias(rel_h, rel_w)  # (B, H, N, N)
    torch.testing.assert_close(ours, _oracle_bias(q, table_h, table_w, grid), rtol=1e-12, atol=1e-12)
    flat = q.flatten(0, 1)  # transformers' (B * H, N, d)
    theirs = _sam_bias(flat, table_h, table_w, grid, grid)
    torch.testing.assert_close(ours.flatten(0, 1), theirs.reshape(flat.shape[0], flat.shape[1], -1), rtol=1e-12, atol=1e-12)
    assert ours.abs().mean() > 1.0  # the tables matter


def _sam_bias(query, table_h, table_w, q_size, k_size):
    """transformers' SamVisionAttention.get_decomposed_rel_pos (it reads only get_rel_pos from self)."""
    owner = types.SimpleNamespace(get_rel_pos=lambda *a: sam.SamVisionAttention.get_rel_pos(None, *a))
    return sam.SamVisionAttention.get_decomposed_rel_pos(owner, query, table_h, table_w, q_size, k_size)


def _weighted_sum(out):
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


BLOCKS = {  # N -> (_FORWARD_ROWS, _FORWARD_ELEMENTS): how the tiles cut a (B=2, H=3, N, N) problem
    "rows": lambda n: (4, 1 << 26),  # blocks of 4 query rows of one example, the last one partial
    "examples": lambda n: (768, 3 * n * n),  # whole examples, one per call
    "batch": lambda n: (768, 1 << 26),  # the whole batch in one call (windowed layers)
}


@pytest.mark.parametrize("impl,blocks", [("tiles", "rows"), ("tiles", "examples"), ("tiles", "batch"), ("fold", "rows"),
                                         ("fold_padded", "rows"), ("tiles_padded", "rows")])
@pytest.mark.parametrize("grid", [(5, 6), (3, 3)])
def test_paths_equal_reference_with_gradients(impl, blocks, grid, monkeypatch):
    """Each path against the dense reference; ``_padded``: the fold's head dim padded with zero channels to a
    multiple of 8, as on CUDA, forced here on the CPU."""
    if impl.endswith("_padded"):
        impl = impl.removesuffix("_padded")
        monkeypatch.setitem(head_dim.MULTIPLE, "cpu", 8)
        widths = []
        real = decomposed._fold_inputs
        monkeypatch.setattr(decomposed, "_fold_inputs", lambda *a: (lambda r: widths.append(r[0].shape[-1]) or r)(real(*a)))
        assert head_dim.fused_head_dim(8 + grid[0] + grid[1], torch.device("cpu")) % 8 == 0
    n = grid[0] * grid[1]
    rows, elements = BLOCKS[blocks](n)
    monkeypatch.setattr(decomposed, "_FORWARD_ROWS", rows)
    monkeypatch.setattr(decomposed, "_FORWARD_ELEMENTS", elements)
    expected = {"rows": 2 * -(-n // 4), "examples": 2, "batch": 1}[blocks]
    assert len(decomposed._forward_blocks(2, 3, n, n)) == expected
    results = {}
    for name in ("reference", impl):
        leaves = [t.requires_grad_() for t in _inputs(grid=grid)]
        q, k, v, table_h, table_w = leaves
        rel_h, rel_w = decomposed_terms(q, table_h, table_w, grid)
        out = decomposed_attention(q, k, v, rel_h, rel_w, impl=name)
        results[name] = (out, torch.autograd.grad(_weighted_sum(out), leaves))
    (ref, ref_grads), (ours, our_grads) = results["reference"], results[impl]
    if head_dim.MULTIPLE.get("cpu"):
        assert widths and all(w % 8 == 0 for w in widths)  # the padded fold ran (forward or backward)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(our_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    q, k, v, *_ = _inputs(grid=grid)
    plain = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1) @ v
    assert (plain - ref).abs().max() > 0.3  # without the positions the result is far from it


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
def test_tiles_low_precision(dtype, tol):
    q, k, v, table_h, table_w = _inputs(grid=(4, 5), dtype=torch.float64)
    rel_h, rel_w = decomposed_terms(q, table_h, table_w, (4, 5))
    cast = [t.to(dtype).requires_grad_() for t in (q, k, v, rel_h, rel_w)]
    ref = decomposed_attention(*(t.detach().double() for t in cast), impl="reference")  # the rounded inputs, fp64
    out = decomposed_attention(*cast, impl="tiles")
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype for t in cast)


@pytest.mark.parametrize("impl", ["tiles", "fold"])
def test_never_holds_the_dense_bias(impl, monkeypatch):
    grid, batch, heads, n = (16, 16), 2, 3, 256
    monkeypatch.setattr(decomposed, "_FORWARD_ROWS", 16)
    leaves = [t.float().requires_grad_() for t in _inputs(batch=batch, heads=heads, grid=grid)]
    dense = batch * heads * n * n
    with LargestTensor() as probe:
        rel_h, rel_w = decomposed_terms(leaves[0], leaves[3], leaves[4], grid)
        out = decomposed_attention(*leaves[:3], rel_h, rel_w, impl=impl)
        out.sum().backward()
    assert probe.largest < dense / 4, (probe.largest, dense)
    with LargestTensor() as probe:
        decomposed_attention(*leaves[:3], rel_h, rel_w, impl="reference")
    assert probe.largest >= dense  # the probe sees the reference's dense tensor


def test_module_loads_sam_weights_and_matches_its_layer():
    config = sam.SamVisionConfig(hidden_size=24, num_attention_heads=3, image_size=40, patch_size=8, use_rel_pos=True)
    layer = sam.SamVisionAttention(config, window_size=0).double()
    with torch.no_grad():
        layer.rel_pos_h.normal_(generator=torch.Generator().manual_seed(2))
        layer.rel_pos_w.normal_(generator=torch.Generator().manual_seed(3))
    pos = DecomposedRelPos(5, head_dim=8, dtype=torch.float64)
    pos.load_state_dict({"rel_pos_h": layer.rel_pos_h, "rel_pos_w": layer.rel_pos_w})
    hidden = torch.randn(2, 5, 5, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    qkv = layer.qkv(hidden).reshape(2, 25, 3, 3, 8).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
    out = pos(qkv[0], qkv[1], qkv[2], (5, 5))  # (B, H, N, d)
    ours = layer.proj(out.permute(0, 2, 1, 3).reshape(2, 5, 5, 24))
    torch.testing.assert_close(ours, layer(hidden)[0], rtol=1e-6, atol=1e-6)  # SAM's softmax runs in fp32


def test_other_grid_resizes_the_tables():
    q, k, v, table_h, table_w = _inputs(grid=(5, 6))
    pos = DecomposedRelPos((3, 4), head_dim=8, dtype=torch.float64)
    with torch.no_grad():
        pos.rel_pos_h.copy_(table_h[:5])
        pos.rel_pos_w.copy_(table_w[:7])
    rel_h, _ = pos.terms(q, (5, 6))  # tables of 5 and 7 rows resized to 9 and 11
    flat = q.flatten(0, 1)
    theirs = _sam_bias(flat, pos.rel_pos_h, pos.rel_pos_w, (5, 6), (5, 6))
    torch.testing.assert_close(decomposed_bias(*pos.terms(q, (5, 6))).flatten(0, 1), theirs.reshape(6, 30, 30))
    assert rel_h.shape == (2, 3, 30, 5)


def test_bad_inputs():
    q, k, v, table_h, table_w = _inputs(grid=(5, 6))
    with pytest.raises(ValueError, match="rel_pos_w must be .*head_dim=8"):
        decomposed_terms(q, table_h, table_w[:, :4], (5, 6))
    with pytest.raises(ValueError, match="q_size 5 x 5 = 25"):
        decomposed_terms(q, table_h, table_w, (5, 5))
    with pytest.raises(TypeError, match="rel_pos_h must be a torch.Tensor"):
        decomposed_terms(q, table_h.tolist(), table_w, (5, 6))
    with pytest.raises(ValueError, match="q_size must be"):
        decomposed_terms(q, table_h, table_w, (5, 6, 1))
    rel_h, rel_w = decomposed_terms(q, table_h, table_w, (5, 6))
    with pytest.raises(ValueError, match="impl must be one of"):
        decomposed_attention(q, k, v, rel_h, rel_w, impl="dense")
    with pytest.raises(ValueError, match="no dropout"):
        decomposed_attention(q, k, v, rel_h, rel_w, impl="tiles", dropout_p=0.1)
    with pytest.raises(ValueError, match="key and value must be .B, H, K, d. with the query's"):
        decomposed_attention(q, k, v[..., :4], rel_h, rel_w)
    with pytest.raises(ValueError, match="must hold the 29 keys"):
        decomposed_attention(q, k[:, :, :29], v[:, :, :29], rel_h, rel_w)
    with pytest.raises(ValueError, match="input_size\\[1\\] must be positive"):
        DecomposedRelPos((3, 0), head_dim=8)


def _graph_names(fn, seen=None):
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return set()
    seen.add(fn)
    names = {type(fn).__name__}
    for child, _ in fn.next_functions:
        names |= _graph_names(child, seen)
    return names


def test_fold_trains_through_sdpa_cpu_flash_backward():
    q, k, v, table_h, table_w = (t.float().requires_grad_() for t in _inputs(grid=(4, 4)))
    rel_h, rel_w = decomposed_terms(q, table_h, table_w, (4, 4))
    out = decomposed_attention(q, k, v, rel_h, rel_w, impl="fold")
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in _graph_names(out.grad_fn)  # not the math kernel


# --- differential fuzzing (tests/fuzz_profiles.py): any grid, every path, against the fp64 formula ---
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_profiles import examples  # noqa: E402


@examples(20, 400)
@given(height=st.integers(1, 7), width=st.integers(1, 7), batch=st.integers(1, 3), heads=st.integers(1, 3),
       impl=st.sampled_from(["auto", "tiles", "fold", "reference"]), seed=st.integers(0, 999))
def test_fuzz_decomposed_attention_equals_the_formula(height, width, batch, heads, impl, seed):
    """Non-square grids (1 x 7 to 7 x 1), batch 1-3: every path's output equals softmax with the bias built from
    the formula by loops in fp64, and the terms equal transformers' SAM formula."""
    grid = (height, width)
    q, k, v, table_h, table_w = _inputs(batch=batch, heads=heads, grid=grid, seed=seed)
    rel_h, rel_w = decomposed_terms(q, table_h, table_w, grid)
    bias = _oracle_bias(q, table_h, table_w, grid)  # (B, H, N, N)
    want = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias, -1) @ v
    torch.testing.assert_close(decomposed_attention(q, k, v, rel_h, rel_w, impl=impl), want, rtol=1e-10, atol=1e-10)
    theirs = _sam_bias(q.flatten(0, 1), table_h, table_w, grid, grid)
    torch.testing.assert_close(decomposed_bias(rel_h, rel_w).flatten(0, 1), theirs.reshape(batch * heads, height * width, -1))
