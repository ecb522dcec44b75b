"""Pop2Piano (a T5 over audio features that writes MIDI tokens) on relpos attention.

``Pop2PianoAttention`` is T5's attention under another name (bidirectional encoder buckets, causal
decoder buckets, layer 0 of each stack owns the table): the T5-like adapter applies as is.
"""

from __future__ import annotations

from ._family import register
from ._t5like import t5_like_family

__all__ = ["FAMILY"]

FAMILY = register(
    t5_like_family(
        "pop2piano",
        "Pop2Piano",
        ("pop2piano",),
        ("Pop2PianoAttention",),
        bidirectional=lambda module: not module.is_decoder,
        extra_attributes=("is_decoder",),
    )
)
