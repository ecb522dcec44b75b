"""Windowed relative position bias tables (Swin Transformer, Liu et al. 2021).

Inside a window of ``N`` positions every (query, key) pair reads one learned scalar per
head from a table indexed by their offset. ``RelativePositionBias`` has the Swin indexing notes' API and
Swin's parameter and buffer names (``relative_position_bias_table``,
``relative_position_index``), so Swin weights load as they are. The index follows Swin's
``query - key`` convention; see :mod:`relpos.windows` for both conventions.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import nn

from ._checks import check_choice, check_device, check_int, check_positive_float
from .bias import AdditiveBias
from .windows import normalize_window_size, table_size, window_coords, window_relative_position_index

__all__ = ["RelativePositionBias", "FactorizedRelativePositionBias"]


class _WindowBias(AdditiveBias):
    """Shared plumbing: window size, dense form ``(H, N, N)`` via ``forward()``."""

    window_size: tuple[int, ...]

    @property
    def window_area(self) -> int:
        area = 1
        for s in self.window_size:
            area *= s
        return area

    def materialize(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        n = self.window_area
        if (query_length, key_length, q_offset) != (n, n, 0):
            raise ValueError(
                f"{type(self).__name__} covers exactly one window of N={n} positions: query_length and key_length "
                f"must be {n} and q_offset 0, got ({query_length}, {key_length}, q_offset={q_offset})"
            )
        bias = self().unsqueeze(0)  # (1, H, N, N)
        return bias if device is None else bias.to(device)


class RelativePositionBias(_WindowBias):
    """Swin's learned ``(table_size, H)`` bias table over a 1D or 2D window.

    Also available as ``relpos.WindowRelativeBias``. Not to be confused with
    :class:`relpos.RelativePositionalBias` (alias ``relpos.T5RelativeBias``), T5's bucketed bias
    over any length.

    Args:
        num_heads: heads, one table column each.
        window_size: ``W`` for 1D; ``W`` or ``(Wh, Ww)`` for 2D.
        bias_type: ``"2d"`` (Swin) or ``"1d"``.
        init_std: std of the truncated-normal initialisation (Swin: 0.02, cut at +-2 std).

    ``forward()`` returns ``(H, N, N)`` with ``N = W`` (1D) or ``Wh * Ww`` (2D).

    >>> rpb = RelativePositionBias(num_heads=4, window_size=(7, 7), bias_type="2d")
    >>> rpb.relative_position_bias_table.shape, rpb().shape
    (torch.Size([169, 4]), torch.Size([4, 49, 49]))
    """

    def __init__(
        self,
        num_heads: int,
        window_size: int | Sequence[int],
        bias_type: Literal["2d", "1d"] = "2d",
        *,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.bias_type = check_choice("bias_type", bias_type, ("2d", "1d"))
        self.window_size = normalize_window_size(window_size, ndim=2 if bias_type == "2d" else 1)
        self.init_std = check_positive_float("init_std", init_std)
        self.relative_position_bias_table = nn.Parameter(
            torch.empty(table_size(self.window_size), self.num_heads, device=device, dtype=dtype)
        )
        self.register_buffer("relative_position_index", torch.empty(0, dtype=torch.long), persistent=False)
        self._init_buffers(device)
        self.reset_parameters()

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        self.relative_position_index = window_relative_position_index(self.window_size, device=device)  # (N, N)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Older Swin/timm checkpoints store ``relative_position_index``: check it, then drop it (it is derived)."""
        key = prefix + "relative_position_index"
        stored = state_dict.pop(key, None)
        if stored is not None:
            expected = self.relative_position_index
            if tuple(stored.shape) not in (tuple(expected.shape), (expected.numel(),)) or not torch.equal(
                stored.to(expected.device).long().view(expected.shape), expected
            ):
                error_msgs.append(
                    f"{key}: the stored index (shape {tuple(stored.shape)}) differs from the one this window size "
                    f"{self.window_size} gives (shape {tuple(expected.shape)}); the checkpoint is for another window"
                )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def reset_parameters(self) -> None:
        std = self.init_std
        nn.init.trunc_normal_(self.relative_position_bias_table, std=std, a=-2 * std, b=2 * std)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, window_size={self.window_size}, bias_type={self.bias_type!r}"

    def forward(self) -> torch.Tensor:
        n = self.window_area
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]  # (N*N, H)
        return bias.view(n, n, self.num_heads).permute(2, 0, 1).contiguous()  # (H, N, N)


class FactorizedRelativePositionBias(_WindowBias):
    """The relative-vs-absolute tutorial's factorized 2D bias ``b[h, p, r] = b_h[dh] + b_w[dw]`` (``d = p - r``).

    ``(2Wh - 1) + (2Ww - 1)`` parameters per head instead of ``(2Wh - 1)(2Ww - 1)``;
    the bias of a pair is the sum of a row-offset and a column-offset term.

    >>> fb = FactorizedRelativePositionBias(num_heads=2, window_size=(4, 8))
    >>> fb.height_bias_table.shape, fb.width_bias_table.shape, fb().shape
    (torch.Size([7, 2]), torch.Size([15, 2]), torch.Size([2, 32, 32]))
    """

    def __init__(
        self,
        num_heads: int,
        window_size: int | Sequence[int],
        *,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.window_size = normalize_window_size(window_size, ndim=2)
        self.init_std = check_positive_float("init_std", init_std)
        wh, ww = self.window_size
        self.height_bias_table = nn.Parameter(torch.empty(2 * wh - 1, self.num_heads, device=device, dtype=dtype))
        self.width_bias_table = nn.Parameter(torch.empty(2 * ww - 1, self.num_heads, device=device, dtype=dtype))
        self.register_buffer("height_index", torch.empty(0, dtype=torch.long), persistent=False)
        self.register_buffer("width_index", torch.empty(0, dtype=torch.long), persistent=False)
        self._init_buffers(device)
        self.reset_parameters()

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        coords = window_coords(self.window_size, device=device)  # (2, N)
        rel = coords[:, :, None] - coords[:, None, :]  # (2, N, N): query - key
        self.height_index = rel[0] + self.window_size[0] - 1  # (N, N)
        self.width_index = rel[1] + self.window_size[1] - 1  # (N, N)

    def reset_parameters(self) -> None:
        std = self.init_std
        for table in (self.height_bias_table, self.width_bias_table):
            nn.init.trunc_normal_(table, std=std, a=-2 * std, b=2 * std)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, window_size={self.window_size}"

    def forward(self) -> torch.Tensor:
        bias = self.height_bias_table[self.height_index] + self.width_bias_table[self.width_index]  # (N, N, H)
        return bias.permute(2, 0, 1).contiguous()  # (H, N, N)
