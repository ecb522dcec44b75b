"""T5, mT5 and UMT5 on relpos attention (the first T5-like adapter).

T5 and mT5 own a bias table in layer 0 of each stack and pass the bias on to later layers; UMT5
owns one in every self-attention layer. Encoder buckets are bidirectional, decoder buckets causal.
What :func:`relpos.hf.accelerate` changes is described in :mod:`relpos.hf._t5like`.
"""

from __future__ import annotations

from ._attention import relpos_attention_forward
from ._family import register
from ._t5like import TableOffsets, t5_like_family

__all__ = ["FAMILY", "SUPPORTED_MODEL_TYPES", "TableOffsets", "relpos_attention_forward"]

#: config.model_type -> the attention class of that family (all share T5Attention's interface)
SUPPORTED_MODEL_TYPES = {"t5": "T5Attention", "mt5": "MT5Attention", "umt5": "UMT5Attention"}

FAMILY = register(
    t5_like_family(
        "t5",
        "T5, FLAN-T5, ByT5, mT5, UMT5",
        tuple(SUPPORTED_MODEL_TYPES),
        tuple(SUPPORTED_MODEL_TYPES.values()),
        bidirectional=lambda module: not module.is_decoder,
        extra_attributes=("is_decoder",),
    )
)
