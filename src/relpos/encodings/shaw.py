"""Relative key and value embeddings (Shaw, Uszkoreit & Vaswani, NAACL 2018).

Each clipped offset ``c = clip(j - i, -R, R)`` owns two learned vectors of the head width,
``a^K[c]`` and ``a^V[c]`` (shared by all heads, as in the paper)::

    e_ij = q_i . (k_j + a^K[c]) * scale            z_i = sum_j p_ij (v_j + a^V[c])

Neither term forms the (Lq, Lk, d) tensor ``a[c(i, j)]``: the logit term is ``q @ a^K.T``
(one column per offset, (B, H, Lq, 2R + 1)) gathered into (Lq, Lk); the output term sums the
attention weights per offset (scatter-add into (B, H, Lq, 2R + 1)) and multiplies by ``a^V``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_bool, check_device, check_int, check_positive_float, check_scale, check_tensor
from ..backends._dropout import check_dropout_p, drop_weights
from ..backends._fused import accumulate_dtype
from ..backends._masks import check_attn_mask
from ..backends.dispatch import _dense_mask, masked_softmax
from ..core.offsets import relative_positions

__all__ = ["ShawRelativePosition"]


class ShawRelativePosition(nn.Module):
    """Learned ``a^K`` (``rel_keys``) and ``a^V`` (``rel_values``), ``(2R + 1, head_dim)`` each.

    Row ``c`` holds offset ``c - R`` (``key - query``). ``attention(q, k, v)`` runs attention
    with both terms; ``logits(q, Lk)`` and ``output(weights)`` give each term alone.

    >>> shaw = ShawRelativePosition(head_dim=2, max_distance=1)
    >>> shaw.index(3, 4)          # which row of rel_keys / rel_values each (query, key) pair uses
    tensor([[1, 2, 2, 2],
            [0, 1, 2, 2],
            [0, 0, 1, 2]])
    """

    def __init__(
        self,
        head_dim: int,
        max_distance: int,
        *,
        values: bool = True,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.max_distance = check_int("max_distance", max_distance, minimum=0)
        check_bool("values", values)
        init_std = check_positive_float("init_std", init_std)
        rows = 2 * self.max_distance + 1
        self.rel_keys = nn.Parameter(torch.randn(rows, self.head_dim, device=device, dtype=dtype) * init_std)
        self.rel_values = (
            nn.Parameter(torch.randn(rows, self.head_dim, device=device, dtype=dtype) * init_std) if values else None
        )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_distance={self.max_distance}, values={self.rel_values is not None}"

    def index(self, query_length: int, key_length: int, *, q_offset: int = 0, device=None) -> torch.Tensor:
        """(Lq, Lk) row of ``rel_keys``/``rel_values`` used by each (query, key) pair."""
        rel = relative_positions(query_length, key_length, q_offset=q_offset, device=device)
        return rel.clamp(-self.max_distance, self.max_distance) + self.max_distance  # (Lq, Lk)

    def logits(self, q: torch.Tensor, key_length: int, *, q_offset: int = 0) -> torch.Tensor:
        """``q_i . a^K[c(i, j)]``, (..., Lq, Lk), unscaled."""
        per_offset = q @ self.rel_keys.to(q.dtype).T  # (..., Lq, 2R+1)
        index = self.index(q.shape[-2], key_length, q_offset=q_offset, device=q.device)  # (Lq, Lk)
        return per_offset.gather(-1, index.expand(*q.shape[:-2], -1, -1))  # (..., Lq, Lk)

    def output(self, weights: torch.Tensor, *, q_offset: int = 0) -> torch.Tensor:
        """``sum_j p_ij a^V[c(i, j)]``, (..., Lq, d), for attention weights (..., Lq, Lk)."""
        if self.rel_values is None:
            raise ValueError("this ShawRelativePosition was built with values=False; it has no a^V term")
        index = self.index(weights.shape[-2], weights.shape[-1], q_offset=q_offset, device=weights.device)
        per_offset = weights.new_zeros(*weights.shape[:-1], 2 * self.max_distance + 1)  # (..., Lq, 2R+1)
        per_offset = per_offset.scatter_add(-1, index.expand(*weights.shape[:-2], -1, -1), weights)
        return per_offset @ self.rel_values.to(weights.dtype)  # (..., Lq, d)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        q_offset: int = 0,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        """Shaw attention, q ``(B, H, Lq, d)``, k/v ``(B, H, Lk, d)`` -> ``(B, H, Lq, d)``.

        Masking follows :func:`relpos.attention`: boolean keeps, floating adds, integer masks are
        refused; fully masked rows give zeros. Logits and softmax are computed in fp32.
        ``dropout_p`` drops attention weights exactly as :func:`relpos.attention` does (the masks of
        :mod:`relpos.backends._dropout`, seeded from torch's RNG); the dropped weights feed both the value
        term and the ``a^V`` term.
        """
        q_offset = check_int("q_offset", q_offset, minimum=0)
        dropout_p = check_dropout_p("dropout_p", dropout_p)
        causal = check_bool("causal", causal)
        scale = check_scale("scale", scale)
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, shape="(B, H, L, d)")
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(f"q and k must have head_dim={self.head_dim} channels, got {q.shape[-1]} and {k.shape[-1]}")
        attn_mask = check_attn_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), device=q.device)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        dtype = q.dtype
        q, k, v = (t.to(accumulate_dtype(dtype)) for t in (q, k, v))  # logits and softmax in fp32 (the rule)
        q = q * scale  # (B, H, Lq, d): scales both logit terms, one (Lq, d) pass instead of an (Lq, Lk) one
        scores = (q @ k.transpose(-2, -1)).add_(self.logits(q, k.shape[-2], q_offset=q_offset))  # (B, H, Lq, Lk)
        mask = _dense_mask(q, k.shape[-2], None, causal, attn_mask, q_offset)
        if mask is not None:
            scores = scores.add_(mask)  # in place: neither sum is needed for the gradient
        weights = masked_softmax(scores)  # (B, H, Lq, Lk)
        if dropout_p:
            weights = drop_weights(weights, dropout_p)  # (B, H, Lq, Lk): the same masks as relpos.attention
        out = weights @ v  # (B, H, Lq, d)
        if self.rel_values is not None:
            out = out + self.output(weights, q_offset=q_offset)
        return out.to(dtype)
