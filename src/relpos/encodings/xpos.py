"""xPos: extrapolatable position embedding (Sun et al., ACL 2023, "A Length-Extrapolatable
Transformer").

Rotary embedding (interleaved channel pairs, as in RoFormer and the authors' torchscale code)
with an exponential scale per pair: the query at position ``n`` is rotated and multiplied by
``zeta_c ** (n / gamma)``, the key at ``m`` rotated and multiplied by ``zeta_c ** (-m / gamma)``, so

``q_n . k_m = sum_c zeta_c ** ((n - m) / gamma) * (rotary term of pair c)``

depends only on ``n - m``, decaying with distance. The paper's names: ``zeta_c = (2c + 0.4 d) /
(1.4 d)`` for pair ``c = 0 .. d/2 - 1`` (``d = head_dim``), ``gamma = scale_base`` (512), ``theta``
the rotary base (10000).

The authors' code centres the exponent on the middle of each call (``n - (Lq + offset) // 2``):
the same logits, but keys cached by an earlier call would then carry another centre. Here
positions count from 0, so a KV cache of scaled keys stays exact. The factors stay in fp32 range
while ``n / gamma * log(1 / zeta_0) < 88``, about ``n < 35,000`` at ``gamma = 512``.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_bool, check_device, check_int, check_positive_float, check_tensor
from .rotary import RotaryEmbedding, apply_rotation

__all__ = ["XPos"]


class XPos(nn.Module):
    """``forward(q, k, *, q_offset=0)`` returns ``(q_up, k_down)``: rotated and scaled by ``zeta ** (+-n / gamma)``.

    Args:
        head_dim: ``d`` (even).
        scale_base: ``gamma`` (512 in the paper).
        base: the rotary base ``theta`` (10000).

    With ``d = 2`` (one pair, ``zeta = 0.4 / 1.4``), ``gamma = 1`` and the rotation frequency 1, the
    score of a query and a key both ``[1, 0]`` is ``zeta ** (n - m) cos(n - m)``:

    >>> xpos = XPos(2, scale_base=1.0)
    >>> q, k = xpos(torch.tensor([[1., 0.]]).expand(3, 2), torch.tensor([[1., 0.]]).expand(3, 2))
    >>> q @ k.T                       # [n, m]: zeta ** (n - m) cos(n - m)
    tensor([[ 1.0000,  1.8911, -5.0978],
            [ 0.1544,  1.0000,  1.8911],
            [-0.0340,  0.1544,  1.0000]])
    """

    def __init__(
        self, head_dim: int, *, scale_base: float = 512.0, base: float = 10000.0, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.head_dim = check_int("head_dim", head_dim, minimum=2)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for xPos (channels rotate and scale in pairs), got {head_dim}")
        self.scale_base = check_positive_float("scale_base", scale_base)
        self.rotary = RotaryEmbedding(self.head_dim, base, interleaved=True, device=device)
        self.register_buffer("log_zeta", torch.empty(0), persistent=False)
        self._init_buffers(device)

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        pair = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)  # (d/2,): 2c
        zeta = (pair + 0.4 * self.head_dim) / (1.4 * self.head_dim)  # (d/2,)
        self.log_zeta = zeta.log().repeat_interleave(2)  # (d,) interleaved pairs: c0 c0 c1 c1 ...

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, scale_base={self.scale_base}, base={self.rotary.base}"

    def scale(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 ``(L, d)`` factors ``zeta ** (n / gamma)`` for positions ``(L,)``."""
        return torch.exp(positions.float()[:, None] / self.scale_base * self.log_zeta[None, :])

    def rotate(self, x: torch.Tensor, start: int = 0, *, downscale: bool = False) -> torch.Tensor:
        """Rotate and scale ``x (..., L, d)`` as positions ``start ..``; ``downscale``: keys (``zeta ** -n``)."""
        start = check_int("start", start, minimum=0)
        check_bool("downscale", downscale)
        check_tensor("x", x, shape="(..., L, d)")
        if x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must be (..., L, head_dim={self.head_dim}), got {tuple(x.shape)}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating tensor, got {x.dtype}")
        return self.rotate_positions(x, torch.arange(start, start + x.shape[-2], device=x.device), downscale=downscale)

    def rotate_positions(
        self, x: torch.Tensor, positions: torch.Tensor, *, length: int | None = None, downscale: bool = False
    ) -> torch.Tensor:
        """Rotate and scale ``x (..., L, d)`` as the integer ``positions (L,)``; ``length`` as in RoPE's ``cos_sin``."""
        cos, sin = self.rotary.cos_sin(positions, length=length)  # (L, d) each
        scale = self.scale(-positions if downscale else positions)  # (L, d)
        return apply_rotation(x, cos * scale, sin * scale, interleaved=True)  # (..., L, d)

    def forward(self, q: torch.Tensor, k: torch.Tensor, *, q_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at ``q_offset ..`` scaled up, keys at ``0 ..`` scaled down."""
        return self.rotate(q, q_offset), self.rotate(k, 0, downscale=True)
