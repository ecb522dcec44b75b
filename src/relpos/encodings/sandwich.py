"""Sandwich (Chi, Fan, Rudnicky & Ramadge, ACL 2023, "Dissecting Transformer Length
Extrapolation via the Lens of Receptive Field Analysis").

The inner product of two sinusoidal position embeddings used as a bias, shifted to be 0 on the
diagonal and compressed per head, with no parameters:

``b[h, i, j] = (sum_{k=1}^{d'/2} cos((i - j) / 10000 ** (2k / d')) - d'/2) / (8 h' / H)``,
``h' = h + 1``, ``d'`` the embedding dimension (the paper's ``d'``; ``dim`` here). The head
compression ``8 h' / H`` follows ALiBi's slope schedule; this form is the one in NVIDIA NeMo's
``SandwichRelativePositionEmbedding`` (the paper's authors' implementation).

It depends only on ``j - i``: a :class:`~relpos.RelativeBias` on every per-offset path.
"""

from __future__ import annotations

import torch

from .._checks import check_device, check_int
from ..core.bias import RelativeBias

__all__ = ["SandwichBias"]


class SandwichBias(RelativeBias):
    """The sinusoidal inner product ``p_i . p_j`` as a per-head additive bias.

    Args:
        num_heads: ``H``; head ``h`` divides the bias by ``8 (h + 1) / H``.
        dim: ``d'``, the sinusoid's width (even), usually the model width.

    >>> SandwichBias(1, dim=16).materialize(3, 3)[0, 0]    # (sum_k cos((i - j) 10000^(-k/8)) - 8) / 8
    tensor([[ 0.0000, -0.0069, -0.0269],
            [-0.0069,  0.0000, -0.0069],
            [-0.0269, -0.0069,  0.0000]])
    """

    def __init__(self, num_heads: int, dim: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.dim = check_int("dim", dim, minimum=2)
        if self.dim % 2:
            raise ValueError(f"dim must be even (sin and cos come in pairs), got {dim}")
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("head_scale", torch.empty(0), persistent=False)
        self._inner_cache: torch.Tensor | None = None  # per-distance sums, filled on first use
        self._init_buffers(device)

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        k = torch.arange(1, self.dim // 2 + 1, dtype=torch.float64, device=device)  # (d'/2,)
        self.inv_freq = 10000.0 ** (-2.0 * k / self.dim)  # (d'/2,) fp64: summing d'/2 cosines loses digits in fp32
        heads = torch.arange(1, self.num_heads + 1, dtype=torch.float64, device=device)  # (H,)
        self.head_scale = 8.0 * heads / self.num_heads  # (H,)
        self._inner_cache = None

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, dim={self.dim}"

    def _inner_by_distance(self, farthest: int, device: torch.device) -> torch.Tensor:
        """``sum_k cos(r w_k) - d'/2`` for r = 0 .. at least ``farthest`` (fp64), computed once and kept:
        d'/2 cosines per offset cost more than the attention they bias (measured 1.27x -> the Kerple
        ratio at L = 2048; docs/benchmarks/encodings/index.md); cos is even, so |r| indexes it."""
        cached = self._inner_cache
        if cached is None or cached.device != device or cached.numel() <= farthest:
            size = max(farthest + 1, 2 * (0 if cached is None else cached.numel()))  # grow geometrically
            distance = torch.arange(size, dtype=torch.float64, device=device)  # (R,)
            angles = distance[:, None] * self.inv_freq.to(device)[None, :]  # (R, d'/2)
            cached = self._inner_cache = angles.cos().sum(-1) - self.dim / 2  # (R,): 0 at r = 0, negative elsewhere
        return cached

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        distance = relative_position.abs()  # (n,)
        if torch.compiler.is_compiling() or distance.numel() == 0 or distance.is_floating_point():
            # traced (no data-dependent table size), or fractional offsets: the formula directly
            inner = (distance.double()[:, None] * self.inv_freq[None, :]).cos().sum(-1) - self.dim / 2  # (n,)
        else:
            inner = self._inner_by_distance(int(distance.max()), distance.device)[distance.long()]  # (n,)
        return (inner[None, :] / self.head_scale[:, None]).float()  # (H, n)
