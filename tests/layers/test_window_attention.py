"""relpos.WindowAttention against transformers' SwinLayer and Swinv2Layer with the same weights.

The weights come in under timm's names (``qkv``, ``proj``, ``relative_position_bias_table``,
``cpb_mlp``, ``q_bias``/``v_bias``, ``logit_scale``), which also tests loading timm state dicts.
Blocks run in float64; the position terms are drawn large so they matter (asserted).
"""

import pytest
import torch
import torch.nn.functional as F

from relpos import (
    ContinuousPositionBias, WindowAttention, projected_window_attention, shift_mask, window_attention, window_merge, window_partition,
)

hf_swin = pytest.importorskip("transformers.models.swin.modeling_swin")
hf_swinv2 = pytest.importorskip("transformers.models.swinv2.modeling_swinv2")
from transformers import SwinConfig, Swinv2Config  # noqa: E402

DIM, HEADS = 16, 2
# (window, resolution): exact tiling, padded (7 -> 8), padded in windows of 3 (10 -> 12), non-square map
CASES = [(4, (8, 8)), (4, (7, 7)), (3, (10, 10)), (2, (6, 5))]


def _swin_layer(window, resolution, shift):
    torch.manual_seed(0)
    config = SwinConfig(embed_dim=DIM, window_size=window)
    config._attn_implementation = "sdpa"  # transformers' eager function takes its softmax in fp32, even for fp64
    layer = hf_swin.SwinLayer(config, DIM, resolution, HEADS, shift_size=shift).double().eval()
    with torch.no_grad():
        layer.attention.relative_position_bias.relative_position_bias_table.normal_()
    return layer


def _swinv2_layer(window, resolution, shift, pretrained=0):
    torch.manual_seed(0)
    config = Swinv2Config(embed_dim=DIM, window_size=window)
    layer = hf_swinv2.Swinv2Layer(config, DIM, resolution, HEADS, shift_size=shift, pretrained_window_size=pretrained)
    layer = layer.double().eval()
    with torch.no_grad():
        for p in layer.attention.self.continuous_position_bias_mlp.parameters():
            p.normal_()
        layer.attention.self.logit_scale.uniform_(1.0, 4.0)
    return layer


def _v1_attention(layer, window, shift) -> WindowAttention:
    """A WindowAttention with SwinLayer's weights, loaded under timm's names."""
    attn = layer.attention
    state = {
        "qkv.weight": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        "qkv.bias": torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
        "proj.weight": attn.o_proj.weight, "proj.bias": attn.o_proj.bias,
        "relative_position_bias_table": attn.relative_position_bias.relative_position_bias_table,
        "relative_position_index": attn.relative_position_bias.relative_position_index,  # older timm stores it
    }
    ours = WindowAttention(DIM, HEADS, window, shift, dtype=torch.float64)
    ours.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    return ours


def _v2_attention(layer, window, shift, pretrained=0) -> WindowAttention:
    self_attn = layer.attention.self
    mlp = self_attn.continuous_position_bias_mlp
    state = {
        "qkv.weight": torch.cat([self_attn.query.weight, self_attn.key.weight, self_attn.value.weight]),
        "q_bias": self_attn.query.bias, "v_bias": self_attn.value.bias, "logit_scale": self_attn.logit_scale,
        "cpb_mlp.0.weight": mlp[0].weight, "cpb_mlp.0.bias": mlp[0].bias, "cpb_mlp.2.weight": mlp[2].weight,
        "proj.weight": layer.attention.output.dense.weight, "proj.bias": layer.attention.output.dense.bias,
    }
    # transformers adds the shift mask twice (-200); Swin V2's paper code adds -100 once
    ours = WindowAttention(DIM, HEADS, window, shift, position_bias="continuous", cosine=True,
                           pretrained_window_size=pretrained, mask_value=-200.0, dtype=torch.float64)
    ours.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    return ours


def _v1_block(layer, attn, x, resolution):
    """SwinLayer's block with our attention: pre-norm residuals."""
    b, _, c = x.shape
    h = attn(layer.layernorm_before(x).view(b, *resolution, c)).reshape(b, -1, c)
    h = x + h
    return h + layer.mlp(layer.layernorm_after(h))


