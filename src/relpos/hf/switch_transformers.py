"""SwitchTransformers (mixture-of-experts T5) on relpos attention.

Its attention module is T5's under another name (``SwitchTransformersAttention``: buckets
bidirectional in the encoder, causal in the decoder, layer 0 of each stack owns the table) and calls
transformers' attention interface, so the T5-like adapter applies as is; the routers and experts are
untouched. transformers 5.23 runs this family eager only (no sdpa): relpos is its first fused path.
"""

from __future__ import annotations

from ._family import register
from ._t5like import t5_like_family

__all__ = ["FAMILY"]

FAMILY = register(
    t5_like_family(
        "switch_transformers",
        "SwitchTransformers",
        ("switch_transformers",),
        ("SwitchTransformersAttention",),
        bidirectional=lambda module: not module.is_decoder,
        extra_attributes=("is_decoder",),
    )
)
