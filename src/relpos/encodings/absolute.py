"""Absolute position embeddings, the baselines relative encodings are compared against.

Both are added to the token embeddings (``x + pe[positions]``), not to attention scores.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_int, check_positive_float

__all__ = ["LearnedAbsolutePositionEmbedding", "SinusoidalPositionEmbedding"]


def _check_input(x: torch.Tensor, dim: int) -> None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating tensor (..., L, dim), got {got}: integer inputs would truncate the sum")
    if x.dim() < 2 or x.shape[-1] != dim:
        raise ValueError(f"x must be (..., L, dim={dim}), got {tuple(x.shape)}")


class LearnedAbsolutePositionEmbedding(nn.Module):
    """A learned vector per position up to ``max_length`` (BERT, GPT-2): ``weight (max_length, dim)``.

    ``forward(x, *, offset=0)`` adds rows ``offset .. offset + L - 1`` to ``x (..., L, dim)``.
    It cannot represent a position past its table and says so.
    """

    def __init__(
        self, max_length: int, dim: int, *, init_std: float = 0.02, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.max_length = check_int("max_length", max_length, minimum=1)
        self.dim = check_int("dim", dim, minimum=1)
        init_std = check_positive_float("init_std", init_std)
        self.weight = nn.Parameter(torch.randn(self.max_length, self.dim, device=device, dtype=dtype) * init_std)

    def extra_repr(self) -> str:
        return f"max_length={self.max_length}, dim={self.dim}"

    def forward(self, x: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
        _check_input(x, self.dim)
        offset = check_int("offset", offset, minimum=0)
        end = offset + x.shape[-2]
        if end > self.max_length:
            raise ValueError(
                f"positions {offset}..{end - 1} are past the learned table of max_length={self.max_length}: "
                "a learned absolute embedding cannot extrapolate; use a relative encoding or a longer table"
            )
        return x + self.weight[offset:end].to(x.dtype)  # (..., L, dim)


class SinusoidalPositionEmbedding(nn.Module):
    """Vaswani et al. (2017): ``pe[p, 2c] = sin(p / base**(2c/dim))``, ``pe[p, 2c+1] = cos(...)``.

    No parameters, any length. Computed in float64 and cast (positions past 2**24 stay exact).

    >>> SinusoidalPositionEmbedding(4).table(torch.arange(2))
    tensor([[0.0000, 1.0000, 0.0000, 1.0000],
            [0.8415, 0.5403, 0.0100, 0.9999]])
    """

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = check_int("dim", dim, minimum=2)
        if self.dim % 2:
            raise ValueError(f"dim must be even (sin and cos channels alternate), got {dim}")
        self.base = check_positive_float("base", base)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"

    def table(self, positions: torch.Tensor) -> torch.Tensor:
        """(L, dim) float32 embedding of integer positions (L,)."""
        freq = torch.exp(
            torch.arange(0, self.dim, 2, dtype=torch.float64, device=positions.device) * (-math.log(self.base) / self.dim)
        )  # (dim/2,)
        angles = positions.double()[:, None] * freq[None, :]  # (L, dim/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2).float()  # (L, dim): sin, cos, ...

    def forward(self, x: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
        _check_input(x, self.dim)
        offset = check_int("offset", offset, minimum=0)
        positions = torch.arange(offset, offset + x.shape[-2], device=x.device)
        return x + self.table(positions).to(x.dtype)  # (..., L, dim)
