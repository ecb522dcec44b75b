"""2D rotary position embeddings over a patch grid: axial (EVA-02), mixed (RoPE-Mixed), DINOv3.

Each rotates channel pairs of the patch tokens' queries and keys by angles that depend on the
patch's (row, column); prefix tokens (class, registers) come first and are left unrotated. The
three differ in the angles and in which channels form a pair:

=========  ========================================================  ==========================
kind       angle of pair j at patch (y, x)                           pairs (layout)
=========  ========================================================  ==========================
axial      ``y f_j`` (j < d/4), ``x f_(j-d/4)`` (j >= d/4),          ``(2j, 2j+1)``
           ``f_i = T^(-i / (d/4))``, T = 10000; y, x integer         (timm ``RotaryEmbeddingCat``,
           (EVA-02: times ``ref / grid`` to keep the trained range)  ``in_pixels=False``)
mixed      ``y Fy[h, j] + x Fx[h, j]``: learned per head and pair,   ``(2j, 2j+1)``
           initialised at ``|f_i| = 10^(-4i/d)`` in a random         (timm ``RotaryEmbeddingMixed``,
           direction per head (Heo et al. 2024)                      Heo et al. 2024)
dinov3     ``2 pi c_y f_j`` / ``2 pi c_x f_(j-d/4)``, patch centres  ``(j, j + d/2)``
           ``c = 2 (i + 0.5) / n - 1`` in [-1, 1], ``f_i = 100^(-4i/d)``  (rotate-half, transformers)
=========  ========================================================  ==========================

Axial and mixed angles are linear in integer coordinates, so ``q_i . k_j`` depends on the offset
only (relative); DINOv3 normalises by the grid size, so its angles stretch with the resolution.
Any grid size works without retraining. ``head_dim`` must be a multiple of 4 (two axes, pairs).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
from torch import nn

from .._checks import check_grid, check_int, check_positive_float, check_tensor
from .rotary import apply_rotation as rotate_pairs

__all__ = ["AxialRotary2D", "DINOv3Rotary2D", "MixedRotary2D", "Layout", "apply_rotation"]

Layout = Literal["interleaved", "half"]


def _check_head_dim(head_dim: int) -> int:
    head_dim = check_int("head_dim", head_dim, minimum=4)
    if head_dim % 4:
        raise ValueError(
            f"head_dim must be a multiple of 4 for 2D rotary embeddings (channel pairs, half of them per axis), "
            f"got {head_dim}; the rotated channels of a head must split evenly between rows and columns"
        )
    return head_dim


def apply_rotation(x: torch.Tensor, angles: torch.Tensor, layout: Layout, num_prefix_tokens: int = 0) -> torch.Tensor:
    """Rotate the patch tokens of ``x (..., P + N, d)`` by ``angles (..., N, d/2)``; the first P tokens unchanged.

    ``"interleaved"`` pairs channels ``(2j, 2j+1)``, ``"half"`` pairs ``(j, j + d/2)``.

    >>> apply_rotation(torch.tensor([[2.0, 0.0]]), torch.tensor([[math.pi / 2]]), "interleaved").round().abs()
    tensor([[0., 2.]])
    """
    prefix, patches = x[..., :num_prefix_tokens, :], x[..., num_prefix_tokens:, :]  # (..., P, d), (..., N, d)
    interleaved = layout == "interleaved"
    full = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles, angles], -1)  # (..., N, d) per channel
    rotated = rotate_pairs(patches, full.cos(), full.sin(), interleaved=interleaved)  # (..., N, d)
    return torch.cat([prefix, rotated], -2)  # (..., P + N, d)


class _Rotary2D(nn.Module):
    """Shared plumbing: checks, prefix handling; subclasses write ``angles(grid)`` and set ``layout``."""

    layout: Layout
    head_dim: int

    def angles(self, grid: int | Sequence[int]) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def rotate(self, x: torch.Tensor, grid: int | Sequence[int], num_prefix_tokens: int = 0) -> torch.Tensor:
        """``x (B, H, P + N, head_dim)`` with its N = height * width patch tokens rotated."""
        check_tensor("x", x, shape="(B, H, P + N, head_dim)")
        height, width = check_grid("grid", grid)
        prefix = check_int("num_prefix_tokens", num_prefix_tokens, minimum=0)
        if x.dim() < 2 or x.shape[-1] != self.head_dim or x.shape[-2] != prefix + height * width:
            raise ValueError(
                f"x must be (..., num_prefix_tokens + height * width = {prefix} + {height} x {width}, head_dim={self.head_dim}), "
                f"got {tuple(x.shape)}"
            )
        return apply_rotation(x, self.angles((height, width)).to(x.device), self.layout, prefix)

    def forward(self, q: torch.Tensor, k: torch.Tensor, grid: int | Sequence[int], num_prefix_tokens: int = 0):
        """Rotated ``(q, k)``, both ``(B, H, P + N, head_dim)``."""
        return self.rotate(q, grid, num_prefix_tokens), self.rotate(k, grid, num_prefix_tokens)


def _axis_coords(height: int, width: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) row and column index of each patch in raster order."""
    y, x = torch.meshgrid(torch.arange(height, device=device, dtype=dtype), torch.arange(width, device=device, dtype=dtype), indexing="ij")
    return y.flatten(), x.flatten()


