"""Tiles: the parts of the (B, Lq, Lk) score grid that attention must compute.

Padding and a causal mask hide whole regions of the grid. Instead of masking them inside a
(B, H, Lq, Lk) tensor, attention runs only on tiles ``(batch b0:b1, query rows r0:r1, keys
k0:k1)``: examples with the same kept-key run share a tile; a causal mask is cut into query
chunks of :data:`CAUSAL_CHUNK` rows, each reading only the keys up to its last query (the masked
triangle inside a chunk is folded into the per-offset bias as ``-inf``). Rows that see no key at
all (a fully padded example; left padding under a causal mask) are in no tile: their output is 0.

Inside a tile the bias is a Hankel *view* of the per-offset values (queries reversed):

    tile row r (query r1 - 1 - r), column c (key k0 + c)  ->  values[:, base + r + c],
    base = k0 - r1 + Lq

>>> plan_tiles(2, 4, 4, causal=True, key_ranges=((0, 4), (1, 4)), chunk=2)
[Tile(b0=0, b1=1, r0=0, r1=2, k0=0, k1=2), Tile(b0=0, b1=1, r0=2, r1=4, k0=0, k1=4), Tile(b0=1, b1=2, r0=1, r1=3, k0=1, k1=3), Tile(b0=1, b1=2, r0=3, r1=4, k0=1, k1=4)]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.bias import hankel_view

__all__ = ["CAUSAL_CHUNK", "Tile", "plan_tiles", "tile_bias"]

CAUSAL_CHUNK = 256  # query rows per causal chunk: measured best of 128..1024 at L = 4096 (docs/benchmarks/attention/index.md)


class Tile(NamedTuple):
    b0: int
    b1: int
    r0: int
    r1: int
    k0: int
    k1: int

    def bias_offset(self, query_length: int) -> int:
        """Index into the per-offset values of the tile's Hankel view at (row 0, column 0): ``k0 - r1 + Lq``."""
        return self.k0 - self.r1 + query_length


def _groups(batch: int, key_length: int, key_ranges) -> list[tuple[int, int, int, int]]:
    """Consecutive examples with the same kept-key run: (b0, b1, start, end)."""
    if key_ranges is None:
        return [(0, batch, 0, key_length)]
    groups: list[list[int]] = []
    for b, (s, e) in enumerate(key_ranges):
        if groups and (groups[-1][2], groups[-1][3]) == (s, e):
            groups[-1][1] = b + 1
        else:
            groups.append([b, b + 1, s, e])
    return [tuple(g) for g in groups if g[3] > g[2]]


def plan_tiles(
    batch: int,
    query_length: int,
    key_length: int,
    *,
    q_offset: int = 0,
    causal: bool = False,
    key_ranges: tuple[tuple[int, int], ...] | None = None,
    chunk: int | None = None,
) -> list[Tile]:
    """Tiles covering every visible score exactly once; ``key_ranges[b] = (start, end)``.

    ``chunk``: query rows per causal chunk, :data:`CAUSAL_CHUNK` by default.
    """
    chunk = CAUSAL_CHUNK if chunk is None else chunk
    tiles = []
    for b0, b1, start, end in _groups(batch, key_length, key_ranges):
        if not causal:
            tiles.append(Tile(b0, b1, 0, query_length, start, end))
            continue
        first = max(0, start - q_offset)  # rows before it see no key
        full = max(first, min(query_length, end - q_offset))  # rows from here on see every key of the run
        for r0 in range(first, full, chunk):
            r1 = min(full, r0 + chunk)
            tiles.append(Tile(b0, b1, r0, r1, start, q_offset + r1))
        if full < query_length:
            tiles.append(Tile(b0, b1, full, query_length, start, end))
    return tiles


def tile_bias(values: torch.Tensor, tile: Tile, query_length: int) -> torch.Tensor:
    """(1, H, r1 - r0, k1 - k0) zero-copy view of ``values`` for the tile (its rows reversed)."""
    return hankel_view(values, tile.k1 - tile.k0, rows=tile.r1 - tile.r0, offset=tile.bias_offset(query_length))
