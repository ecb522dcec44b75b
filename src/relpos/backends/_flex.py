"""The ``flex`` backend: compiled FlexAttention reading the per-offset bias in its score_mod.

``score_mod`` adds ``values[h, kv_idx - q_idx + Lq - 1]``: the bias is looked up, never
materialized. A causal mask and key padding become a block mask (fully masked blocks are
skipped). On GPU
FlexAttention differentiates through the captured ``values`` (the table gets its gradient); on
CPU torch supports it for inference only. Each new shape compiles once (seconds).
"""

from __future__ import annotations

from functools import lru_cache

import torch

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


def _block_mask(batch, query_length, key_length, *, causal, q_offset, key_keep, device):
    """Block mask for the causal triangle and/or key padding (fully masked blocks are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if not causal and key_keep is None:
        return None

    def keep(b, h, q_idx, kv_idx):
        visible = kv_idx <= q_idx + q_offset if causal else kv_idx >= 0
        return visible & key_keep[b, kv_idx] if key_keep is not None else visible

    return create_block_mask(
        keep, None if key_keep is None else batch, None, query_length, key_length, device=device
    )


def flex_biased_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    q_offset: int = 0,
    key_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, H, Lq, d) attention with the per-offset bias ``values`` (Hb, Lq + Lk - 1, fp32) via compiled flex.

    ``key_keep``: (B, Lk) boolean, keys to attend to (padding). A query row with no key returns 0.
    """
    batch, _, query_length, _ = query.shape
    key_length = key.shape[-2]
    block_mask = _block_mask(
        batch, query_length, key_length, causal=causal, q_offset=q_offset, key_keep=key_keep, device=query.device
    )
    # Every new (Lq, Lk) compiles a kernel. Past dynamo's default limit of 8 it would silently fall
    # back to unfused flex, which materializes (B, H, Lq, Lk): allow many shapes instead.
    with torch._dynamo.config.patch(recompile_limit=_MAX_SHAPES):
        return _compiled_flex()(
            query, key, value, score_mod=_score_mod(values, query_length), block_mask=block_mask, scale=scale
        )
