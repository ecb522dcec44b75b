"""Windowed relative position bias tables (Swin Transformer, Liu et al. 2021).

Inside a window of ``N`` positions every (query, key) pair reads one learned scalar per
head from a table indexed by their offset. ``RelativePositionBias`` has the Swin indexing notes' API and
Swin's parameter and buffer names (``relative_position_bias_table``,
``relative_position_index``), so Swin weights load as they are. The index follows Swin's
``query - key`` convention; see :mod:`relpos.encodings.windows` for both conventions.

``RelativePositionBias(class_token=True)`` is BEiT's table (Bao et al. 2021): three more entries
for class token -> patch, patch -> class token and class token -> itself.
``ContinuousPositionBias`` is Swin V2's (Liu et al. 2022): a small MLP over log-spaced offsets
instead of a table, so one set of weights gives the bias of any window size.
"""

from __future__ import annotations

from typing import Literal, Sequence

import math

import torch
from torch import nn

from .._checks import check_bool, check_choice, check_dtype, check_device, check_int, check_positive_float
from ..core.bias import AdditiveBias
from .windows import normalize_window_size, table_size, window_coords, window_relative_position_index

__all__ = ["RelativePositionBias", "FactorizedRelativePositionBias", "ContinuousPositionBias", "log_spaced_coords"]

CLASS_TOKEN_ENTRIES = 3  # BEiT: class -> patch, patch -> class, class -> class


