"""FIRE: functional interpolation for relative positions (Li et al., ICLR 2024, "Functional
Interpolation for Relative Positions Improves Long Context Transformers").

A small MLP ``f_theta`` of the log-compressed distance, normalized by the query's position:

``b[h, i, j] = f_theta(psi(i - j) / psi(max(L, i)))[h]``,  ``psi(x) = log(|c x| + 1)``

with the paper's names: ``c`` (learnable, init 0.1), the threshold ``L = |L_multiplier * init_L|``
(``init_L`` fixed, ``L_multiplier`` learnable, init 1), ``f_theta`` = ``mlp`` (1 -> ``mlp_width``
-> ReLU -> ``num_heads``), and ``eps`` added to the normalizer. The parameter names are the ones of
the paper's code listing, so its weights load as they are.

Paths:

* every query at position ``i <= L``: the normalizer is ``psi(L)``, the same for every row, so the
  bias depends only on ``j - i``: FIRE resolves to an :class:`~relpos.OffsetBias` and runs on every
  per-offset path of :func:`relpos.attention` (zero-copy SDPA view, fused CPU training, tiles, flex);
* any query past ``L`` (inputs longer than the threshold, or decoding past it): the normalizer
  depends on ``i``, and FIRE resolves to the exact dense ``(1, H, Lq, Lk)`` bias. A decoding step
  has one query row, so that is one ``(1, H, 1, Lk)`` row per step.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_device, check_int, check_positive_float
from ..core.bias import OffsetBias, RelativeBias
from ..core.offsets import relative_positions

__all__ = ["FIREBias"]


class FIREBias(RelativeBias):
    """FIRE's learned function of the normalized log-distance, one output per head.

    Args:
        num_heads: heads (outputs of the MLP).
        mlp_width: hidden width of ``f_theta`` (32 in the paper).
        init_c: initial ``c`` (0.1 in the paper).
        init_L: the threshold's fixed scale ``init_L`` (512 in the paper); ``L = |L_multiplier * init_L|``.
        eps: added to the normalizer ``psi(max(L, i))``.

    With a one-unit identity MLP the bias shows ``psi(i - j) / psi(max(L, i))`` itself; at ``L = 2``
    the last query (``i = 3 > L``) is normalized by ``psi(3)`` instead of ``psi(2)``:

    >>> fire = FIREBias(1, mlp_width=1, init_c=1.0, init_L=2.0, eps=0.0)
    >>> with torch.no_grad():
    ...     for layer in (fire.mlp[0], fire.mlp[2]):
    ...         _ = layer.weight.fill_(1.0), layer.bias.zero_()
    ...     print(fire.materialize(4, 4)[0, 0])
    tensor([[0.0000, 0.6309, 1.0000, 1.2619],
            [0.6309, 0.0000, 0.6309, 1.0000],
            [1.0000, 0.6309, 0.0000, 0.6309],
            [1.0000, 0.7925, 0.5000, 0.0000]])
    """

    def __init__(
        self,
        num_heads: int,
        *,
        mlp_width: int = 32,
        init_c: float = 0.1,
        init_L: float = 512.0,  # noqa: N803 (the paper's name)
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        factory = {"device": device, "dtype": dtype}
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.mlp_width = check_int("mlp_width", mlp_width, minimum=1)
        init_c = check_positive_float("init_c", init_c)
        init_L = check_positive_float("init_L", init_L)  # noqa: N806
        self.eps = eps if eps == 0.0 else check_positive_float("eps", eps)
        self.mlp = nn.Sequential(nn.Linear(1, self.mlp_width, **factory), nn.ReLU(), nn.Linear(self.mlp_width, self.num_heads, **factory))
        self.c = nn.Parameter(torch.tensor(init_c, **factory))
        self.L_multiplier = nn.Parameter(torch.tensor(1.0, **factory))
        self.register_buffer("init_L", torch.tensor(init_L, **factory))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, mlp_width={self.mlp_width}"

    def threshold(self) -> torch.Tensor:
        """``L = |L_multiplier * init_L|`` (a 0-d tensor that carries the gradient)."""
        return (self.L_multiplier * self.init_L).abs()

    def per_offset(self, query_length: int, q_offset: int = 0) -> bool:
        """True when every query position ``q_offset .. q_offset + Lq - 1`` is at most ``L``."""
        return q_offset + query_length - 1 <= float(self.threshold().detach())

    def _psi(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log((self.c * x).abs() + 1)

    def _f(self, normalized: torch.Tensor) -> torch.Tensor:
        """``f_theta`` over any ``(...)`` tensor: ``(..., H)``."""
        return self.mlp(normalized.unsqueeze(-1))

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        """(H, n) values at offsets ``j - i`` for queries at positions ``<= L`` (normalizer ``psi(L)``)."""
        normalizer = self._psi(self.threshold()) + self.eps  # () the same for every row up to L
        distance = self._psi(relative_position.to(self.c.dtype))  # (n,) psi is even: |c (j - i)| = |c (i - j)|
        return self._f(distance / normalizer).transpose(0, 1)  # (H, n)

    def offsets(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> OffsetBias:
        if not self.per_offset(query_length, q_offset):
            raise ValueError(
                f"FIRE is per-offset only for query positions <= L={float(self.threshold().detach()):g}; this call has queries up "
                f"to {q_offset + query_length - 1}: use .materialize() (or relpos.attention, which does)"
            )
        return super().offsets(query_length, key_length, q_offset=q_offset, device=device)

    def materialize(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The exact dense ``(1, H, Lq, Lk)`` bias, each row normalized by ``psi(max(L, i))``."""
        check_int("query_length", query_length, minimum=1)
        check_int("key_length", key_length, minimum=1)
        q_offset = check_int("q_offset", q_offset, minimum=0)
        dev = self.c.device
        rel = relative_positions(query_length, key_length, q_offset=q_offset, device=dev).to(self.c.dtype)  # (Lq, Lk)
        positions = torch.arange(q_offset, q_offset + query_length, device=dev, dtype=self.c.dtype)  # (Lq,)
        normalizer = self._psi(torch.maximum(positions, self.threshold())) + self.eps  # (Lq,)
        bias = self._f(self._psi(rel) / normalizer[:, None]).permute(2, 0, 1)[None]  # (1, H, Lq, Lk)
        return bias if device is None else bias.to(device)

    def resolve(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> OffsetBias | torch.Tensor:
        """Per-offset while every query is at most ``L``, the exact dense bias past it."""
        if self.per_offset(query_length, q_offset):
            return self.offsets(query_length, key_length, q_offset=q_offset, device=device)
        return self.materialize(query_length, key_length, q_offset=q_offset, device=device)

