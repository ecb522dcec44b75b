"""KERPLE: kernelized relative positional embeddings (Chi, Fan, Ramadge & Rudnicky, NeurIPS 2022).

A conditionally positive definite kernel of the distance, with two learnable positive
parameters per head (the paper's ``r1``, ``r2``; the authors' code calls them ``bias_p`` and
``bias_a``):

* ``kind="log"``:   ``b[h, i, j] = -r1[h] * log(1 + r2[h] * |i - j|)``
* ``kind="power"``: ``b[h, i, j] = -r1[h] * |i - j| ** r2[h]``, ``0 < r2 <= 2``

It depends only on ``j - i``, so it is a :class:`~relpos.RelativeBias` and runs on every
per-offset path of :func:`relpos.attention` (zero-copy view on SDPA, the fused CPU training
path, tiles for padding and the causal triangle, flex).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import nn

from .._checks import check_choice, check_device, check_int, check_per_head
from ..core.bias import RelativeBias

__all__ = ["KerpleBias"]

#: the floor the authors' code clamps both parameters to (it keeps the kernel conditionally positive definite)
EPS = 1e-2


class KerpleBias(RelativeBias):
    """KERPLE's logarithmic or power kernel as an additive bias, learnable per head.

    Args:
        num_heads: heads; one ``(r1, r2)`` pair each.
        kind: ``"log"`` (the paper's best variant) or ``"power"``.
        r1, r2: initial values, a positive number for every head or one per head (power:
            ``r2 <= 2``). Default ``r1 = 1``, ``r2 = 1``: the authors' code draws them uniformly at
            random; fixed values keep runs reproducible without a seed.

    Training keeps the parameters positive as the authors' code does: their values are clamped
    to ``[1e-2, inf)`` (``r2`` of ``power`` to ``[1e-2, 2]``) where the bias is computed.

    >>> bias = KerpleBias(1, kind="log", r1=2.0, r2=1.0)
    >>> bias.materialize(3, 3)[0, 0]           # -2 log(1 + |i - j|)
    tensor([[ 0.0000, -1.3863, -2.1972],
            [-1.3863,  0.0000, -1.3863],
            [-2.1972, -1.3863,  0.0000]], grad_fn=<SelectBackward0>)
    >>> KerpleBias(1, kind="power", r1=0.5, r2=2.0).materialize(3, 3)[0, 0]   # -0.5 |i - j|^2
    tensor([[ 0.0000, -0.5000, -2.0000],
            [-0.5000,  0.0000, -0.5000],
            [-2.0000, -0.5000,  0.0000]], grad_fn=<SelectBackward0>)
    """

    def __init__(
        self,
        num_heads: int,
        kind: Literal["log", "power"] = "log",
        *,
        r1: float | Sequence[float] = 1.0,
        r2: float | Sequence[float] = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.kind = check_choice("kind", kind, ("log", "power"))
        r1 = check_per_head("r1", r1, self.num_heads)
        r2 = check_per_head("r2", r2, self.num_heads, maximum=2.0 if self.kind == "power" else None)
        self.r1 = nn.Parameter(torch.tensor(r1, device=device, dtype=dtype))  # (H,)
        self.r2 = nn.Parameter(torch.tensor(r2, device=device, dtype=dtype))  # (H,)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, kind={self.kind!r}"

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        r1 = self.r1.clamp(min=EPS)[:, None]  # (H, 1)
        distance = relative_position.abs().to(r1.dtype)[None, :]  # (1, n)
        if self.kind == "log":
            r2 = self.r2.clamp(min=EPS)[:, None]  # (H, 1)
            return 0.0 - r1 * torch.log1p(r2 * distance)  # (H, n); 0.0 - : no -0.0
        r2 = self.r2.clamp(min=EPS, max=2.0)[:, None]  # (H, 1)
        # |i - j| ** r2 with a finite gradient at distance 0 (0 ** r2 = 0; d/dr2 there is 0)
        powered = torch.where(distance > 0, distance.clamp(min=1.0) ** r2, torch.zeros_like(r2))  # (H, n)
        return 0.0 - r1 * powered  # (H, n)
