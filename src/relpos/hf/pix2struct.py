"""Pix2Struct (screenshot parsing) on relpos attention: its text decoder.

``Pix2StructTextAttention`` is T5's attention with causal buckets in every use (its
``compute_bias`` passes ``bidirectional=False``) and layer 0 owning the table. The vision encoder
has no relative bias (its patches carry learned row and column embeddings), so it keeps
transformers' attention implementation choice under relpos too: relpos runs it with no bias.
"""

from __future__ import annotations

from ._family import register
from ._t5like import t5_like_family

__all__ = ["FAMILY"]

FAMILY = register(
    t5_like_family(
        "pix2struct",
        "Pix2Struct (text decoder; the vision encoder has no relative bias)",
        ("pix2struct", "pix2struct_text_model"),
        ("Pix2StructTextAttention",),
        bidirectional=lambda module: False,
    )
)
