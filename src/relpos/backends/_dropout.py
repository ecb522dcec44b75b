"""Attention dropout masks that the eager and fused backends draw identically.

(The Triton kernel follows the same rounding, scale and one seed per call, but draws its bits with
Philox inside each tile: relpos/backends/_triton.py, :func:`_kept`.)

A call with ``dropout_p > 0`` takes one seed from torch's global RNG (so ``torch.manual_seed``
makes it reproducible). The keep-mask of example ``b``, query rows ``64 g .. 64 g + 63`` and every
key is drawn from a generator seeded by ``(seed, b, g)``: it depends on the position of a score,
never on how a backend tiles the work. So the fused path (which draws the block it needs in the
forward pass and again in the backward pass, never holding (B, H, Lq, Lk)) and the eager
reference (which draws everything) drop exactly the same attention weights.

Each weight is dropped when a 16-bit uniform integer falls below ``round(p * 2**16)``: the drop
probability is ``p`` rounded to a multiple of 2**-16 (:func:`effective_p`; flash-attention rounds
to 2**-8), and kept weights are scaled by ``1 / (1 - effective_p(p))``, so the expectation is
exact. Two 16-bit draws come from one 32-bit integer: cheaper than float draws on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from .._checks import check_probability

__all__ = ["ROWS", "check_dropout_p", "drop_weights", "draw_seed", "draw_seed_tensor", "effective_p", "keep_rows",
           "keep_dense"]

ROWS = 64  # query rows per generator


def draw_seed() -> int:
    """One seed from torch's default (CPU) generator."""
    return int(draw_seed_tensor("cpu").item())


def draw_seed_tensor(device) -> torch.Tensor:
    """The Triton kernel's seed: the same draw as :func:`draw_seed`, left a (1,) int64 tensor on ``device`` (the
    kernel reads it there: no host sync, and a compiled graph draws a new one per call). On the CPU it equals
    :func:`draw_seed` after the same ``torch.manual_seed``; on CUDA it comes from the device's generator."""
    return torch.randint(0, 2**62, (1,), device=device)


def effective_p(p: float) -> float:
    """The drop probability actually used: ``p`` rounded to a multiple of 2**-16."""
    return round(p * 65536) / 65536


def check_dropout_p(name: str, value: Any) -> float:
    """An attention dropout probability: a real number in [0, 1) that stays below 1 once rounded to a multiple of
    2**-16 (:func:`effective_p`; a ``p`` above ``1 - 2**-17`` would drop every weight and scale by ``1 / 0``)."""
    value = check_probability(name, value)
    if effective_p(value) == 1.0:
        raise ValueError(f"{name} must be below 1 - 2**-17 = {1 - 2**-17!r}: relpos rounds it to a multiple of 2**-16 "
                         f"and {value!r} rounds to 1, which drops every attention weight; got {value!r}")
    return value


def _group(seed: int, b: int, g: int, heads: int, key_length: int, p: float, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(hash((seed, b, g)) & (2**63 - 1))  # hash of ints is stable across processes
    count = heads * ROWS * key_length
    bits = torch.empty((count + 1) // 2, dtype=torch.int32, device=device).random_(-(2**31), 2**31 - 1, generator=gen)
    uniform = bits.view(torch.int16)[:count].view(heads, ROWS, key_length)  # (H, 64, Lk) uniform in [-2**15, 2**15)
    return uniform >= round(p * 65536) - 32768  # kept with probability 1 - effective_p(p)


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


def drop_weights(weights: torch.Tensor, p: float) -> torch.Tensor:
    """Attention weights (B, H, Lq, Lk) with dropout: one seed drawn, kept weights scaled by ``1 / (1 - effective_p(p))``."""
    keep = keep_dense(draw_seed(), *weights.shape, p, device=weights.device)  # (B, H, Lq, Lk)
    return weights * keep / (1.0 - effective_p(p))
