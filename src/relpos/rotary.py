"""Rotary position embedding, RoPE (Su et al., RoFormer, 2021).

Queries and keys are rotated, pair of channels by pair of channels, by an angle proportional
to their position, so that ``q_i . k_j`` depends on ``j - i`` only. Two channel layouts:

* half-split (``interleaved=False``): channel ``c`` pairs with ``c + d/2``; GPT-NeoX and
  Llama, equal to transformers' ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``;
* interleaved (``interleaved=True``): channels ``(2c, 2c + 1)`` pair up; RoFormer, GPT-J.

Angles, cos and sin and the rotation itself are computed in float32 whatever the input dtype
(bf16 positions and angles lose whole radians at long lengths); the result is cast back.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ._checks import check_bool, check_int, check_positive_float

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """``forward(q, k, *, q_offset=0)`` returns ``(q_rot, k_rot)``.

    Args:
        head_dim: rotated width ``d`` (even).
        base: ``theta``: frequencies ``base ** (-2c / d)``, c = 0 .. d/2 - 1.
        interleaved: channel layout (see the module docstring).
        inv_freq: explicit angular frequencies (radians per position), ``d/2`` of them,
            instead of ``base`` (for scaled variants or worked examples).

    q is ``(..., Lq, d)`` at positions ``q_offset .. q_offset + Lq - 1``; k is ``(..., Lk, d)``
    at ``0 .. Lk - 1``. With ``d = 2`` and one frequency ``pi/6`` a position ``p`` is rotated by
    ``30 p`` degrees:

    >>> import math
    >>> rope = RotaryEmbedding(2, inv_freq=[math.pi / 6])
    >>> q, k = rope(torch.tensor([[0., 1.]]), torch.tensor([[0., 1.], [0., 1.]]), q_offset=1)
    >>> q                         # position 1: [0, 1] rotated by 30 degrees
    tensor([[-0.5000,  0.8660]])
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        interleaved: bool = False,
        *,
        inv_freq: Sequence[float] | torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim, minimum=2)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (channels rotate in pairs), got {head_dim}")
        self.base = check_positive_float("base", base)
        self.interleaved = check_bool("interleaved", interleaved)
        if inv_freq is not None:
            inv_freq = torch.as_tensor(inv_freq, dtype=torch.float32).flatten()
            if inv_freq.numel() != self.head_dim // 2:
                raise ValueError(f"inv_freq must have head_dim/2={self.head_dim // 2} entries, got {inv_freq.numel()}")
        self._explicit_inv_freq = inv_freq
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self._init_buffers(device)

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        if self._explicit_inv_freq is not None:
            self.inv_freq = self._explicit_inv_freq.to(device)
        else:  # the same expression as transformers' default RoPE, for bit-equal angles
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
            self.inv_freq = 1.0 / (self.base**exponent)  # (d/2,)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, interleaved={self.interleaved}"

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(L, d)`` cos and sin for integer positions ``(L,)``, in this module's layout."""
        angles = positions.float()[:, None] * self.inv_freq.float()[None, :]  # (L, d/2)
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)  # (L, d): c0 c0 c1 c1 ...
        else:
            angles = torch.cat((angles, angles), dim=-1)  # (L, d): c0 c1 ... c0 c1 ...
        return angles.cos(), angles.sin()

    def rotate(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rotate ``x (..., L, d)`` as positions ``start .. start + L - 1`` (new keys of a KV cache)."""
        positions = torch.arange(start, start + x.shape[-2], device=x.device)
        cos, sin = self.cos_sin(positions)  # (L, d) each
        xf = x.float()
        if self.interleaved:
            pairs = xf.unflatten(-1, (-1, 2))  # (..., L, d/2, 2)
            turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (-x1, x0) per pair
        else:
            half = xf.shape[-1] // 2
            turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)  # (-x2, x1)
        return (xf * cos + turned * sin).to(x.dtype)  # (..., L, d)

    def forward(self, q: torch.Tensor, k: torch.Tensor, *, q_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        q_offset = check_int("q_offset", q_offset, minimum=0)
        for name, t in (("q", q), ("k", k)):
            if t.dim() < 2 or t.shape[-1] != self.head_dim:
                raise ValueError(f"{name} must be (..., L, head_dim={self.head_dim}), got {tuple(t.shape)}")
        return self.rotate(q, q_offset), self.rotate(k, 0)
