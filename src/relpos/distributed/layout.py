"""Which global positions each rank of a context-parallel group holds, and moving tensors to and from that layout.

A sequence of ``L`` tokens is split along its length across the ``P`` ranks of a ``torch.distributed`` group;
every rank holds ``Lc = L / P`` of them:

* ``"contiguous"``: rank ``r`` holds positions ``r Lc .. (r + 1) Lc - 1``;
* ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``Lc / 2`` and rank ``r`` holds chunks ``r`` and
  ``2P - 1 - r``, so that under a causal mask every rank has the same number of visible scores.

>>> [segments(r, 2, 4, "zigzag") for r in range(2)]      # L = 8: rank 0 holds 0 1 6 7, rank 1 holds 2 3 4 5
[(Segment(start=0, local=0, length=2), Segment(start=6, local=2, length=2)), (Segment(start=2, local=0, length=2), Segment(start=4, local=2, length=2))]
>>> global_positions(0, 2, 4, "zigzag")
tensor([0, 1, 6, 7])

A length that ``P`` (zigzag: ``2P``) does not divide is refused, not padded silently: pad the sequence to a
multiple and pass a ``key_mask`` (the padded keys then cost nothing; see docs/distributed.md).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from .._checks import check_choice, check_int, check_tensor

__all__ = ["LAYOUTS", "Layout", "Segment", "global_positions", "pieces", "segments", "shard", "unshard"]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


class Segment(NamedTuple):
    """``length`` tokens at global positions ``start ..``, stored at rows ``local ..`` of the rank's shard."""

    start: int
    local: int
    length: int


def _parts(layout: str, world: int) -> int:
    return world if layout == "contiguous" else 2 * world


def check_length(name: str, length: int, world: int, layout: str) -> None:
    """Refuse a global length the layout cannot split evenly, naming the multiple to pad to."""
    parts = _parts(layout, world)
    if length % parts:
        padded = -(-length // parts) * parts
        raise ValueError(
            f"{name}={length} does not split evenly for layout={layout!r} over {world} ranks ({parts} equal parts); "
            f"pad the sequence to {padded} and mark the padding with key_mask"
        )


def segments(rank: int, world: int, local_length: int, layout: Layout) -> tuple[Segment, ...]:
    """The global positions of rank ``rank``'s ``local_length`` rows, as contiguous segments."""
    if layout == "contiguous":
        return (Segment(rank * local_length, 0, local_length),)
    half = local_length // 2
    return Segment(rank * half, 0, half), Segment((2 * world - 1 - rank) * half, half, half)


def pieces(segs: tuple[Segment, ...], rows: int) -> tuple[Segment, ...]:
    """Each segment cut into pieces of ``rows`` tokens, the last one shorter (the unit of work and of each message).

    >>> pieces((Segment(0, 0, 5),), 2)
    (Segment(start=0, local=0, length=2), Segment(start=2, local=2, length=2), Segment(start=4, local=4, length=1))
    """
    out = []
    for seg in segs:
        out += [Segment(seg.start + a, seg.local + a, min(rows, seg.length - a)) for a in range(0, seg.length, rows)]
    return tuple(out)


def global_positions(rank: int, world: int, local_length: int, layout: Layout, *, device=None) -> torch.Tensor:
    """(Lc,) global position of each local row."""
    return torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in segments(rank, world, local_length, layout)])


def _checked(x, dim: int, world: int, rank: int, layout) -> int:
    check_tensor("x", x)
    layout = check_choice("layout", layout, LAYOUTS)
    check_int("world", world, minimum=1)
    rank = check_int("rank", rank, minimum=0)
    if rank >= world:
        raise ValueError(f"rank must be < world={world}, got {rank}")
    dim = check_int("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of {x.dim()} dimensions")
    return dim % x.dim()


def shard(x: torch.Tensor, dim: int, rank: int, world: int, layout: Layout = "contiguous") -> torch.Tensor:
    """Rank ``rank``'s part of the whole-sequence tensor ``x`` along ``dim`` (a copy for zigzag, a view otherwise).

    >>> shard(torch.arange(8), 0, 1, 2, "zigzag")
    tensor([2, 3, 4, 5])
    """
    dim = _checked(x, dim, world, rank, layout)
    check_length(f"x.shape[{dim}]", x.shape[dim], world, layout)
    local = x.shape[dim] // world
    parts = [x.narrow(dim, s.start, s.length) for s in segments(rank, world, local, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int, layout: Layout = "contiguous") -> torch.Tensor:
    """The whole-sequence tensor from every rank's part, ``parts[r]`` from rank ``r`` (the inverse of :func:`shard`).

    >>> unshard([shard(torch.arange(8), 0, r, 2, "zigzag") for r in range(2)], 0, "zigzag")
    tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    if not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError(f"parts must be a non-empty list of tensors, one per rank, got {type(parts).__name__}")
    world = len(parts)
    dim = _checked(parts[0], dim, world, 0, layout)
    local = parts[0].shape[dim]
    pieces_at = []
    for rank, part in enumerate(parts):
        if part.shape != parts[0].shape:
            raise ValueError(f"parts[{rank}] has shape {tuple(part.shape)} but parts[0] has {tuple(parts[0].shape)}")
        pieces_at += [(s.start, part.narrow(dim, s.local, s.length)) for s in segments(rank, world, local, layout)]
    return torch.cat([p for _, p in sorted(pieces_at, key=lambda item: item[0])], dim)