def _v2_block(layer, attn, x, resolution):
    """Swinv2Layer's block with our attention: res-post-norm residuals."""
    b, _, c = x.shape
    h = x + layer.layernorm_before(attn(x.view(b, *resolution, c)).reshape(b, -1, c))
    return h + layer.layernorm_after(layer.output(layer.intermediate(h)))


def _compare(ref_fn, our_fn, params_ref, params_ours, x):
    x_ref = x.clone().requires_grad_()
    x_ours = x.clone().requires_grad_()
    ref, ours = ref_fn(x_ref), our_fn(x_ours)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    g_ref = torch.autograd.grad(ref.square().sum(), [x_ref, *params_ref])
    g_ours = torch.autograd.grad(ours.square().sum(), [x_ours, *params_ours])
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    return ref


@pytest.mark.parametrize("window,resolution,shifted,fused", [(w, r, s, True) for w, r in CASES for s in (False, True)]
                         + [(4, (7, 7), True, False)])  # the eager reference path once: padded and shifted
def test_swin_block_equals_transformers(window, resolution, shifted, fused):
    shift = window // 2 if shifted else 0
    layer = _swin_layer(window, resolution, shift)
    attn = _v1_attention(layer, window, shift)
    attn.fused = fused
    x = torch.randn(2, resolution[0] * resolution[1], DIM, dtype=torch.float64)
    table_ref = layer.attention.relative_position_bias.relative_position_bias_table
    table_ours = attn.position_bias.relative_position_bias_table
    ref = _compare(lambda t: layer(t, resolution)[0], lambda t: _v1_block(layer, attn, t, resolution),
                   [table_ref], [table_ours], x)
    assert layer.shift_size == shift  # transformers kept the shift (resolution larger than the window)
    with torch.no_grad():
        table_ours.zero_()
        assert (_v1_block(layer, attn, x, resolution) - ref).abs().max() > 1e-2  # the bias matters


@pytest.mark.parametrize("window,resolution", CASES)
@pytest.mark.parametrize("shifted", [False, True])
def test_swinv2_block_equals_transformers(window, resolution, shifted):
    shift = window // 2 if shifted else 0
    layer = _swinv2_layer(window, resolution, shift)
    attn = _v2_attention(layer, window, shift)
    x = torch.randn(2, resolution[0] * resolution[1], DIM, dtype=torch.float64)
    mlp_ref = list(layer.attention.self.continuous_position_bias_mlp.parameters()) + [layer.attention.self.logit_scale]
    mlp_ours = list(attn.position_bias.cpb_mlp.parameters()) + [attn.logit_scale]
    ref = _compare(lambda t: layer(t, resolution)[0], lambda t: _v2_block(layer, attn, t, resolution),
                   mlp_ref, mlp_ours, x)
    with torch.no_grad():
        attn.position_bias.cpb_mlp[2].weight.zero_()
        assert (_v2_block(layer, attn, x, resolution) - ref).abs().max() > 1e-2


