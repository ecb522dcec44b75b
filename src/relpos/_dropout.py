"""Attention dropout masks that every relpos backend draws identically.

A call with ``dropout_p > 0`` takes one seed from torch's global RNG (so ``torch.manual_seed``
makes it reproducible). The keep-mask of example ``b``, query rows ``64 g .. 64 g + 63`` and every
key is drawn from a generator seeded by ``(seed, b, g)``: it depends on the position of a score,
never on how a backend tiles the work. So the fused path (which draws the block it needs in the
forward pass and again in the backward pass, never holding (B, H, Lq, Lk)) and the eager
reference (which draws everything) drop exactly the same attention weights.
"""

from __future__ import annotations

import torch

__all__ = ["ROWS", "draw_seed", "keep_rows", "keep_dense"]

ROWS = 64  # query rows per generator


def draw_seed() -> int:
    """One seed from torch's default (CPU) generator."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _group(seed: int, b: int, g: int, heads: int, key_length: int, p: float, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(hash((seed, b, g)) & (2**63 - 1))  # hash of ints is stable across processes
    return torch.rand((heads, ROWS, key_length), generator=gen, device=device) >= p  # (H, 64, Lk)


def keep_rows(
    seed: int, b: int, r0: int, r1: int, heads: int, key_length: int, p: float, device=None
) -> torch.Tensor:
    """(H, r1 - r0, Lk) keep-mask of example ``b``, query rows ``r0 .. r1 - 1``."""
    groups = [_group(seed, b, g, heads, key_length, p, device) for g in range(r0 // ROWS, (r1 - 1) // ROWS + 1)]
    block = groups[0] if len(groups) == 1 else torch.cat(groups, dim=1)  # (H, rows of the groups, Lk)
    start = r0 - (r0 // ROWS) * ROWS
    return block[:, start : start + r1 - r0]


def keep_dense(seed: int, batch: int, heads: int, query_length: int, key_length: int, p: float, device=None):
    """(B, H, Lq, Lk) keep-mask: the whole of what :func:`keep_rows` draws."""
    return torch.stack([keep_rows(seed, b, 0, query_length, heads, key_length, p, device) for b in range(batch)])