class _WindowBias(AdditiveBias):
    """Shared plumbing: window size, dense form ``(H, N, N)`` via ``forward()``."""

    window_size: tuple[int, ...]
    class_token: bool = False  # BEiT's extra position 0 (RelativePositionBias only)

    @property
    def window_area(self) -> int:
        area = 1
        for s in self.window_size:
            area *= s
        return area

    @property
    def num_positions(self) -> int:
        """Rows (and columns) of ``forward()``: the window's positions, plus one for a class token."""
        return self.window_area + int(self.class_token)

    def materialize(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        n = self.num_positions
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
        class_token: BEiT's table: 3 more rows, and position 0 of ``forward()`` is the class token
            (row ``T`` for class -> patch, ``T + 1`` for patch -> class, ``T + 2`` for class -> class,
            ``T = table_size(window_size)``), as in BEiT, timm and transformers.

    ``forward()`` returns ``(H, N, N)`` with ``N = W`` (1D) or ``Wh * Ww`` (2D), plus 1 with a class token.

    >>> rpb = RelativePositionBias(num_heads=4, window_size=(7, 7), bias_type="2d")
    >>> rpb.relative_position_bias_table.shape, rpb().shape
    (torch.Size([169, 4]), torch.Size([4, 49, 49]))
    >>> beit = RelativePositionBias(num_heads=1, window_size=(2, 2), class_token=True)
    >>> beit.relative_position_index
    tensor([[11,  9,  9,  9,  9],
            [10,  4,  3,  1,  0],
            [10,  5,  4,  2,  1],
            [10,  7,  6,  4,  3],
            [10,  8,  7,  5,  4]])
    """

    def __init__(
        self,
        num_heads: int,
        window_size: int | Sequence[int],
        bias_type: Literal["2d", "1d"] = "2d",
        *,
        init_std: float = 0.02,
        class_token: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.class_token = check_bool("class_token", class_token)
        self.bias_type = check_choice("bias_type", bias_type, ("2d", "1d"))
        self.window_size = normalize_window_size(window_size, ndim=2 if bias_type == "2d" else 1)
        self.init_std = check_positive_float("init_std", init_std)
        self.relative_position_bias_table = nn.Parameter(
            torch.empty(self.num_entries, self.num_heads, device=device, dtype=dtype)
        )
        self.register_buffer("relative_position_index", torch.empty(0, dtype=torch.long), persistent=False)
        self._init_buffers(device)
        self.reset_parameters()

    @property
    def num_entries(self) -> int:
        """Rows of the table: ``prod(2 W - 1)``, plus 3 with a class token."""
        return table_size(self.window_size) + CLASS_TOKEN_ENTRIES * self.class_token

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        index = window_relative_position_index(self.window_size, device=device)  # (N, N)
        if self.class_token:
            first = table_size(self.window_size)
            index = nn.functional.pad(index, (1, 0, 1, 0))  # (N + 1, N + 1)
            index[0, :] = first  # class token -> patches
            index[:, 0] = first + 1  # patches -> class token
            index[0, 0] = first + 2  # class token -> itself
        self.relative_position_index = index

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
        extra = ", class_token=True" if self.class_token else ""
        return f"num_heads={self.num_heads}, window_size={self.window_size}, bias_type={self.bias_type!r}{extra}"

    def forward(self) -> torch.Tensor:
        n = self.num_positions
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


def normalize_pretrained_window(value: int | tuple[int, int]) -> tuple[int, int]:
    """``0`` or ``(0, 0)`` (none: the window itself) or a 2D window, as ``(Ph, Pw)``."""
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2 and all(v == 0 for v in value):
        return (0, 0)
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return (0, 0)
    return normalize_window_size(value, ndim=2, name="pretrained_window_size (0: none, or W or (Wh, Ww))")


def log_spaced_coords(
    window_size: int | Sequence[int], pretrained_window_size: int | tuple[int, int] = 0, *, device=None
) -> torch.Tensor:
    """Swin V2's log-spaced offsets: ``(2 Wh - 1, 2 Ww - 1, 2)``, each ``sign(x) log2(1 + |x|) / 3``.

    Offsets ``dh, dw`` are first divided by ``P - 1`` per axis (``P`` the pretrained window, or the
    window itself when ``pretrained_window_size`` is 0; no division for a window of 1) and scaled to
    ``[-8, 8]``, so a window larger than the pretrained one reaches past 1 (extrapolation in log space).

    >>> log_spaced_coords((1, 3))[0]  # dw = -2..2 -> -8, -4, 0, 4, 8 -> log2(1 + |x|) / 3
    tensor([[ 0.0000, -1.0566],
            [ 0.0000, -0.7740],
            [ 0.0000,  0.0000],
            [ 0.0000,  0.7740],
            [ 0.0000,  1.0566]])
    """
    window = normalize_window_size(window_size, ndim=2)
    pretrained = normalize_pretrained_window(pretrained_window_size)
    for axis, (size, base) in enumerate(zip(window, pretrained)):
        if base == 1 and size > 1:
            raise ValueError(
                f"pretrained_window_size={pretrained} has 1 on axis {axis}, where the window is {size} wide: Swin V2 "
                "divides the offsets by P - 1 = 0 there (timm and transformers give inf); pass the pretrained window's "
                "real size (at least 2), or 0 for none"
            )
    axes = []
    for size, base in zip(window, pretrained):
        offsets = torch.arange(-(size - 1), size, device=device, dtype=torch.float32)  # (2W - 1,)
        span = (base if base > 0 else size) - 1
        axes.append(offsets / span if span > 0 else offsets)
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1) * 8  # (2Wh - 1, 2Ww - 1, 2)
    return torch.sign(coords) * torch.log2(coords.abs() + 1.0) / math.log2(8)


class ContinuousPositionBias(_WindowBias):
    """Swin V2's continuous position bias: ``16 * sigmoid(MLP(log-spaced offset))`` per head.

    The MLP (``Linear(2, 512) -> ReLU -> Linear(512, H, bias=False)``) is named ``cpb_mlp`` as in
    Swin V2 and timm; transformers' name ``continuous_position_bias_mlp`` loads too, and the stored
    ``relative_coords_table`` / ``relative_position_index`` buffers of older checkpoints are ignored
    (they are derived from the window size, which may differ: that is the point of this bias).

    Args:
        num_heads: heads, one MLP output each.
        window_size: ``W`` or ``(Wh, Ww)``.
        pretrained_window_size: the window the MLP was trained at (0: this one); offsets are
            normalised by it, so a larger window extrapolates in log space as in Swin V2.
        hidden_size: the MLP's width (512 in Swin V2).

    >>> cpb = ContinuousPositionBias(num_heads=3, window_size=8, pretrained_window_size=4)
    >>> cpb().shape, cpb.relative_coords_table.shape
    (torch.Size([3, 64, 64]), torch.Size([15, 15, 2]))
    """

    def __init__(
        self,
        num_heads: int,
        window_size: int | Sequence[int],
        pretrained_window_size: int | tuple[int, int] = 0,
        *,
        hidden_size: int = 512,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        dtype = check_dtype("dtype", dtype)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.window_size = normalize_window_size(window_size, ndim=2)
        self.pretrained_window_size = normalize_pretrained_window(pretrained_window_size)
        hidden = check_int("hidden_size", hidden_size, minimum=1)
        self.cpb_mlp = nn.Sequential(
            nn.Linear(2, hidden, device=device, dtype=dtype),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, self.num_heads, bias=False, device=device, dtype=dtype),
        )
        self.register_buffer("relative_coords_table", torch.empty(0), persistent=False)
        self.register_buffer("relative_position_index", torch.empty(0, dtype=torch.long), persistent=False)
        self._init_buffers(device, dtype)

    def _init_buffers(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        coords = log_spaced_coords(self.window_size, self.pretrained_window_size, device=device)  # (2Wh-1, 2Ww-1, 2)
        self.relative_coords_table = coords.to(dtype or self.cpb_mlp[0].weight.dtype)
        self.relative_position_index = window_relative_position_index(self.window_size, device=device)  # (N, N)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Take transformers' ``continuous_position_bias_mlp.*`` as ``cpb_mlp.*``; drop derived buffers."""
        for key in [k for k in state_dict if k.startswith(prefix + "continuous_position_bias_mlp.")]:
            state_dict[prefix + "cpb_mlp." + key[len(prefix + "continuous_position_bias_mlp."):]] = state_dict.pop(key)
        for name in ("relative_coords_table", "relative_position_index"):
            state_dict.pop(prefix + name, None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, window_size={self.window_size}, "
                f"pretrained_window_size={self.pretrained_window_size}")

    def bias_table(self) -> torch.Tensor:
        """``(prod(2 W - 1), H)``: the bias of every offset, laid out like a Swin V1 table."""
        return 16 * torch.sigmoid(self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads))  # (T, H)

    def forward(self) -> torch.Tensor:
        n = self.window_area
        bias = self.bias_table()[self.relative_position_index.view(-1)]  # (N*N, H)
        return bias.view(n, n, self.num_heads).permute(2, 0, 1).contiguous()  # (H, N, N)