class AxialRotary2D(_Rotary2D):
    """Axial 2D RoPE (EVA-02; timm's ``RotaryEmbeddingCat`` with ``in_pixels=False``).

    Args:
        head_dim: rotated channels per head (a multiple of 4).
        temperature: frequency base ``T`` (10000).
        ref_grid: EVA-02's resize: positions scaled by ``ref_grid / grid`` so any grid spans the
            trained range (``None``: integer positions, relative for every grid).

    >>> AxialRotary2D(4).angles((2, 2))      # pairs: (row angle, column angle)
    tensor([[0., 0.],
            [0., 1.],
            [1., 0.],
            [1., 1.]])
    """

    layout: Layout = "interleaved"

    def __init__(self, head_dim: int, *, temperature: float = 10000.0, ref_grid: int | Sequence[int] | None = None, device=None, dtype=None):
        super().__init__()
        self.head_dim = _check_head_dim(head_dim)
        self.temperature = check_positive_float("temperature", temperature)
        self.ref_grid = None if ref_grid is None else check_grid("ref_grid", ref_grid)
        self.register_buffer("bands", torch.empty(head_dim // 4, device=device, dtype=dtype or torch.float32), persistent=False)
        self._init_buffers()

    def _init_buffers(self) -> None:
        quarter = self.head_dim // 4
        exponents = torch.arange(quarter, device=self.bands.device, dtype=torch.float32) / quarter
        self.bands.copy_(self.temperature**-exponents)  # (d/4,)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, temperature={self.temperature}, ref_grid={self.ref_grid}"

    def angles(self, grid: int | Sequence[int]) -> torch.Tensor:
        """(N, head_dim / 2): the row angles of every band, then the column angles."""
        height, width = check_grid("grid", grid)
        y, x = _axis_coords(height, width, self.bands.device)  # (N,)
        if self.ref_grid is not None:
            y, x = y / height * self.ref_grid[0], x / width * self.ref_grid[1]
        bands = self.bands.float()
        return torch.cat([y[:, None] * bands, x[:, None] * bands], -1)  # (N, d/2)


class MixedRotary2D(_Rotary2D):
    """RoPE-Mixed (Heo et al. 2024; timm's ``RotaryEmbeddingMixed`` for one layer): learned 2D frequencies.

    Parameter ``freqs (2, num_heads, head_dim / 2)``: row and column frequency of each pair and
    head (timm stacks every layer as ``(2, depth, num_heads, head_dim / 2)``: take ``[:, layer]``).
    Initialised as in the paper: magnitudes ``temperature^(-4i/d)``, each head's pairs pointing in a
    random direction and its 90-degree turn.
    """

    layout: Layout = "interleaved"

    def __init__(self, head_dim: int, num_heads: int, *, temperature: float = 10.0, generator: torch.Generator | None = None, device=None, dtype=None):
        super().__init__()
        self.head_dim = _check_head_dim(head_dim)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.temperature = check_positive_float("temperature", temperature)
        self.freqs = nn.Parameter(torch.empty(2, num_heads, head_dim // 2, device=device, dtype=dtype or torch.float32))
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        magnitude = self.temperature ** -(torch.arange(0, self.head_dim, 4, dtype=torch.float32) / self.head_dim)  # (d/4,)
        turn = torch.rand(self.num_heads, 1, generator=generator) * 2 * math.pi  # (H, 1)
        directions = torch.cat([turn, turn + math.pi / 2], -1).repeat_interleave(len(magnitude), -1)  # (H, d/2)
        scale = magnitude.repeat(2)  # (d/2,)
        self.freqs.copy_(torch.stack([scale * directions.cos(), scale * directions.sin()]))  # (2, H, d/2)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}"

    def angles(self, grid: int | Sequence[int]) -> torch.Tensor:
        """(num_heads, N, head_dim / 2): ``y * freqs[0] + x * freqs[1]`` (y the row, as timm's ``t_x``)."""
        height, width = check_grid("grid", grid)
        y, x = _axis_coords(height, width, self.freqs.device)  # (N,)
        freqs = self.freqs.float()
        return y[None, :, None] * freqs[0][:, None] + x[None, :, None] * freqs[1][:, None]  # (H, N, d/2)


class DINOv3Rotary2D(_Rotary2D):
    """DINOv3's 2D RoPE (transformers' ``DINOv3ViTRopePositionEmbedding``; rotate-half pairs).

    Patch centres normalised to [-1, 1] per axis, so a grid of another size spans the same range.
    Training-time coordinate augmentation (DINOv3's shift / jitter / rescale) is not included.

    Args:
        head_dim: a multiple of 4.
        base: DINOv3's ``rope_theta`` (100).
    """

    layout: Layout = "half"

    def __init__(self, head_dim: int, *, base: float = 100.0, device=None, dtype=None):
        super().__init__()
        self.head_dim = _check_head_dim(head_dim)
        self.base = check_positive_float("base", base)
        self.register_buffer("inv_freq", torch.empty(head_dim // 4, device=device, dtype=dtype or torch.float32), persistent=False)
        self._init_buffers()

    def _init_buffers(self) -> None:
        exponents = torch.arange(self.head_dim // 4, device=self.inv_freq.device, dtype=torch.float32) * 4 / self.head_dim
        self.inv_freq.copy_(self.base**-exponents)  # (d/4,)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"

    def angles(self, grid: int | Sequence[int]) -> torch.Tensor:
        """(N, head_dim / 2): the row angles of every frequency, then the column angles (then tiled by the layout)."""
        height, width = check_grid("grid", grid)
        y, x = _axis_coords(height, width, self.inv_freq.device)  # (N,)
        centre_y, centre_x = 2 * (y + 0.5) / height - 1, 2 * (x + 0.5) / width - 1  # (N,) in [-1, 1]
        inv_freq = self.inv_freq.float()
        return 2 * math.pi * torch.cat([centre_y[:, None] * inv_freq, centre_x[:, None] * inv_freq], -1)  # (N, d/2)
