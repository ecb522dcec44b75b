"""Queries at a cache position: the per-offset bias over a preallocated (static) cache.

A static cache (``cache_implementation="static"``, transformers' ``StaticCache``) hands attention
its whole preallocated keys, the unseen tail included, and its length as a 0-d tensor. The queries
are then not the last ``Lq`` keys but the ``Lq`` positions from that length on. Every family that
supports such a cache (the T5 family, Bloom, MPT, Falcon) builds its bias here, so the index
arithmetic exists once:

* :func:`positioned_offsets`: the bias per offset, shifted by the position (a tensor or an int,
  never read as a Python number: no graph break and no recompilation per step under
  ``torch.compile``, no device sync), every key after a query's position at ``-inf``;
* :func:`future_keys`: the same ``key > position + row`` rule as a ``(Lq, Lk)`` boolean, for the
  dense paths (a decoding step's few rows, a dense term).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..core.bias import OffsetBias

__all__ = ["PositionedOffsets", "TableOffsets", "future_keys", "positioned_offsets"]


@dataclass(frozen=True)
class TableOffsets(OffsetBias):
    """An :class:`OffsetBias` that remembers the table it was read from (to check gradients reach it)."""

    table: torch.Tensor | None = None


@dataclass(frozen=True)
class PositionedOffsets(TableOffsets):
    """The bias of queries at ``position`` over a preallocated (static) cache, the causal mask folded in.

    Stored as an :class:`OffsetBias` with ``q_offset=0`` whose values are shifted by the position:
    ``values[h, t]`` is the bias at offset ``t - (Lq - 1) - position``, so row ``i`` and key ``j`` read
    the bias of ``j - (position + i)``. Every key after a query's position (the causal triangle and
    the cache's unseen tail) is ``-inf`` in the values, and attention runs with ``causal=False``
    (:attr:`causal_folded`). :meth:`offsets` and :attr:`q_offset` are the nominal, unshifted ones.
    """

    position: torch.Tensor | int = 0
    #: the causal mask is in the values: attention runs with ``causal=False``
    causal_folded: ClassVar[bool] = True


def positioned_offsets(
    values_at: Callable[[torch.Tensor], torch.Tensor],
    query_length: int,
    key_length: int,
    position: torch.Tensor | int,
    *,
    device: torch.device | str | None = None,
    table: torch.Tensor | None = None,
) -> PositionedOffsets:
    """:class:`PositionedOffsets` for queries at ``position .. position + Lq - 1`` of ``key_length`` cache keys.

    ``values_at(rel)`` gives the bias ``(H, n)`` at the ``(n,)`` relative positions ``rel = j - i``.

    >>> zeros = lambda rel: torch.zeros(1, rel.numel())
    >>> b = positioned_offsets(zeros, 2, 4, torch.tensor(1))
    >>> b.dense()[0, 0]  # (Lq, Lk): queries at positions 1 and 2 of a 4-key cache; keys after them hidden
    tensor([[0., 0., -inf, -inf],
            [0., 0., 0., -inf]])
    """
    if isinstance(position, torch.Tensor):
        position = position.to(device=device, dtype=torch.long)
    entries = torch.arange(query_length + key_length - 1, device=device)  # (n,)
    rel = entries - (query_length - 1) - position  # (n,): entry t is offset t - (Lq - 1) - position
    values = values_at(rel).masked_fill(rel > 0, float("-inf"))  # (H, n)
    return PositionedOffsets(values.contiguous(), query_length, key_length, 0, table=table, position=position)


def future_keys(query_length: int, key_length: int, position: torch.Tensor | int, device=None) -> torch.Tensor:
    """(Lq, Lk) boolean: key ``j`` lies after the position of query row ``i`` (``j > position + i``).

    >>> future_keys(2, 4, 1).int()
    tensor([[0, 0, 1, 1],
            [0, 0, 0, 1]], dtype=torch.int32)
    """
    rows = torch.arange(query_length, device=device)[:, None] + position  # (Lq, 1)
    return torch.arange(key_length, device=device)[None, :] > rows  # (Lq, Lk)
