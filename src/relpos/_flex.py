"""The ``flex`` backend: compiled FlexAttention reading the per-offset bias in its score_mod.

``score_mod`` adds ``values[h, kv_idx - q_idx + Lq - 1]``: the bias is looked up, never
materialized. A causal mask becomes a block mask (fully masked blocks are skipped). On GPU
FlexAttention differentiates through the captured ``values`` (the table gets its gradient); on
CPU torch supports it for inference only. Each new shape compiles once (seconds).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .bias import OffsetBias

__all__ = ["flex_biased_attention"]

_MAX_SHAPES = 256


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _score_mod(values: torch.Tensor, query_length: int):
    last = query_length - 1
    if values.shape[0] == 1:  # one bias shared by every head

        def shared(score, b, h, q_idx, kv_idx):
            return score + values[0, kv_idx - q_idx + last]

        return shared

    def per_head(score, b, h, q_idx, kv_idx):
        return score + values[h, kv_idx - q_idx + last]

    return per_head


def flex_biased_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: OffsetBias, *, causal: bool, scale: float
) -> torch.Tensor:
    """(B, H, Lq, d) attention with a per-offset bias via compiled ``flex_attention``."""
    from torch.nn.attention.flex_attention import create_block_mask

    query_length, key_length = query.shape[-2], key.shape[-2]
    values = bias.values.to(device=query.device, dtype=torch.float32)  # (H|1, Lq + Lk - 1)
    block_mask = None
    if causal:
        q_offset = bias.q_offset

        def causal_mask(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + q_offset

        block_mask = create_block_mask(causal_mask, None, None, query_length, key_length, device=query.device)
    # Every new (Lq, Lk) compiles a kernel. Past dynamo's default limit of 8 it would silently fall
    # back to unfused flex, which materializes (B, H, Lq, Lk): allow many shapes instead.
    with torch._dynamo.config.patch(recompile_limit=_MAX_SHAPES):
        return _compiled_flex()(
            query, key, value, score_mod=_score_mod(values, query_length), block_mask=block_mask, scale=scale
        )
