"""patch_scores: the position term alone over a patch grid (for the explore page's image view)."""

import pytest
import torch

from relpos.tools.patch_scores import KINDS, patch_scores


@pytest.mark.parametrize("kind", KINDS)
def test_shape_determinism_and_variation(kind):
    scores = patch_scores(kind, 5, 7, seed=3)
    assert scores.shape == (35, 35) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
    assert torch.equal(scores, patch_scores(kind, 5, 7, seed=3))
    assert not torch.equal(scores, patch_scores(kind, 5, 7, seed=4))
    assert scores.std() > 0.05  # the positions change the scores


def _offset_pairs(width):
    """Patch pairs with the same offset (1, 2) on a grid of the given width: (1,1)->(2,3) and (2,2)->(3,4)."""
    return (1 * width + 1, 2 * width + 3), (2 * width + 2, 3 * width + 4)


@pytest.mark.parametrize("kind", ["decomposed", "rope2d_axial", "rope2d_mixed"])
def test_relative_kinds_depend_on_the_offset_only(kind):
    scores = patch_scores(kind, 5, 6)
    (a, b), (c, d) = _offset_pairs(6)
    torch.testing.assert_close(scores[a, b], scores[c, d], rtol=1e-4, atol=1e-4)
    assert (scores[0, 1] - scores[0, 7]).abs() > 1e-3


def test_decomposed_is_the_sum_of_a_row_and_a_column_term():
    scores = patch_scores("decomposed", 4, 5).view(20, 4, 5)  # (query, key row, key column)
    # rel_h[q, y'] + rel_w[q, x']: every 2x2 minor over (key row, key column) cancels
    minors = scores[:, 1:, 1:] - scores[:, 1:, :-1] - scores[:, :-1, 1:] + scores[:, :-1, :-1]
    assert minors.abs().max() < 1e-5


def test_dinov3_depends_on_the_grid_size():
    small, large = patch_scores("rope2d_dinov3", 4, 4), patch_scores("rope2d_dinov3", 8, 8)
    # neighbours (0,0)->(0,1) are 2/4 apart in DINOv3's [-1, 1] coordinates on the 4x4 grid, 2/8 on the 8x8
    assert (small[0, 1] - large[0, 1]).abs() > 1e-3


def test_bad_inputs():
    with pytest.raises(ValueError, match="kind must be one of"):
        patch_scores("rope", 4, 4)
    with pytest.raises(ValueError, match="height must be positive"):
        patch_scores("decomposed", 0, 4)
    with pytest.raises(TypeError, match="width must be an int"):
        patch_scores("decomposed", 4, 4.0)
