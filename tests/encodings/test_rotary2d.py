"""2D RoPE: DINOv3 against transformers, axial and mixed against timm's formulas (re-implemented here from
timm/layers/pos_embed_sincos.py, since timm does not import with this CPU torch), at two grid sizes with
prefix tokens left untouched."""

import math

import pytest
import torch

from relpos.encodings.rotary2d import AxialRotary2D, DINOv3Rotary2D, MixedRotary2D

dinov3 = pytest.importorskip("transformers.models.dinov3_vit.modeling_dinov3_vit")

GRIDS = [(4, 6), (7, 5)]
PREFIX = 5  # a class token and four registers, as DINOv3


def _qk(grid, heads=3, d=16, prefix=PREFIX, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = prefix + grid[0] * grid[1]
    return torch.randn(2, heads, n, d, generator=g, dtype=torch.float64), torch.randn(2, heads, n, d, generator=g, dtype=torch.float64)


# --- timm's formulas, written out from its source -----------------------------------------------


def _timm_rot(x):  # interleaved pairs: [-x1, x0, -x3, x2, ...]
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def _timm_cat_embed(grid, dim, temperature=10000.0, ref_feat_shape=None):
    """build_rotary_pos_embed(in_pixels=False): sin, cos (N, dim) for RotaryEmbeddingCat."""
    num_bands = dim // 4
    bands = 1.0 / temperature ** (torch.arange(0, num_bands, 1).float() / num_bands)
    t = [torch.arange(s).float() for s in grid]
    if ref_feat_shape is not None:
        t = [x / f * r for x, f, r in zip(t, grid, ref_feat_shape)]
    pos = torch.stack(torch.meshgrid(t, indexing="ij"), -1).unsqueeze(-1) * bands  # (H, W, 2, d/4)
    n = grid[0] * grid[1]
    return pos.sin().reshape(n, -1).repeat_interleave(2, -1), pos.cos().reshape(n, -1).repeat_interleave(2, -1)


def _timm_mixed_embed(freqs, grid):
    """get_mixed_freqs(freqs (2, H, d/2), t_x, t_y) with t_x the row index (meshgrid 'ij'): sin, cos (H, N, d)."""
    t_x, t_y = (a.flatten().float() for a in torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij"))
    dtype, freqs = freqs.dtype, freqs.float()  # timm computes in fp32
    combined = t_x.unsqueeze(-1) @ freqs[0].unsqueeze(-2) + t_y.unsqueeze(-1) @ freqs[1].unsqueeze(-2)
    return combined.sin().repeat_interleave(2, -1).to(dtype), combined.cos().repeat_interleave(2, -1).to(dtype)


def _apply_with_prefix(x, sin, cos, prefix):
    rotated = x[..., prefix:, :] * cos + _timm_rot(x[..., prefix:, :]) * sin
    return torch.cat([x[..., :prefix, :], rotated], -2)


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", GRIDS)
def test_dinov3_equals_transformers(grid):
    config = dinov3.DINOv3ViTConfig(hidden_size=48, num_attention_heads=3, patch_size=4, image_size=32, num_register_tokens=4)
    reference = dinov3.DINOv3ViTRopePositionEmbedding(config).eval()
    cos, sin = reference(torch.zeros(1, 3, grid[0] * 4, grid[1] * 4))
    q, k = _qk(grid)
    want_q, want_k = dinov3.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    got_q, got_k = DINOv3Rotary2D(16, base=config.rope_theta)(q, k, grid, num_prefix_tokens=PREFIX)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q[..., :PREFIX, :], q[..., :PREFIX, :])  # prefix tokens untouched
    assert (got_q - q).abs().max() > 0.5  # and the patches moved


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("ref", [None, (5, 5)])
def test_axial_equals_timm_formula(grid, ref):
    q, _ = _qk(grid)
    sin, cos = _timm_cat_embed(grid, 16, ref_feat_shape=ref)
    got = AxialRotary2D(16, ref_grid=ref).rotate(q, grid, num_prefix_tokens=PREFIX)
    torch.testing.assert_close(got, _apply_with_prefix(q, sin.double(), cos.double(), PREFIX), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., :PREFIX, :], q[..., :PREFIX, :])
    assert (got - q).abs().max() > 0.5


@pytest.mark.parametrize("grid", GRIDS)
def test_mixed_equals_timm_formula_with_gradients(grid):
    rope = MixedRotary2D(16, num_heads=3, generator=torch.Generator().manual_seed(1)).double()
    q, k = _qk(grid)
    q_rot, k_rot = rope(q, k, grid, num_prefix_tokens=PREFIX)
    sin, cos = _timm_mixed_embed(rope.freqs.detach(), grid)  # (H, N, d)
    torch.testing.assert_close(q_rot, _apply_with_prefix(q, sin, cos, PREFIX), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_rot, _apply_with_prefix(k, sin, cos, PREFIX), rtol=1e-6, atol=1e-6)
    (q_rot * k_rot).sum().backward()
    assert rope.freqs.grad is not None and rope.freqs.grad.abs().max() > 0


