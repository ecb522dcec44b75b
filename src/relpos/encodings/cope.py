"""CoPE: contextual position encoding (Golovneva, Wang, Weston & Sukhbaatar, 2024).

Positions are counted by gates the query computes on each key, ``g_ij = sigmoid(q_i . k_j *
scale)``; the position of key ``j`` seen from query ``i`` is the sum of the gates from ``j`` to the
last visible key, ``p_ij = sum_{t=j}^{i} g_it`` (causal), clamped to ``max_positions - 1``; the
logit gains ``q_i . e[p_ij]``, with ``e`` interpolated linearly between the learned integer
position vectors ``pos_emb`` (the paper's name, shape ``(1, head_dim, max_positions)`` as in its
code listing):

``logits_ij = scale * q_i . k_j + (p - floor p) q_i . e[ceil p] + (1 - p + floor p) q_i . e[floor p]``

Path: eager only. The positions are a cumulative sum along each query's row of the gated
scores, so every ``(B, H, Lq, Lk)`` score must exist before any weight can be formed: neither
SDPA's kernels nor a flex ``score_mod`` (which sees one score at a time) can express it. Decoding
needs no extra state: each new query row sums its own gates over the cached keys.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_bool, check_device, check_int, check_positive_float, check_scale, check_tensor
from ..backends._masks import check_key_mask
from ..backends.dispatch import masked_softmax
from ..core.offsets import relative_positions

__all__ = ["CoPE"]


class CoPE(nn.Module):
    """Contextual positions for one attention layer: ``attention(q, k, v)`` on the eager path.

    Args:
        head_dim: width of the queries (and of each position vector).
        max_positions: ``npos_max``: counted positions past ``max_positions - 1`` share the last vector.
        init_std: the position vectors' initial standard deviation (the paper's code starts them at
            0, i.e. 0.0, so a model starts with no position term).

    With queries and keys of zero content every gate is ``1/2``, so key ``j`` sits at
    ``p = (i - j + 1) / 2`` from query ``i``; with ``e[p] = [p]`` and ``q = [1]`` the position term is ``p``:

    >>> cope = CoPE(1, max_positions=4)
    >>> with torch.no_grad():
    ...     _ = cope.pos_emb.copy_(torch.arange(4.0).view(1, 1, 4))
    >>> cope.position_logits(torch.ones(1, 1, 3, 1), torch.zeros(1, 1, 3, 3), causal=True)[0, 0]
    tensor([[0.5000,   -inf,   -inf],
            [1.0000, 0.5000,   -inf],
            [1.5000, 1.0000, 0.5000]], grad_fn=<SelectBackward0>)
    """

    def __init__(
        self, head_dim: int, max_positions: int, *, init_std: float = 0.0,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.max_positions = check_int("max_positions", max_positions, minimum=1)
        self.pos_emb = nn.Parameter(torch.zeros(1, self.head_dim, self.max_positions, device=device, dtype=dtype))
        if not (isinstance(init_std, (int, float)) and not isinstance(init_std, bool) and init_std == 0):
            nn.init.normal_(self.pos_emb, std=check_positive_float("init_std", init_std))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}"

    def position_logits(self, query: torch.Tensor, scores: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
        """``scores (B, H, Lq, Lk)`` (scaled, masked with ``-inf``) plus CoPE's position term.

        ``causal``: also mask the keys after each query, the queries being the last ``Lq`` positions
        (:meth:`attention` masks with its own ``q_offset`` before calling this).
        """
        if causal:
            future = relative_positions(scores.shape[-2], scores.shape[-1], q_offset=scores.shape[-1] - scores.shape[-2],
                                        device=scores.device) > 0  # (Lq, Lk)
            scores = scores.masked_fill(future, float("-inf"))
        gates = torch.sigmoid(scores)  # (B, H, Lq, Lk): 0 where masked
        pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.max_positions - 1)  # (B, H, Lq, Lk)
        floor = pos.floor()
        weight = pos - floor  # (B, H, Lq, Lk): carries the gradient into the gates
        per_position = query.to(scores.dtype) @ self.pos_emb.to(scores.dtype)  # (B, H, Lq, npos)
        # e[floor p + 1] stands for e[ceil p]: they differ only where p is an integer, where the weight is 0
        per_position = torch.cat([per_position, per_position[..., -1:]], dim=-1)  # (B, H, Lq, npos + 1)
        index = floor.long()  # (B, H, Lq, Lk)
        low = per_position.gather(-1, index)  # (B, H, Lq, Lk)
        high = per_position.gather(-1, index + 1)  # (B, H, Lq, Lk)
        return scores + torch.lerp(low, high, weight)  # (B, H, Lq, Lk)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        causal: bool = False,
        key_mask: torch.Tensor | None = None,
        scale: float | None = None,
        q_offset: int | None = None,
    ) -> torch.Tensor:
        """``(B, H, Lq, dv)``: eager attention with contextual positions (fp32 at least).

        Queries are the last ``Lq`` positions of the ``Lk`` keys unless ``q_offset`` says otherwise
        (a decoding step: ``q_offset = cache length``); ``key_mask (B, Lk)`` is True for real tokens.
        """
        for name, t in (("query", query), ("key", key), ("value", value)):
            check_tensor(name, t, shape="(B, H, L, d)")
            if t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor (B, H, L, d), got shape {tuple(t.shape)}")
        if query.shape[-1] != self.head_dim or key.shape[-1] != self.head_dim:
            raise ValueError(f"query and key must have head_dim={self.head_dim}, got {query.shape[-1]} and {key.shape[-1]}")
        check_bool("causal", causal)
        batch, heads, query_length, _ = query.shape
        key_length = key.shape[2]
        q_offset = key_length - query_length if q_offset is None else check_int("q_offset", q_offset, minimum=0)
        scale = check_scale("scale", scale)
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        if key.shape[1] != heads:
            group = heads // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # (B, H, Lk, d)
        acc = torch.float64 if query.dtype == torch.float64 else torch.float32
        q, k, v = query.to(acc), key.to(acc), value.to(acc)
        scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, Lq, Lk)
        blocked = torch.zeros(query_length, key_length, dtype=torch.bool, device=q.device)  # (Lq, Lk)
        if causal:
            blocked = relative_positions(query_length, key_length, q_offset=q_offset, device=q.device) > 0
        if key_mask is not None:
            key_mask = check_key_mask(key_mask, batch, key_length, device=q.device)
            blocked = blocked | ~key_mask[:, None, None, :]  # (B, 1, Lq, Lk)
        scores = scores.masked_fill_(blocked, float("-inf"))  # in place: the product is not needed for its gradient
        weights = masked_softmax(self.position_logits(q, scores))  # (B, H, Lq, Lk)
        return (weights @ v).to(query.dtype)  # (B, H, Lq, dv)

    forward = attention
