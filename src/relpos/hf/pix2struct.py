"""Pix2Struct (screenshot parsing) on relpos attention: its text decoder.

``Pix2StructTextAttention`` is T5's attention with causal buckets in every use (its
``compute_bias`` passes ``bidirectional=False``) and layer 0 owning the table. The vision encoder
has no relative bias (its patches carry learned row and column embeddings), so only the text
sub-config switches to relpos; the vision encoder keeps its implementation (its eager path also
returns attention weights that its encoder collects without passing ``output_attentions`` down).
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
        sub_config="text_config",
    )
)
