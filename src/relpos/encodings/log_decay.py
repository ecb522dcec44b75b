"""The 'The cat sat on mat' example's fixed logarithmic decay bias ``-scale * log(1 + |j - i|)``."""

from __future__ import annotations

import torch

from .._checks import check_int, check_positive_float
from ..core.bias import RelativeBias

__all__ = ["LogDecayBias"]


class LogDecayBias(RelativeBias):
    """``b[i, j] = -scale * log(1 + |j - i|)``, the same for every head; no parameters.

    Zero on the diagonal, negative elsewhere, symmetric, growing slowly with distance.

    >>> LogDecayBias(scale=0.3).materialize(3, 3)[0, 0]
    tensor([[ 0.0000, -0.2079, -0.3296],
            [-0.2079,  0.0000, -0.2079],
            [-0.3296, -0.2079,  0.0000]])
    """

    def __init__(self, scale: float = 0.3, *, num_heads: int = 1) -> None:
        super().__init__()
        self.scale = check_positive_float("scale", scale)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, num_heads={self.num_heads}"

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        decay = torch.log1p(relative_position.abs().double()) * self.scale  # fp64: exact to the printed digits
        return (0.0 - decay).float().expand(self.num_heads, -1)  # (H, n); 0.0 - : no -0.0
