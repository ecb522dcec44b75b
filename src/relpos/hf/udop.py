"""UDOP (document understanding: text, layout boxes and image) on relpos attention.

``UdopAttention`` is T5's attention under another name. Its two stacks use the bias differently:

* the decoder: layer 0's table with causal T5 buckets, through ``compute_bias``: per offset under
  relpos, like T5;
* the encoder: the stack adds the 1D bucket bias and the 2D layout biases (horizontal and
  vertical distances between token boxes, bucketed per example: data-dependent) in
  ``RelativePositionBiasAggregated`` and hands layer 0 one dense ``(B, H, L, L)`` tensor. relpos
  keeps that tensor as transformers builds it and runs the encoder's attention on it with one dense
  SDPA mask (the cost of transformers' sdpa); a per-tile build of the layout bias is not done.
"""

from __future__ import annotations

from ._family import register
from ._t5like import t5_like_family

__all__ = ["FAMILY"]

FAMILY = register(
    t5_like_family(
        "udop",
        "UDOP",
        ("udop",),
        ("UdopAttention",),
        bidirectional=lambda module: not module.is_decoder,
        extra_attributes=("is_decoder",),
        unsupported=(
            "the encoder's 1D + 2D layout bias stays transformers' dense (B, H, L, L) tensor (built from token boxes "
            "per example); relpos runs it with a dense SDPA mask, no faster than transformers' sdpa"
        ),
    )
)
