"""LongT5 on relpos attention: its decoder.

LongT5's decoder attention (``LongT5Attention``) is T5's under another name: its causal T5 bias goes
per offset through the T5-like adapter. Its encoder attention (``LongT5LocalAttention``,
``LongT5TransientGlobalAttention``) does not call transformers' attention interface: it computes
blocks of ``local_radius + 1`` queries against three blocks of keys itself (banded already, never a
dense ``L x L`` square) and stays transformers' own; relpos banded tiles for it are not done.
``LongT5EncoderModel`` holds no decoder attention and is refused.
"""

from __future__ import annotations

from ._family import register
from ._t5like import t5_like_family

__all__ = ["FAMILY"]

FAMILY = register(
    t5_like_family(
        "longt5",
        "LongT5 (decoder attention; local and transient-global encoder attention stay transformers')",
        ("longt5",),
        ("LongT5Attention",),
        bidirectional=lambda module: not module.is_decoder,
        extra_attributes=("is_decoder",),
        unsupported=(
            "the encoder's local and transient-global attention (transformers' own blocked code, already banded) "
            "is not switched to relpos; LongT5EncoderModel is refused"
        ),
    )
)
