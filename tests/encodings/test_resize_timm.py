"""resize_bias_table against timm's own two functions (run where timm installs; see tests/conftest.py).

``mode="bicubic"`` is timm's ``resize_rel_pos_bias_table_simple`` and ``mode="geometric"`` its
``resize_rel_pos_bias_table`` (BEiT's interpolation on a geometric grid). timm takes square 2D windows
and a flat ``(num_pos, H)`` table whose extra rows (a class token's three) it keeps; tests/encodings/
test_resize.py checks the same computations, 1D and non-square windows included, against oracles
written from the formulas, which CI runs.
"""

import pytest
import torch

from relpos import resize_bias_table, table_size

try:
    from timm.layers import resize_rel_pos_bias_table, resize_rel_pos_bias_table_simple
except Exception:  # timm missing, or its torchvision does not match this torch
    resize_rel_pos_bias_table = resize_rel_pos_bias_table_simple = None

pytestmark = [
    pytest.mark.timm,
    pytest.mark.skipif(resize_rel_pos_bias_table is None, reason="timm does not import here"),
]

SIZES = [(7, 12), (7, 14), (8, 16), (12, 7), (8, 8), (6, 24)]


@pytest.mark.parametrize("mode", ["bicubic", "geometric"])
@pytest.mark.parametrize("old,new", SIZES)
@pytest.mark.parametrize("extra", [0, 3])
def test_resize_equals_timm(mode, old, new, extra):
    torch.manual_seed(0)
    heads = 4
    table = torch.randn(table_size((old, old)) + extra, heads)  # (num_pos + extra, H) fp32, as checkpoints
    timm_fn = resize_rel_pos_bias_table_simple if mode == "bicubic" else resize_rel_pos_bias_table
    expected = timm_fn(table, (new, new), (table_size((new, new)) + extra, heads))
    out = resize_bias_table(table, (old, old), (new, new), mode=mode)
    assert out.shape == expected.shape == (table_size((new, new)) + extra, heads)
    assert out.dtype == table.dtype
    # both bisect BEiT's ratio in float64; both interpolate in float32 (timm) or float64 (relpos)
    torch.testing.assert_close(out, expected.to(out.dtype), rtol=1e-5, atol=1e-5)
    if old != new:
        assert (out[: table_size((new, new))].std() - 0).abs() > 0.1  # not a constant table
