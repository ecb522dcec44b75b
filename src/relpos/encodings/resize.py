"""Move a learned Swin/BEiT bias table to another window size (fine-tuning at a higher resolution).

A table of ``(2 Wh - 1)(2 Ww - 1)`` rows (plus BEiT's 3 class-token rows) is a grid of offsets
``(dh, dw)``; resizing interpolates that grid per head. Two modes, equal to timm's functions:

* ``"bicubic"``: ``F.interpolate(mode="bicubic", align_corners=False)`` on the offset grid
  (timm's ``resize_rel_pos_bias_table_simple``, the Swin-Transformer repository's recipe);
* ``"geometric"``: BEiT's recipe (timm's ``resize_rel_pos_bias_table``, its default path): the old
  offsets are placed on a geometric progression ``0, 1, 1 + q, 1 + q + q^2, ...`` whose last term
  reaches the new window's largest offset, so small offsets keep their spacing and large ones
  spread out; the new integer offsets are read by (bi)linear interpolation on that grid.

Class-token rows are kept as they are (they are not offsets). 1D tables are a grid of one row.
:func:`resize_state_dict` applies this to every table of a checkpoint for a given model.
"""

from __future__ import annotations

from typing import Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_choice, check_tensor
from .window_bias import CLASS_TOKEN_ENTRIES
from .windows import normalize_window_size, table_size

__all__ = ["ResizeMode", "resize_bias_table", "resize_state_dict", "geometric_offsets"]

ResizeMode = Literal["bicubic", "geometric"]
_TABLE_KEY = "relative_position_bias_table"