def test_swinv2_pretrained_window_size():
    """A window of 4 read with an MLP trained at 2 (offsets normalised by 1, log-extrapolated)."""
    layer = _swinv2_layer(4, (8, 8), 2, pretrained=2)
    attn = _v2_attention(layer, 4, 2, pretrained=2)
    x = torch.randn(1, 64, DIM, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(_v2_block(layer, attn, x, (8, 8)), layer(x, (8, 8))[0], rtol=1e-10, atol=1e-10)
    coords = attn.position_bias.relative_coords_table
    assert coords.abs().max() > 1.0  # offsets past the pretrained window: log2(1 + 24) / 3


def test_continuous_bias_loads_transformers_names():
    layer = _swinv2_layer(3, (6, 6), 0)
    self_attn = layer.attention.self
    cpb = ContinuousPositionBias(HEADS, 3, dtype=torch.float64)
    state = {k: v for k, v in self_attn.state_dict().items() if k.startswith("continuous_position_bias_mlp.")}
    state["relative_coords_table"] = self_attn.relative_coords_table  # older checkpoints store the buffers
    cpb.load_state_dict(state)
    table = 16 * torch.sigmoid(self_attn.continuous_position_bias_mlp(self_attn.relative_coords_table).view(-1, HEADS))
    expected = table[self_attn.relative_position_index.view(-1)].view(9, 9, HEADS).permute(2, 0, 1)
    torch.testing.assert_close(cpb(), expected)


# --- the pieces ---------------------------------------------------------------------------


def test_partition_merge_round_trip_and_transformers_order():
    x = torch.randn(2, 6, 8, 3)
    windows = window_partition(x, (3, 4))  # (B, nW, N, C)
    assert windows.shape == (2, 4, 12, 3)
    assert torch.equal(window_merge(windows, (3, 4), 6, 8), x)
    x_sq = torch.randn(2, 8, 8, 3)
    hf = hf_swin.window_partition(x_sq, 4).view(2, 4, 16, 3)
    assert torch.equal(window_partition(x_sq, (4, 4)), hf)


@pytest.mark.parametrize("size,window,shift", [(8, 4, 2), (12, 3, 1), (6, 2, 1)])
def test_shift_mask_equals_swins(size, window, shift):
    config = SwinConfig(window_size=window)
    layer = hf_swin.SwinLayer(config, DIM, (size, size), HEADS, shift_size=shift)
    ref = layer.get_attn_mask(size, size, torch.float32, torch.device("cpu"))
    assert torch.equal(shift_mask(size, size, window, shift), ref)
    assert (ref != 0).any()


def test_shift_mask_by_hand():
    # 2x4 map, 2x2 windows, shift 1: window 1 holds columns 2, 3 of which column 3 came from the left border
    mask = shift_mask(2, 4, 2, 1, mask_value=-1.0)
    assert mask.shape == (2, 4, 4)
    # window 0: rows 0, 1, columns 0, 1: row 1 is the wrapped border row (region 2), row 0 region 1
    assert mask[0].tolist() == [[0, 0, -1, -1], [0, 0, -1, -1], [-1, -1, 0, 0], [-1, -1, 0, 0]]


def test_window_attention_never_expands_the_bias_per_example():
    """No op of the forward makes a (B, nW, H, N, N) tensor: the kernel gets the (nW, H, N, N) bias once per
    image (a bias shared by all windows: one call over every window), never a copy per example."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen, sizes = [], []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
                seen.append(tuple(kwargs["attn_mask"].shape))
            out = func(*args, **kwargs)
            sizes.extend(t.numel() for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))
            return out

    b, nw, h, n, d = 5, 4, 2, 9, 8
    q, k, v = (torch.randn(b, nw, h, n, d) for _ in range(3))
    bias = torch.randn(nw, h, n, n)
    with Spy():
        out = window_attention(q, k, v, bias)
    assert seen == [(nw, h, n, n)] * b
    assert max(sizes) < b * nw * h * n * n
    seen.clear()
    with Spy():
        window_attention(q, k, v, bias[:1])
    assert seen == [(1, h, n, n)]
    ref = torch.softmax(q @ k.transpose(-1, -2) / d**0.5 + bias, -1) @ v
    torch.testing.assert_close(out, ref)


def test_window_attention_gradients_match_reference_float32():
    q, k, v = (torch.randn(3, 4, 2, 16, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(4, 2, 16, 16, requires_grad=True)
    grads = []
    for fused in (True, False):
        out = window_attention(q, k, v, bias, fused=fused)
        grads.append(torch.autograd.grad(out.square().sum(), [q, k, v, bias]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_cosine_attention_clamps_the_logit_scale():
    attn = WindowAttention(8, 2, 2, position_bias="none", cosine=True, dtype=torch.float64)
    with torch.no_grad():
        attn.logit_scale.fill_(10.0)  # exp(10) clamps to 100
    x = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    q, k, v, cosine_scale = attn.project(window_partition(x, (2, 2)))
    torch.testing.assert_close(cosine_scale, torch.full((2,), 100.0, dtype=torch.float64))
    cos = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)  # (1, 1, 2, 4, 4)
    expected = torch.softmax(100.0 * cos, -1) @ v
    for fused in (True, False):
        torch.testing.assert_close(window_attention(q, k, v, cosine_scale=cosine_scale, fused=fused), expected)


def test_bad_inputs():
    with pytest.raises(ValueError, match="shift_size must be smaller than the window"):
        WindowAttention(8, 2, 4, 4)
    with pytest.raises(ValueError, match="dim must be a multiple of num_heads"):
        WindowAttention(9, 2, 4)
    with pytest.raises(ValueError, match="position_bias must be one of"):
        WindowAttention(8, 2, 4, position_bias="rope")
    with pytest.raises(ValueError, match=r"x must be \(B, Hf, Wf, C=8\)"):
        WindowAttention(8, 2, 4)(torch.randn(1, 16, 8))
    with pytest.raises(ValueError, match="bias must be"):
        window_attention(*(torch.randn(1, 2, 2, 4, 8) for _ in range(3)), torch.randn(3, 2, 4, 4))
    with pytest.raises(ValueError, match="pretrained_window_size"):
        ContinuousPositionBias(2, 4, pretrained_window_size=(4, -1))


def test_shifted_windows_without_a_position_bias():
    """position_bias="none" with a shift: the shift mask alone, as a zero table would give (found by the timm test)."""
    torch.manual_seed(0)
    plain = WindowAttention(16, 2, 4, 2, position_bias="none").double()
    zero_table = WindowAttention(16, 2, 4, 2, position_bias="table").double()
    zero_table.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        zero_table.position_bias.relative_position_bias_table.zero_()
    x = torch.randn(2, 8, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(plain(x), zero_table(x), rtol=1e-12, atol=1e-12)
    unshifted = WindowAttention(16, 2, 4, 0, position_bias="none").double()
    unshifted.load_state_dict(plain.state_dict())
    assert (unshifted(x) - plain(x)).abs().max() > 1e-2  # the shift mask matters here


def _views_of_projections(b, nw, h, n, d, dtype=torch.float64, seed=0, edit=None):
    """q, k, v as the Swin adapters make them: (B, nW, H, N, d) views of one (B, nW, N, 3C) projection."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, nw, n, 3, h, d, generator=g, dtype=dtype)
    if edit is not None:
        edit(qkv)
    qkv.requires_grad_()
    return qkv, qkv.permute(3, 0, 1, 4, 2, 5).unbind(0)


@pytest.mark.parametrize("per_window", [False, True])
@pytest.mark.parametrize("cosine", [False, True])
def test_fused_equals_reference_on_projection_views(per_window, cosine):
    """Outputs and gradients (q, k, v through their projection, bias, cosine scale) of the fused path
    equal the eager formula in fp64, with more groups than one backward chunk holds."""
    import relpos.layers.window_attention as wa

    b, nw, h, n, d = 3, 4, 2, 16, 8
    qkv, (q, k, v) = _views_of_projections(b, nw, h, n, d)
    g = torch.Generator().manual_seed(1)
    bias = (4 * torch.randn(nw if per_window else 1, h, n, n, generator=g, dtype=torch.float64)).requires_grad_()
    cosine_scale = torch.tensor([3.0, 25.0], dtype=torch.float64, requires_grad=True) if cosine else None
    results = []
    for fused in (True, False):
        out = window_attention(q, k, v, bias, cosine_scale=cosine_scale, fused=fused)  # (B, nW, H, N, d)
        wanted = [qkv, bias] + ([cosine_scale] if cosine else [])
        results.append((out, torch.autograd.grad((out * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum(), wanted)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)
    assert (out - window_attention(q, k, v, None, cosine_scale=cosine_scale, fused=False)).abs().max() > 0.1  # the bias matters
    old = wa._CHUNK_SCORES
    try:  # one group per backward chunk: the chunked backward gives the same gradients
        wa._CHUNK_SCORES = 1
        chunked = torch.autograd.grad((window_attention(q, k, v, bias, cosine_scale=cosine_scale)
                                       * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum(), wanted)
    finally:
        wa._CHUNK_SCORES = old
    for a, r in zip(chunked, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


def test_cosine_attention_of_a_zero_vector_follows_normalize():
    """A zero (or tiny) q row: F.normalize's eps decides the value and the gradient; the fused path agrees."""
    def edit(qkv):
        qkv[0, 0, 1, 0, 1].zero_()  # q of window 0, token 1, head 1
        qkv[0, 1, 2, 1, 0].mul_(1e-14)  # k of window 1, token 2, head 0: below the eps

    qkv, (q, k, v) = _views_of_projections(1, 2, 2, 4, 8, edit=edit)
    scale = torch.tensor([5.0, 9.0], dtype=torch.float64, requires_grad=True)
    grads = []
    for fused in (True, False):
        out = window_attention(q, k, v, cosine_scale=scale, fused=fused)
        grads.append(torch.autograd.grad(out.sin().sum(), [qkv, scale]))
    for a, r in zip(*grads):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


def test_fused_path_keeps_only_its_inputs():
    """For the backward the fused path keeps q, k, v as given (the projection: no copies), the bias and
    the norms of q and k (a d-th of their size): no normalised q/k, no folded copies, no output."""
    b, nw, h, n, d = 2, 4, 2, 16, 8
    qkv, (q, k, v) = _views_of_projections(b, nw, h, n, d, dtype=torch.float32)
    bias = torch.randn(nw, h, n, n)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = window_attention(q, k, v, bias, cosine_scale=torch.full((h,), 10.0))
        flat = out.transpose(2, 3).flatten(3)  # (B, nW, N, C): what the output projection reads
    assert flat.data_ptr() == out.data_ptr() and flat.is_contiguous()  # a view: no copy for the projection
    token = b * nw * n * h * d * 4
    assert qkv.untyped_storage().data_ptr() in saved
    norms = 2 * b * nw * h * n * 4
    assert sum(saved.values()) <= 3 * token + bias.numel() * 4 + norms + 64


@pytest.mark.parametrize("per_window,cosine,stacked", [(False, False, False), (True, True, False), (True, False, True),
                                                       (False, True, True)])
def test_projected_window_attention_equals_projecting_first(per_window, cosine, stacked, monkeypatch):
    """The projections inside the fused function (recomputed in its backward; as one matmul with the
    weights stacked, or three): outputs and gradients of x, every weight and bias, the bias and the
    cosine scale equal projecting with autograd first (fp64)."""
    import relpos.layers.window_attention as wa

    monkeypatch.setattr(wa, "_STACK_ROWS_PER_CHANNEL", 0 if stacked else 10**9)
    b, nw, n, c, h = 2, 4, 9, 12, 3
    g = torch.Generator().manual_seed(2)
    x = torch.randn(b, nw, n, c, generator=g, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(c, c, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    biases = [torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True), None,
              torch.randn(c, generator=g, dtype=torch.float64, requires_grad=True)]  # Swin V2: no k bias
    bias = (3 * torch.randn(nw if per_window else 1, h, n, n, generator=g, dtype=torch.float64)).requires_grad_()
    cosine_scale = torch.tensor([2.0, 9.0, 30.0], dtype=torch.float64, requires_grad=True) if cosine else None
    leaves = [x, *weights, biases[0], biases[2], bias] + ([cosine_scale] if cosine else [])
    probe = torch.randn(b, nw, n, c, generator=g, dtype=torch.float64)
    ours = projected_window_attention(x, weights, biases, bias, heads=h, cosine_scale=cosine_scale)  # (B, nW, N, C)
    q, k, v = (F.linear(x, w, bb).view(b, nw, n, h, -1).transpose(2, 3) for w, bb in zip(weights, biases))
    ref = window_attention(q, k, v, bias, cosine_scale=cosine_scale, fused=False).transpose(2, 3).flatten(3)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    for a, r in zip(torch.autograd.grad((ours * probe).sum(), leaves), torch.autograd.grad((ref * probe).sum(), leaves)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


def test_projected_window_attention_keeps_only_its_input():
    b, nw, n, c, h = 2, 4, 16, 8, 2
    x = torch.randn(b, nw, n, c, requires_grad=True)
    weights, biases = [torch.randn(c, c, requires_grad=True) for _ in range(3)], [None] * 3
    saved = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t, lambda t: t):
        projected_window_attention(x, weights, biases, torch.randn(nw, h, n, n), heads=h, cosine_scale=torch.ones(h))
    params = sum(w.numel() * 4 for w in weights) + nw * h * n * n * 4 + h * 4
    assert x.untyped_storage().data_ptr() in saved
    norms = 2 * b * nw * h * n * 4  # of q and k: (B, nW, H, N, 1)
    assert sum(saved.values()) <= x.numel() * 4 + params + norms + 64  # no q, k, v, no output, no probabilities


def test_projected_window_attention_bad_inputs():
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"weights\[k\] must be \(C', C\) with C = 8 and C' a multiple of heads = 3"):
        projected_window_attention(x, [torch.randn(9, 8), torch.randn(8, 8), torch.randn(9, 8)], [None] * 3, heads=3)
    with pytest.raises(ValueError, match=r"biases\[v\] must be None or \(8,\)"):
        projected_window_attention(x, [torch.randn(8, 8)] * 3, [None, None, torch.randn(4)], heads=2)
    with pytest.raises(TypeError, match="sequences of three"):
        projected_window_attention(x, torch.randn(3, 8, 8), [None] * 3, heads=2)
    with pytest.raises(ValueError, match="scale must be None with cosine_scale"):
        projected_window_attention(x, [torch.randn(8, 8)] * 3, [None] * 3, heads=2, scale=0.5, cosine_scale=torch.ones(2))


# --- differential fuzzing: non-square maps, every window, shift and pretrained window (tests/fuzz_profiles.py) ---
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzz_profiles import examples  # noqa: E402


@examples(25, 400)
@given(window=st.integers(2, 5), height=st.integers(1, 13), width=st.integers(1, 13), shifted=st.booleans(),
       batch=st.integers(1, 3), v2=st.booleans(), pretrained=st.sampled_from([0, 3, 8]), seed=st.integers(0, 99))
def test_fuzz_window_attention_equals_transformers(window, height, width, shifted, batch, v2, pretrained, seed):
    """Maps of any height and width (padded to the window, non-square), shifted or not, Swin V1 and V2 (with a
    pretrained window): the block's output and every gradient equal transformers' in fp64. Maps no larger than
    the window are left out: transformers then shrinks the layer's window but not its attention's bias table
    and fails with a shape error of its own."""
    assume(min(height, width) > window)
    resolution = (height, width)
    shift = window // 2 if shifted else 0
    if v2:
        layer = _swinv2_layer(window, resolution, shift, pretrained)
        attn = _v2_attention(layer, layer.window_size, layer.shift_size, pretrained)
        params_ref = list(layer.attention.self.continuous_position_bias_mlp.parameters()) + [layer.attention.self.logit_scale]
        params_ours = list(attn.position_bias.cpb_mlp.parameters()) + [attn.logit_scale]
        block = _v2_block
    else:
        layer = _swin_layer(window, resolution, shift)
        attn = _v1_attention(layer, layer.window_size, layer.shift_size)
        params_ref = [layer.attention.relative_position_bias.relative_position_bias_table]
        params_ours = [attn.position_bias.relative_position_bias_table]
        block = _v1_block
    x = torch.randn(batch, height * width, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    _compare(lambda t: layer(t, resolution)[0], lambda t: block(layer, attn, t, resolution), params_ref, params_ours, x)


@pytest.mark.parametrize("per_window", [False, True])
@pytest.mark.parametrize("cosine", [False, True])
def test_the_sdpa_route_equals_reference(per_window, cosine, monkeypatch):
    """Off the CPU's fused path (on CUDA) window attention is one SDPA call, windows x heads as SDPA's heads and the
    bias a (1, nW H, N, N) mask broadcast over the batch: forced here on the CPU (fp64, through the projected and
    the plain entry points), outputs and gradients (q, k, v through their projection, the bias, the cosine scale)
    equal the eager formula."""
    import relpos.layers.window_attention as wa

    monkeypatch.setattr(wa, "SDPA_DEVICES", {"cpu"})
    monkeypatch.setattr(wa, "_fusable", lambda *a: False)
    calls = []
    real = wa._sdpa_windows
    monkeypatch.setattr(wa, "_sdpa_windows", lambda *a: calls.append(a[0].shape) or real(*a))
    b, nw, h, n, d = 3, 4, 2, 16, 8
    qkv, (q, k, v) = _views_of_projections(b, nw, h, n, d)
    g = torch.Generator().manual_seed(1)
    bias = (4 * torch.randn(nw if per_window else 1, h, n, n, generator=g, dtype=torch.float64)).requires_grad_()
    cosine_scale = torch.tensor([3.0, 25.0], dtype=torch.float64, requires_grad=True) if cosine else None
    wanted = [qkv, bias] + ([cosine_scale] if cosine else [])
    results = []
    for fused in (True, False):  # fused=True takes the SDPA route here; False the eager reference
        out = window_attention(q, k, v, bias, cosine_scale=cosine_scale, fused=fused)  # (B, nW, H, N, d)
        results.append((out, torch.autograd.grad((out * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum(), wanted)))
    assert calls == [(b, nw, h, n, d)]
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)
    assert (ref - window_attention(q, k, v, None, cosine_scale=cosine_scale, fused=False)).abs().max() > 0.1
