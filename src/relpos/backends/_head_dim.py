"""The head dimensions SDPA's fused kernels take, for paths that widen the heads with extra channels.

A position term folded into extra query/key channels (Falcon's per-key ALiBi, SAM's decomposed
positions) changes the head dimension. On CUDA, SDPA's flash, memory-efficient and cuDNN kernels
want a multiple of 8 and send any other head dimension to the math kernel, which holds
``(B, H, Lq, Lk)`` scores; zero channels pad it instead (zeros add nothing to ``q . k`` and give
zero output channels, which the caller drops).
"""

from __future__ import annotations

import torch

__all__ = ["MULTIPLE", "fused_head_dim"]

#: device type -> the multiple SDPA's fused kernels want there (absent: any head dimension)
MULTIPLE: dict[str, int] = {"cuda": 8}


def fused_head_dim(dim: int, device: torch.device) -> int:
    """``dim`` rounded up to the multiple SDPA's fused kernels want on ``device``.

    >>> fused_head_dim(65, torch.device("cuda")), fused_head_dim(65, torch.device("cpu"))
    (72, 65)
    """
    multiple = MULTIPLE.get(device.type, 1)
    return -(-dim // multiple) * multiple
