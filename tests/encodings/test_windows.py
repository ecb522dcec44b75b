"""Window index tables and windowed bias modules: seed 002's examples, equality with Swin."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relpos import FactorizedRelativePositionBias, RelativePositionBias, table_size, window_relative_position_index

hf_swin = pytest.importorskip("transformers.models.swin.modeling_swin")


# --- seed 002 golden values ------------------------------------------------------------


def test_swin_notes_1d_index():
    assert window_relative_position_index(4).tolist() == [[3, 2, 1, 0], [4, 3, 2, 1], [5, 4, 3, 2], [6, 5, 4, 3]]
    idx = window_relative_position_index(5)
    assert idx.shape == (5, 5) and idx.min() == 0 and idx.max() == 2 * 5 - 2


def test_swin_notes_2d_steps():
    # 3x3 window: 9 positions, index = (dh + 2) * 5 + (dw + 2), d = query - key
    idx = window_relative_position_index((3, 3))
    assert idx.shape == (9, 9)
    assert idx[4, 4] == 12  # centre to itself: offset (0, 0)
    assert idx[0, 8] == 0  # (0,0) to (2,2): offset (-2, -2)
    assert idx[8, 0] == 24  # (2,2) to (0,0): offset (+2, +2)
    assert torch.equal(torch.diagonal(idx), torch.full((9,), 12))


def test_swin_notes_shapes_and_edge_cases():
    rpb = RelativePositionBias(num_heads=4, window_size=(7, 7), bias_type="2d")
    assert rpb().shape == (4, 49, 49)
    asym = RelativePositionBias(num_heads=3, window_size=(4, 8))
    assert asym.relative_position_bias_table.shape == (7 * 15, 3) == (105, 3)
    assert asym().shape == (3, 32, 32)
    single = RelativePositionBias(num_heads=2, window_size=1, bias_type="1d")
    assert single.relative_position_bias_table.shape == (1, 2) and single().shape == (2, 1, 1)
    single2d = RelativePositionBias(num_heads=2, window_size=(1, 1))
    assert single2d().shape == (2, 1, 1)
    one_d = RelativePositionBias(num_heads=2, window_size=5, bias_type="1d")
    assert one_d.relative_position_bias_table.shape == (9, 2) and one_d().shape == (2, 5, 5)


def test_swin_notes_gradient_check():
    rpb = RelativePositionBias(num_heads=4, window_size=(7, 7), bias_type="2d")
    rpb().sum().backward()
    grad = rpb.relative_position_bias_table.grad
    assert grad is not None and torch.isfinite(grad).all()
    # each table row is used by as many pairs as share that offset: (7 - |dh|) * (7 - |dw|)
    dh = torch.arange(-6, 7).repeat_interleave(13)
    dw = torch.arange(-6, 7).repeat(13)
    counts = ((7 - dh.abs()) * (7 - dw.abs())).float()
    assert torch.equal(grad, counts[:, None].expand(-1, 4))


# --- equality with Swin (transformers) --------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(wh=st.integers(1, 12), ww=st.integers(1, 12))
def test_index_equals_swin(wh, ww):
    swin = hf_swin.SwinRelativePositionBias(num_heads=2, window_size=(wh, ww))
    ours = window_relative_position_index((wh, ww))
    assert torch.equal(ours.view(-1), swin.relative_position_index)  # transformers stores it flat
    assert table_size((wh, ww)) == swin.relative_position_bias_table.shape[0]


@pytest.mark.parametrize("window", [(7, 7), (4, 8), (1, 5), (2, 2)])
def test_bias_equals_swin_with_same_table(window):
    torch.manual_seed(0)
    swin = hf_swin.SwinRelativePositionBias(num_heads=3, window_size=window)
    torch.nn.init.normal_(swin.relative_position_bias_table)
    ours = RelativePositionBias(num_heads=3, window_size=window)
    ours.load_state_dict(swin.state_dict())  # same parameter name; the index buffer is not persistent
    assert torch.equal(ours().unsqueeze(0), swin())  # transformers returns (1, H, N, N), seed 002 (H, N, N)


def test_conventions_are_transposes():
    for window in [6, (3, 5)]:
        q_minus_k = window_relative_position_index(window)
        k_minus_q = window_relative_position_index(window, convention="key_minus_query")
        assert torch.equal(k_minus_q, q_minus_k.T)


def test_translation_invariance_2d():
    rpb = RelativePositionBias(num_heads=2, window_size=(4, 5))
    bias = rpb().detach()  # (H, 20, 20)
    coords = [(r, c) for r in range(4) for c in range(5)]
    flat = {rc: k for k, rc in enumerate(coords)}
    # (0,0)->(0,2) equals (2,1)->(2,3): same offset, same bias
    assert torch.equal(bias[:, flat[(0, 0)], flat[(0, 2)]], bias[:, flat[(2, 1)], flat[(2, 3)]])
    assert torch.equal(bias[:, flat[(1, 4)], flat[(0, 3)]], bias[:, flat[(3, 1)], flat[(2, 0)]])


# --- factorized variant (seed 003) ------------------------------------------------------


def test_factorized_equals_naive_sum():
    torch.manual_seed(1)
    fb = FactorizedRelativePositionBias(num_heads=2, window_size=(3, 4))
    got = fb().detach()
    bh, bw = fb.height_bias_table.detach(), fb.width_bias_table.detach()
    coords = [(r, c) for r in range(3) for c in range(4)]
    for p, (pr, pc) in enumerate(coords):
        for q, (qr, qc) in enumerate(coords):
            expected = bh[pr - qr + 2] + bw[pc - qc + 3]
            assert torch.allclose(got[:, p, q], expected)


def test_factorized_is_a_full_table_with_rank_one_structure():
    fb = FactorizedRelativePositionBias(num_heads=1, window_size=(3, 3))
    full = RelativePositionBias(num_heads=1, window_size=(3, 3))
    with torch.no_grad():  # the full table holding b_h[dh] + b_w[dw] gives the same bias
        table = fb.height_bias_table[:, None, :] + fb.width_bias_table[None, :, :]  # (5, 5, H)
        full.relative_position_bias_table.copy_(table.reshape(25, 1))
        assert torch.allclose(full(), fb())


def test_factorized_gradients():
    from oracles import bias_oracle

    fb = FactorizedRelativePositionBias(num_heads=2, window_size=(2, 3))
    weights = torch.randn(2, 6, 6)
    (fb() * weights).sum().backward()
    got = [p.grad.clone() for p in fb.parameters()]
    fb.zero_grad()
    (bias_oracle(fb, 6, 6, grad=True)[0] * weights.double()).sum().backward()  # b[h, p, r] = b_h[dh] + b_w[dw]
    for g, p in zip(got, fb.parameters()):
        assert g.abs().sum() > 0 and torch.allclose(g.double(), p.grad.double(), atol=1e-6)


# --- modules: buffers, dtype, state dict, interface, bad input --------------------------


def test_buffers_non_persistent_and_follow_dtype():
    rpb = RelativePositionBias(num_heads=2, window_size=(3, 3), dtype=torch.float64)
    assert set(rpb.state_dict()) == {"relative_position_bias_table"}
    assert rpb().dtype == torch.float64
    half = rpb.to(torch.bfloat16)
    assert half.relative_position_index.dtype == torch.long and half().dtype == torch.bfloat16
    fb = FactorizedRelativePositionBias(num_heads=2, window_size=3)
    assert set(fb.state_dict()) == {"height_bias_table", "width_bias_table"}


def test_state_dict_round_trip():
    a = RelativePositionBias(num_heads=2, window_size=(3, 4))
    b = RelativePositionBias(num_heads=2, window_size=(3, 4))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(), b())


def test_truncated_normal_init():
    torch.manual_seed(0)
    rpb = RelativePositionBias(num_heads=16, window_size=(12, 12))
    table = rpb.relative_position_bias_table
    assert table.abs().max() <= 0.04 + 1e-7  # cut at 2 std
    assert 0.01 < table.std() < 0.02


def test_materialize_interface():
    rpb = RelativePositionBias(num_heads=2, window_size=(2, 3))
    assert torch.equal(rpb.materialize(6, 6), rpb().unsqueeze(0))
    with pytest.raises(ValueError, match="exactly one window of N=6"):
        rpb.materialize(5, 6)
    with pytest.raises(TypeError, match="not translation invariant"):
        rpb.offsets(6, 6)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(num_heads=0, window_size=7), ValueError, ["num_heads", "positive", "0"]),
        (dict(num_heads=2, window_size=0), ValueError, ["window_size", "positive", "0"]),
        (dict(num_heads=2, window_size=(7, -1)), ValueError, ["window_size[1]", "-1"]),
        (dict(num_heads=2, window_size=(7, 7, 7)), ValueError, ["window_size", "2 entries"]),
        (dict(num_heads=2, window_size=(7, 7), bias_type="1d"), ValueError, ["window_size", "1 entry"]),
        (dict(num_heads=2, window_size=7, bias_type="3d"), ValueError, ["bias_type", "3d", "'2d'"]),
        (dict(num_heads=2, window_size=7.5), TypeError, ["window_size", "int"]),
    ],
)
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc) as info:
        RelativePositionBias(**kwargs)
    for w in words:
        assert w in str(info.value)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(wh=st.integers(1, 6), ww=st.integers(1, 6), ph=st.integers(0, 8), pw=st.integers(0, 8), seed=st.integers(0, 99))
def test_continuous_bias_on_non_square_windows_and_pretrained_windows(wh, ww, ph, pw, seed):
    """Swin V2's continuous bias with a window and a pretrained window of any height and width (0: none) equals
    the formula (tests/oracles.py: offsets over P - 1 per axis, times 8, signed log2, MLP, 16 sigmoid)."""
    from relpos import ContinuousPositionBias

    from oracles import bias_oracle

    torch.manual_seed(seed)
    pretrained = (ph, pw) if ph and pw else 0
    if pretrained and ((ph == 1 and wh > 1) or (pw == 1 and ww > 1)):  # P - 1 = 0: the references divide by zero
        with pytest.raises(ValueError, match="divides the offsets by P - 1 = 0"):
            ContinuousPositionBias(num_heads=3, window_size=(wh, ww), pretrained_window_size=pretrained)
        return
    bias = ContinuousPositionBias(num_heads=3, window_size=(wh, ww), pretrained_window_size=pretrained)
    with torch.no_grad():
        for p in bias.parameters():
            p.normal_()
    n = wh * ww
    torch.testing.assert_close(bias().double(), bias_oracle(bias, n, n)[0], rtol=1e-5, atol=1e-5)
