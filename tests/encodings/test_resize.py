"""resize_bias_table against oracles written from the formulas timm's two functions compute.

* ``"bicubic"`` = timm's ``resize_rel_pos_bias_table_simple``: ``F.interpolate(bicubic,
  align_corners=False)`` on the (2W-1) x (2W-1) offset grid. Oracle: Keys' cubic convolution
  (a = -0.75, PyTorch's), source coordinate ``(i + 0.5) * in / out - 0.5``, border taps clamped,
  in float64 NumPy.
* ``"geometric"`` = timm's ``resize_rel_pos_bias_table`` (BEiT): old offsets on the geometric grid
  ``0, 1, 1 + q, ...`` with ``1 + q + ... + q^(n-1) = new // 2``, read by linear interpolation.
  Oracle: ``q`` from scipy's ``brentq``, values from scipy's ``RegularGridInterpolator``.
"""

import numpy as np
import pytest
import torch

from relpos import RelativePositionBias, resize_bias_table, resize_state_dict, table_size

scipy_interpolate = pytest.importorskip("scipy.interpolate")
scipy_optimize = pytest.importorskip("scipy.optimize")


# --- oracles --------------------------------------------------------------------------------


def _keys(x: np.ndarray, a: float = -0.75) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        src = (i + 0.5) * n_in / n_out - 0.5
        base = int(np.floor(src))
        for tap in range(base - 1, base + 3):
            m[i, min(max(tap, 0), n_in - 1)] += _keys(src - tap)
    return m


def _geometric_points(src: int, dst: int) -> np.ndarray:
    n = src // 2
    gp = lambda q: sum(q**i for i in range(n)) - dst // 2  # noqa: E731
    if gp(1.01) > 0:
        q = 1.01  # the progression cannot be flatter: BEiT's bisection stops at its lower end
    elif gp(1.5) <= 0:
        q = 1.5
    else:
        q = scipy_optimize.brentq(gp, 1.01, 1.5, xtol=1e-12)
    dist = np.cumsum([q**i for i in range(n)])
    return np.concatenate([-dist[::-1], [0.0], dist])