def _grid_shape(window: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the offset grid: ``(1, 2W - 1)`` in 1D, ``(2Wh - 1, 2Ww - 1)`` in 2D."""
    sides = tuple(2 * w - 1 for w in window)
    return (1, sides[0]) if len(sides) == 1 else sides


def _windows(table: torch.Tensor, old_window, new_window) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Both windows with the same number of axes, and the number of class-token rows (0 or 3)."""
    rows = table.shape[0]
    given = normalize_window_size(old_window, name="old_window")
    normalize_window_size(new_window, name="new_window")
    # an int window is 2D (Swin) when the table says so, else 1D
    candidates = [given] if isinstance(old_window, Sequence) else [given * 2, given]
    for old in candidates:
        extra = rows - table_size(old)
        if extra in (0, CLASS_TOKEN_ENTRIES):
            new = normalize_window_size(new_window, ndim=len(old), name="new_window")
            return old, new, extra
    sizes = " or ".join(f"{table_size(w)} (+{CLASS_TOKEN_ENTRIES} with class-token rows)" for w in candidates)
    raise ValueError(
        f"table has {rows} rows, which matches no window {old_window!r}: that window needs {sizes}; "
        "pass the window the table was trained at as old_window"
    )


def geometric_offsets(source_side: int, target_side: int) -> torch.Tensor:
    """BEiT's source positions: where the ``source_side`` old offsets sit on the new axis.

    ``q`` is found by bisection in ``[1.01, 1.5]`` (to 1e-6, as BEiT and timm do) so that
    ``1 + q + ... + q^(n-1)`` (``n = source_side // 2``) meets ``target_side // 2``; the positions
    are ``0, +-1, +-(1 + q), ...``. Growing 7x7 windows to 12x12 (13 -> 23 offsets):

    >>> geometric_offsets(13, 23)
    tensor([-11.0000,  -8.0598,  -5.6901,  -3.7801,  -2.2407,  -1.0000,   0.0000,
              1.0000,   2.2407,   3.7801,   5.6901,   8.0598,  11.0000],
           dtype=torch.float64)
    """
    n = source_side // 2
    left, right = 1.01, 1.5
    q = left
    while right - left > 1e-6:
        q = (left + right) / 2.0
        if (1.0 - q**n) / (1.0 - q) > target_side // 2:
            right = q
        else:
            left = q
    steps = torch.tensor([q**i for i in range(n)], dtype=torch.float64)  # (n,)
    distances = torch.cumsum(steps, 0)  # (n,) 1, 1 + q, 1 + q + q^2, ...
    return torch.cat([-distances.flip(0), torch.zeros(1, dtype=torch.float64), distances])  # (2n + 1,)


def _linear_weights(points: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(len(targets), len(points)) weights of linear interpolation on a sorted grid, clamped at its ends."""
    targets = targets.clamp(points[0], points[-1])  # (m,)
    right = torch.searchsorted(points, targets).clamp(1, max(len(points) - 1, 1))  # (m,)
    left = right - 1
    weights = torch.zeros(len(targets), len(points), dtype=torch.float64)  # (m, n)
    if len(points) == 1:
        weights[:, 0] = 1.0
        return weights
    span = points[right] - points[left]  # (m,)
    t = (targets - points[left]) / span  # (m,)
    rows = torch.arange(len(targets))
    weights[rows, left] += 1.0 - t
    weights[rows, right] += t
    return weights


def _geometric(grid: torch.Tensor, new_shape: tuple[int, int]) -> torch.Tensor:
    """(H, a, b) -> (H, c, d): bilinear interpolation from BEiT's geometric grid to integer offsets."""
    axes = []
    for source, target in zip(grid.shape[1:], new_shape):
        points = geometric_offsets(source, target)  # (source,)
        targets = torch.arange(-(target // 2), target // 2 + 1, dtype=torch.float64)  # (target,)
        axes.append(_linear_weights(points, targets).to(grid.dtype))
    rows, cols = axes  # (c, a), (d, b)
    return rows @ grid @ cols.T  # (H, c, d)


def resize_bias_table(
    table: torch.Tensor,
    old_window: int | Sequence[int],
    new_window: int | Sequence[int],
    mode: ResizeMode = "bicubic",
) -> torch.Tensor:
    """A ``(T, H)`` Swin/BEiT table trained at ``old_window``, interpolated for ``new_window``.

    ``T`` is ``prod(2 W - 1)`` over the window's axes, plus 3 rows for BEiT's class token (kept
    unchanged, at the end). An int window is 2D (``W x W``) when the table has that size, else 1D.
    Differentiable; the same dtype and device come back.

    >>> table = torch.arange(9.0).view(9, 1)  # a 2x2 window: offsets (dh, dw) in -1..1
    >>> resize_bias_table(table, 2, 3).view(5, 5)
    tensor([[-0.3840,  0.0280,  0.7120,  1.3960,  1.8080],
            [ 0.8520,  1.2640,  1.9480,  2.6320,  3.0440],
            [ 2.9040,  3.3160,  4.0000,  4.6840,  5.0960],
            [ 4.9560,  5.3680,  6.0520,  6.7360,  7.1480],
            [ 6.1920,  6.6040,  7.2880,  7.9720,  8.3840]])
    """
    table = check_tensor("table", table, shape="(T, H)")
    mode = check_choice("mode", mode, ("bicubic", "geometric"))
    if table.dim() != 2:
        raise ValueError(f"table must be (T, H) (table rows, heads), got shape {tuple(table.shape)}")
    old, new, extra = _windows(table, old_window, new_window)
    if old == new:
        return table
    body, tail = table[: table.shape[0] - extra], table[table.shape[0] - extra :]  # (T, H), (extra, H)
    heads = table.shape[1]
    grid = body.T.reshape(heads, *_grid_shape(old))  # (H, a, b)
    new_shape = _grid_shape(new)
    if mode == "bicubic":
        resized = F.interpolate(grid[None], size=new_shape, mode="bicubic", align_corners=False)[0]  # (H, c, d)
    else:
        resized = _geometric(grid, new_shape)  # (H, c, d)
    return torch.cat([resized.reshape(heads, -1).T, tail])  # (T', H)


def _square_window(rows: int, ndim: int) -> int | None:
    """The side W whose table has ``rows`` rows (``(2W - 1)^ndim``), or None."""
    side = round(rows ** (1 / ndim))
    return (side + 1) // 2 if side**ndim == rows and side % 2 == 1 else None


def resize_state_dict(
    state_dict: Mapping[str, torch.Tensor], model: nn.Module, mode: ResizeMode = "bicubic"
) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` whose ``relative_position_bias_table`` entries fit ``model``'s windows.

    Works for relpos, transformers (Swin, DonutSwin, BEiT) and timm modules: each table's new window
    is the ``window_size`` of the module that owns it in ``model``; its old window is the square one
    its size gives. Stale ``relative_position_index`` buffers of resized tables are dropped (they are
    derived). Swin V2's MLP needs no resizing: load it and set ``pretrained_window_size``.
    """
    mode = check_choice("mode", mode, ("bicubic", "geometric"))
    modules = dict(model.named_modules())
    out = dict(state_dict)
    for key, table in state_dict.items():
        prefix, _, name = key.rpartition(".")
        owner = modules.get(prefix) if name == _TABLE_KEY else None
        if owner is None or getattr(owner, _TABLE_KEY).shape == table.shape:
            continue
        window = tuple(int(w) for w in normalize_window_size(owner.window_size))
        target_rows = getattr(owner, _TABLE_KEY).shape[0]
        extra = target_rows - table_size(window)
        side = _square_window(table.shape[0] - extra, len(window))
        if side is None:
            raise ValueError(
                f"{key}: a table of {table.shape[0]} rows is no square window's (with {extra} class-token rows); "
                "resize it with relpos.resize_bias_table(table, old_window, new_window) and load the result"
            )
        out[key] = resize_bias_table(table, (side,) * len(window), window, mode=mode)
        out.pop(f"{prefix}.relative_position_index" if prefix else "relative_position_index", None)
    return out