def test_mixed_initialisation_follows_the_paper():
    rope = MixedRotary2D(16, num_heads=4, generator=torch.Generator().manual_seed(2))
    fx, fy = rope.freqs.detach()  # (H, d/2)
    magnitude = 10.0 ** -(torch.arange(0, 16, 4).float() / 16)  # (d/4,)
    torch.testing.assert_close(torch.hypot(fx, fy), magnitude.repeat(4, 2))
    first, second = torch.atan2(fy[:, :4], fx[:, :4]), torch.atan2(fy[:, 4:], fx[:, 4:])  # one direction per head
    torch.testing.assert_close(torch.remainder(second - first, 2 * math.pi), torch.full((4, 4), math.pi / 2), rtol=1e-5, atol=1e-5)
    assert first[:, 0].std() > 0.1  # heads point in different directions


@pytest.mark.parametrize("make", [lambda: AxialRotary2D(8), lambda: MixedRotary2D(8, num_heads=2)])
def test_axial_and_mixed_scores_depend_on_the_offset_only(make):
    rope = make().double()
    grid = (5, 6)
    q = torch.randn(8, dtype=torch.float64).expand(2, 30, 8)  # one vector at every patch, each head
    q_rot, k_rot = rope(q[None], q[None], grid)  # (1, 2, N, d)
    scores = q_rot @ k_rot.transpose(-2, -1)  # (1, 2, N, N)
    # patch (1, 1) -> (2, 3) and patch (2, 2) -> (3, 4): the same offset (1, 2)
    torch.testing.assert_close(scores[..., 1 * 6 + 1, 2 * 6 + 3], scores[..., 2 * 6 + 2, 3 * 6 + 4], rtol=1e-5, atol=1e-5)  # fp32 angles
    assert (scores[..., 0, 1] - scores[..., 0, 7]).abs().max() > 1e-3  # other offsets, other scores


def test_bad_inputs():
    for make in (lambda d: AxialRotary2D(d), lambda d: MixedRotary2D(d, 2), lambda d: DINOv3Rotary2D(d)):
        with pytest.raises(ValueError, match="head_dim must be a multiple of 4.*got 7"):
            make(7)
        with pytest.raises(ValueError, match="got 6"):
            make(6)
    q, _ = _qk((4, 6))
    with pytest.raises(ValueError, match=r"5 \+ 4 x 5"):
        AxialRotary2D(16).rotate(q, (4, 5), num_prefix_tokens=PREFIX)
    with pytest.raises(ValueError, match="num_prefix_tokens must be non-negative"):
        AxialRotary2D(16).rotate(q, (4, 6), num_prefix_tokens=-1)
    with pytest.raises(ValueError, match="head_dim=8"):
        AxialRotary2D(8).rotate(q, (4, 6), num_prefix_tokens=PREFIX)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        AxialRotary2D(16).rotate(q.tolist(), (4, 6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [lambda: AxialRotary2D(16), lambda: MixedRotary2D(16, num_heads=3), lambda: DINOv3Rotary2D(16)])
def test_low_precision_inputs_rotate_in_fp32_and_keep_their_dtype(dtype, make):
    """bf16/fp16 in, same dtype out, within one rounding of the fp64 rotation (angles are never rounded to
    the low precision: at grid 7 x 5 a bf16 angle would be off by up to 2^-8 x its size)."""
    rope, grid = make(), (7, 5)
    q, _ = _qk(grid, seed=3)
    want = rope.double().rotate(q, grid, num_prefix_tokens=PREFIX)  # (2, 3, P + N, 16) fp64
    got = rope.float().rotate(q.to(dtype), grid, num_prefix_tokens=PREFIX)
    assert got.dtype == dtype
    rounding = torch.finfo(dtype).eps  # one unit of the low precision, relative
    err = (got.double() - want).abs() / want.abs().clamp_min(1.0)
    # q itself was rounded once (relative eps/2), the rotation adds one more rounding at most per term
    assert err.max() <= 2 * rounding, (err.max(), rounding)
    assert torch.equal(got[..., :PREFIX, :], q[..., :PREFIX, :].to(dtype))


def test_low_precision_dinov3_error_is_no_larger_than_transformers_own():
    config = dinov3.DINOv3ViTConfig(hidden_size=48, num_attention_heads=3, patch_size=4, image_size=32, num_register_tokens=4)
    grid = (7, 5)
    cos, sin = dinov3.DINOv3ViTRopePositionEmbedding(config).eval()(torch.zeros(1, 3, grid[0] * 4, grid[1] * 4))
    q, k = _qk(grid, seed=4)
    exact, _ = dinov3.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    theirs, _ = dinov3.apply_rotary_pos_emb(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16())
    ours, _ = DINOv3Rotary2D(16, base=config.rope_theta)(q.bfloat16(), k.bfloat16(), grid, num_prefix_tokens=PREFIX)
    assert ours.dtype == torch.bfloat16
    assert (ours.double() - exact).abs().max() <= (theirs.double() - exact).abs().max()