def _oracle(table: np.ndarray, old, new, mode: str, extra: int = 0) -> np.ndarray:
    old, new = tuple(old), tuple(new)
    grid_old = (1, 2 * old[0] - 1) if len(old) == 1 else (2 * old[0] - 1, 2 * old[1] - 1)
    grid_new = (1, 2 * new[0] - 1) if len(new) == 1 else (2 * new[0] - 1, 2 * new[1] - 1)
    body, tail = table[: len(table) - extra], table[len(table) - extra :]
    out = []
    for h in range(table.shape[1]):
        z = body[:, h].reshape(grid_old)
        if mode == "bicubic":
            r = _bicubic_matrix(grid_old[0], grid_new[0]) @ z @ _bicubic_matrix(grid_old[1], grid_new[1]).T
        else:
            ys, xs = _geometric_points(grid_old[0], grid_new[0]), _geometric_points(grid_old[1], grid_new[1])
            ty = np.arange(-(grid_new[0] // 2), grid_new[0] // 2 + 1.0).clip(ys[0], ys[-1])
            tx = np.arange(-(grid_new[1] // 2), grid_new[1] // 2 + 1.0).clip(xs[0], xs[-1])
            if len(ys) == 1:  # a 1D table: one row, interpolate along the columns only
                r = np.interp(tx, xs, z[0])[None]
            else:
                f = scipy_interpolate.RegularGridInterpolator((ys, xs), z, method="linear")
                yy, xx = np.meshgrid(ty, tx, indexing="ij")
                r = f(np.stack([yy, xx], -1))
        out.append(r.reshape(-1))
    return np.concatenate([np.stack(out, 1), tail])


# --- equality with the oracles ----------------------------------------------------------------

SIZES_2D = [((7, 7), (12, 12)), ((7, 7), (14, 14)), ((8, 8), (16, 16)), ((12, 12), (7, 7)), ((4, 6), (6, 9))]
SIZES_1D = [((5,), (9,)), ((9,), (4,))]


@pytest.mark.parametrize("mode", ["bicubic", "geometric"])
@pytest.mark.parametrize("old,new", SIZES_2D + SIZES_1D)
@pytest.mark.parametrize("class_token", [False, True])
def test_resize_equals_oracle(mode, old, new, class_token):
    torch.manual_seed(0)
    extra = 3 if class_token else 0
    table = torch.randn(table_size(old) + extra, 3, dtype=torch.float64)
    out = resize_bias_table(table, old, new, mode=mode)
    expected = _oracle(table.numpy(), old, new, mode, extra)
    assert out.shape == (table_size(new) + extra, 3)
    tol = 1e-10 if mode == "bicubic" else 2e-4  # BEiT stops its bisection for q at 1e-6: the outer offsets move ~1e-5
    np.testing.assert_allclose(out.numpy(), expected, rtol=tol, atol=tol)
    if class_token:
        assert torch.equal(out[-3:], table[-3:])  # class-token rows are kept as they are


def test_geometric_differs_from_bicubic():
    table = torch.randn(table_size((7, 7)), 2, dtype=torch.float64)
    a = resize_bias_table(table, 7, 14, mode="bicubic")
    b = resize_bias_table(table, 7, 14, mode="geometric")
    assert (a - b).abs().max() > 0.1


def test_geometric_keeps_small_offsets_in_place():
    """Offsets 0 and +-1 keep their values: the geometric grid starts 0, 1 like the integer one."""
    table = torch.randn(table_size((7, 7)), 1, dtype=torch.float64)
    grid_old = table[:, 0].view(13, 13)
    grid_new = resize_bias_table(table, 7, 12, mode="geometric")[:, 0].view(23, 23)
    torch.testing.assert_close(grid_new[10:13, 10:13], grid_old[5:8, 5:8])


def test_same_window_is_identity_and_gradients_flow():
    table = torch.randn(table_size((4, 4)), 2, requires_grad=True)
    assert resize_bias_table(table, 4, 4) is table
    resize_bias_table(table, 4, 6).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


def test_float32_in_float32_out():
    table = torch.randn(table_size((3, 3)), 2)
    assert resize_bias_table(table, 3, 5, mode="geometric").dtype == torch.float32


# --- loading checkpoints at another window -------------------------------------------------


def test_resize_state_dict_moves_a_swin_checkpoint_to_a_larger_window():
    transformers = pytest.importorskip("transformers")
    small = transformers.SwinModel(transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=8, depths=[1],
                                                           num_heads=[2], window_size=4))
    large = transformers.SwinModel(transformers.SwinConfig(image_size=48, patch_size=2, embed_dim=8, depths=[1],
                                                           num_heads=[2], window_size=6))
    state = small.state_dict()
    key = next(k for k in state if k.endswith("relative_position_bias_table"))
    state[key] = torch.randn_like(state[key])
    with pytest.raises(RuntimeError, match="size mismatch"):
        large.load_state_dict(state)
    resized = resize_state_dict(state, large, mode="bicubic")
    large.load_state_dict(resized)
    torch.testing.assert_close(large.state_dict()[key], resize_bias_table(state[key], 4, 6))


def test_beit_table_loads_and_resizes_with_class_token_rows():
    transformers = pytest.importorskip("transformers")
    from transformers.models.beit.modeling_beit import BeitRelativePositionBias

    config = transformers.BeitConfig(image_size=8, patch_size=2, num_attention_heads=2)
    theirs = BeitRelativePositionBias(config)
    with torch.no_grad():
        theirs.relative_position_bias_table.normal_()
    ours = RelativePositionBias(2, (4, 4), class_token=True)
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(), theirs((4, 4))[0])  # (H, 17, 17), class token first
    larger = RelativePositionBias(2, (6, 6), class_token=True)
    larger.load_state_dict(resize_state_dict(ours.state_dict(), larger, mode="geometric"))
    assert torch.equal(larger.relative_position_bias_table[-3:], ours.relative_position_bias_table[-3:])


# --- bad input ---------------------------------------------------------------------------------


def test_bad_inputs():
    with pytest.raises(ValueError, match="table has 50 rows, which matches no window 4"):
        resize_bias_table(torch.randn(50, 2), 4, 6)
    with pytest.raises(ValueError, match="mode must be one of"):
        resize_bias_table(torch.randn(49, 2), 4, 6, mode="bilinear")
    with pytest.raises(ValueError, match=r"table must be \(T, H\)"):
        resize_bias_table(torch.randn(49), 4, 6)
    with pytest.raises(TypeError, match="table must be a torch.Tensor"):
        resize_bias_table([[0.0]], 1, 2)
    with pytest.raises(ValueError, match="new_window must have 1 entry"):
        resize_bias_table(torch.randn(7, 2), (4,), (6, 6))
    model = RelativePositionBias(2, (5, 5))
    non_square = {"relative_position_bias_table": torch.randn(table_size((3, 4)), 2)}
    with pytest.raises(ValueError, match="no square window"):
        resize_state_dict(non_square, model)
