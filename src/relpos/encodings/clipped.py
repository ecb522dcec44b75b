"""Clipped relative position bias (Shaw et al., 2018, scalar form).

One learned scalar per head for every offset ``j - i`` clipped to ``[-R, R]``
(``R = max_distance``): ``2R + 1`` values per head; all farther keys share the end values.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .._checks import check_device, check_int
from ..core.bias import OffsetBias, RelativeBias

__all__ = ["ClippedRelativeBias"]


class ClippedRelativeBias(RelativeBias):
    """``b[h, i, j] = relative_bias[h, clip(j - i, -R, R) + R]``.

    The table ``relative_bias`` is ``(H, 2R + 1)``, column ``c`` holding offset ``c - R``
    (``key - query``). Initialised to zeros, so training starts from no positional preference.

    >>> bias = ClippedRelativeBias(num_heads=1, max_distance=2)
    >>> with torch.no_grad():
    ...     _ = bias.relative_bias.copy_(torch.tensor([[-2., -1., 0., 1., 2.]]))
    ...     print(bias.materialize(4, 6)[0, 0])
    tensor([[ 0.,  1.,  2.,  2.,  2.,  2.],
            [-1.,  0.,  1.,  2.,  2.,  2.],
            [-2., -1.,  0.,  1.,  2.,  2.],
            [-2., -2., -1.,  0.,  1.,  2.]])
    """

    def __init__(
        self,
        num_heads: int,
        max_distance: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.max_distance = check_int(
            "max_distance", max_distance, minimum=0, hint="it is the largest offset |j - i| with a value of its own"
        )
        self.relative_bias = nn.Parameter(torch.zeros(self.num_heads, 2 * self.max_distance + 1, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_distance={self.max_distance}"

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        index = relative_position.clamp(-self.max_distance, self.max_distance) + self.max_distance  # (n,)
        return self.relative_bias[:, index]  # (H, n)

    def offsets(self, query_length: int, key_length: int, *, q_offset: int = 0, device=None) -> OffsetBias:
        """Per-offset values; offsets beyond ``[-R, R]`` share the end entries (:attr:`OffsetBias.flat`)."""
        offsets = super().offsets(query_length, key_length, q_offset=q_offset, device=device)
        return replace(offsets, flat=(-self.max_distance, self.max_distance))
