"""What a 2D position term alone does to attention over a patch grid: one score per (patch, patch).

For the explore page's image view: pick a patch (a row of the returned matrix) and colour every
other patch by its score. Content is held fixed (one random query and key vector, the same at
every patch), so the scores vary with the positions only.
"""

from __future__ import annotations

from typing import Literal

import torch

from .._checks import check_choice, check_int
from ..encodings.decomposed import DecomposedRelPos, decomposed_bias
from ..encodings.rotary2d import AxialRotary2D, DINOv3Rotary2D, MixedRotary2D

__all__ = ["KINDS", "Kind", "patch_scores"]

Kind = Literal["decomposed", "rope2d_axial", "rope2d_mixed", "rope2d_dinov3"]
KINDS = ("decomposed", "rope2d_axial", "rope2d_mixed", "rope2d_dinov3")
HEAD_DIM = 64


def _decomposed(height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """``rel_h[q, y'] + rel_w[q, x']`` with std-1 tables (SAM's names and sizes for this grid)."""
    pos = DecomposedRelPos((height, width), head_dim=HEAD_DIM)
    with torch.no_grad():
        pos.rel_pos_h.normal_(generator=generator)
        pos.rel_pos_w.normal_(generator=generator)
        query = torch.randn(HEAD_DIM, generator=generator).expand(height * width, HEAD_DIM) * HEAD_DIM**-0.5  # (N, d)
        return decomposed_bias(*pos.terms(query, (height, width)))  # (N, N)


def _rope(kind: str, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """``rot(q, p_i) . rot(k, p_j) / sqrt(d)`` for one fixed q and k (first head for RoPE-Mixed)."""
    rope = {
        "rope2d_axial": lambda: AxialRotary2D(HEAD_DIM, temperature=100.0),
        "rope2d_mixed": lambda: MixedRotary2D(HEAD_DIM, num_heads=1, generator=generator),
        "rope2d_dinov3": lambda: DINOv3Rotary2D(HEAD_DIM),
    }[kind]()
    n = height * width
    q = torch.randn(HEAD_DIM, generator=generator).expand(1, 1, n, HEAD_DIM)  # (1, 1, N, d)
    k = torch.randn(HEAD_DIM, generator=generator).expand(1, 1, n, HEAD_DIM)
    with torch.no_grad():
        q_rot, k_rot = rope(q, k, (height, width))
        return (q_rot @ k_rot.transpose(-2, -1))[0, 0] * HEAD_DIM**-0.5  # (N, N)


def patch_scores(kind: Kind, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """``(N, N)`` scores, N = height * width in raster order: row i is patch i's score to every patch.

    ``"decomposed"``: MViTv2 / SAM's ``rel_h + rel_w`` for one fixed query and std-1 tables;
    ``"rope2d_axial"`` (EVA-02; base 100 so a small grid shows several periods), ``"rope2d_mixed"``
    (RoPE-Mixed at its initialisation), ``"rope2d_dinov3"``: the rotated q . k / sqrt(d). The same
    seed gives the same matrix.

    >>> patch_scores("rope2d_axial", 2, 3).shape
    torch.Size([6, 6])
    """
    kind = check_choice("kind", kind, KINDS)
    height = check_int("height", height, minimum=1)
    width = check_int("width", width, minimum=1)
    generator = torch.Generator().manual_seed(check_int("seed", seed, minimum=0))
    if kind == "decomposed":
        return _decomposed(height, width, generator)
    return _rope(kind, height, width, generator)
