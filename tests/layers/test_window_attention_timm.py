"""relpos.WindowAttention against timm's Swin and Swin V2 window attention with timm's own weights.

Run where timm installs (see tests/conftest.py). timm's module takes windows already partitioned and
the shift mask from the caller, so the reference here shifts, partitions, masks and merges with
timm's own helpers and a shift mask written from Swin's region rule; relpos does all of it itself.
tests/layers/test_window_attention.py checks the same blocks against transformers (CI runs those).
"""

import inspect

import pytest
import torch

from relpos import WindowAttention

try:
    from timm.models import swin_transformer as timm_v1
    from timm.models import swin_transformer_v2 as timm_v2
except Exception:  # timm missing, or its torchvision does not match this torch
    timm_v1 = timm_v2 = None

pytestmark = [
    pytest.mark.timm,
    pytest.mark.skipif(timm_v1 is None, reason="timm does not import here"),
]

DIM, HEADS = 32, 4


def swin_shift_mask(size: int, window: int, shift: int) -> torch.Tensor:
    """(nW, N, N): -100 between tokens from different regions of the shifted map (Swin's rule), else 0."""
    labels = torch.zeros(size, size)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for n, (rows, cols) in enumerate((r, c) for r in bounds for c in bounds):
        labels[rows, cols] = n
    windows = labels.view(size // window, window, size // window, window).permute(0, 2, 1, 3).reshape(-1, window * window)
    differ = windows[:, :, None] != windows[:, None, :]  # (nW, N, N)
    return torch.zeros(differ.shape).masked_fill(differ, -100.0)


def timm_windows(attention, x: torch.Tensor, window: int, shift: int, module) -> torch.Tensor:
    """timm's path: roll, partition, attention with the mask, merge, roll back. x: (B, S, S, C)."""
    batch, size, _, channels = x.shape
    shifted = torch.roll(x, (-shift, -shift), (1, 2)) if shift else x
    windows = module.window_partition(shifted, (window, window)).view(-1, window * window, channels)  # (B nW, N, C)
    mask = swin_shift_mask(size, window, shift).to(x) if shift else None
    out = attention(windows, mask=mask).view(-1, window, window, channels)
    if len(inspect.signature(module.window_reverse).parameters) == 4:  # (windows, window_size, H, W)
        merged = module.window_reverse(out, (window, window), size, size)  # (B, S, S, C)
    else:  # Swin V2: (windows, window_size, img_size)
        merged = module.window_reverse(out, (window, window), (size, size))  # (B, S, S, C)
    return torch.roll(merged, (shift, shift), (1, 2)) if shift else merged


def load_timm(ours: WindowAttention, theirs: torch.nn.Module) -> None:
    """timm's state dict under timm's names; buffers relpos rebuilds itself may be left over."""
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert not missing, missing
    assert set(unexpected) <= {"relative_position_index", "relative_coords_table", "k_bias"}, unexpected


def randomize(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "relative_position_bias_table" in name or "cpb_mlp" in name or name.endswith("_bias"):
                p.normal_()


@pytest.mark.parametrize("window,shift", [(4, 0), (4, 2), (7, 3), (8, 4)])
def test_swin_v1_window_attention_equals_timm(window, shift):
    torch.manual_seed(0)
    theirs = timm_v1.WindowAttention(dim=DIM, num_heads=HEADS, window_size=(window, window)).double().eval()
    randomize(theirs)
    ours = WindowAttention(DIM, HEADS, window, shift, position_bias="table").double().eval()
    load_timm(ours, theirs)
    x = torch.randn(2, 2 * window, 2 * window, DIM, dtype=torch.float64, requires_grad=True)
    expected = timm_windows(theirs, x, window, shift, timm_v1)
    out = ours(x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    g_expected = torch.autograd.grad(expected.square().sum(), [x, *theirs.parameters()])
    g_out = torch.autograd.grad(out.square().sum(), [x, *ours.parameters()])
    assert len(g_out) == len(g_expected)
    for a, b in zip(sorted(g_out, key=lambda t: t.shape), sorted(g_expected, key=lambda t: t.shape)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("window,shift,pretrained", [(4, 0, 0), (4, 2, 0), (8, 4, 0), (8, 4, 4), (12, 6, 8)])
def test_swin_v2_window_attention_equals_timm(window, shift, pretrained):
    torch.manual_seed(0)
    theirs = timm_v2.WindowAttention(dim=DIM, window_size=(window, window), num_heads=HEADS,
                                     pretrained_window_size=(pretrained, pretrained)).double().eval()
    randomize(theirs)
    ours = WindowAttention(DIM, HEADS, window, shift, position_bias="continuous", cosine=True,
                           pretrained_window_size=pretrained).double().eval()
    load_timm(ours, theirs)
    x = torch.randn(2, 2 * window, 2 * window, DIM, dtype=torch.float64)
    with torch.no_grad():
        expected = timm_windows(theirs, x, window, shift, timm_v2)
        out = ours(x)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    without_position = WindowAttention(DIM, HEADS, window, shift, position_bias="none", cosine=True).double().eval()
    without_position.load_state_dict(
        {k: v for k, v in theirs.state_dict().items() if not k.startswith(("cpb_mlp", "relative_"))}, strict=False)
    with torch.no_grad():
        assert (without_position(x) - out).abs().max() > 1e-2  # the continuous bias matters here
