"""Index tables for windowed (Swin-style) relative position biases.

Positions inside a window are flattened in raster order (row-major). For two positions
``p`` (query) and ``r`` (key) the table index encodes their offset per axis. Swin, timm and
transformers use ``query - key``; T5 and the rest of relpos use ``key - query``. Both are
available: ``convention="query_minus_key"`` reproduces Swin's ``relative_position_index``
exactly, ``"key_minus_query"`` is its transpose.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from .._checks import check_choice, check_device, check_int

__all__ = ["Convention", "normalize_window_size", "window_coords", "window_relative_position_index", "table_size"]

Convention = Literal["query_minus_key", "key_minus_query"]


def normalize_window_size(window_size: int | Sequence[int], ndim: int | None = None, *, name: str = "window_size") -> tuple[int, ...]:
    """``7 -> (7,)`` or ``(7, 7)`` (by ``ndim``); sequences are checked element by element.

    ``name`` is the argument's name in error messages.
    """
    if isinstance(window_size, Sequence) and not isinstance(window_size, str):
        sizes = tuple(window_size)
        if ndim is not None and len(sizes) != ndim:
            raise ValueError(f"{name} must have {ndim} entr{'y' if ndim == 1 else 'ies'}, got {window_size!r}")
        if len(sizes) not in (1, 2):
            raise ValueError(f"{name} must have 1 or 2 entries, got {window_size!r}")
    else:
        check_int(name, window_size, minimum=1)
        sizes = (int(window_size),) * (ndim or 1)
    return tuple(check_int(f"{name}[{k}]", s, minimum=1) for k, s in enumerate(sizes))


def window_coords(window_size: int | Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """(ndim, N) coordinates of the window's positions in raster order.

    >>> window_coords((2, 3))
    tensor([[0, 0, 0, 1, 1, 1],
            [0, 1, 2, 0, 1, 2]])
    """
    sizes = normalize_window_size(window_size)
    device = check_device("device", device)
    grids = torch.meshgrid(*[torch.arange(s, device=device) for s in sizes], indexing="ij")
    return torch.stack(grids).flatten(1)  # (ndim, N)


def table_size(window_size: int | Sequence[int]) -> int:
    """Number of distinct offsets: ``prod(2 * W_k - 1)``."""
    size = 1
    for s in normalize_window_size(window_size):
        size *= 2 * s - 1
    return size


def window_relative_position_index(
    window_size: int | Sequence[int],
    *,
    convention: Convention = "query_minus_key",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(N, N) index into a ``(table_size(window_size), H)`` bias table.

    ``window_size`` an int or ``(W,)`` gives the 1D table (N = W); ``(Wh, Ww)`` the 2D one
    (N = Wh * Ww). With Swin's convention the index of (query p, key r) is
    ``(dh + Wh - 1) * (2 * Ww - 1) + (dw + Ww - 1)`` with ``d = p - r``.

    >>> window_relative_position_index(4)      # the Swin indexing notes, 1D
    tensor([[3, 2, 1, 0],
            [4, 3, 2, 1],
            [5, 4, 3, 2],
            [6, 5, 4, 3]])
    >>> window_relative_position_index((2, 2))
    tensor([[4, 3, 1, 0],
            [5, 4, 2, 1],
            [7, 6, 4, 3],
            [8, 7, 5, 4]])
    """
    convention = check_choice("convention", convention, ("query_minus_key", "key_minus_query"))
    device = check_device("device", device)
    sizes = normalize_window_size(window_size)
    coords = window_coords(sizes, device=device)  # (ndim, N)
    rel = coords[:, :, None] - coords[:, None, :]  # (ndim, N, N): query - key
    if convention == "key_minus_query":
        rel = -rel
    index = torch.zeros(rel.shape[1:], dtype=torch.long, device=device)  # (N, N)
    for axis, size in enumerate(sizes):  # mixed radix: last axis fastest, like Swin
        index = index * (2 * size - 1) + rel[axis] + size - 1
    return index
