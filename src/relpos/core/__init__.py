"""The primitives every wing of relpos builds on: relative offsets and the bias interface.

Below both :mod:`relpos.backends` (which runs attention with a bias) and :mod:`relpos.encodings` (which
defines the biases): nothing here imports from either (tests/test_layering.py checks every import).
"""

from .bias import AdditiveBias, LinearForm, OffsetBias, RelativeBias, hankel_view
from .offsets import relative_offsets, relative_positions

__all__ = ["AdditiveBias", "LinearForm", "OffsetBias", "RelativeBias", "hankel_view", "relative_offsets", "relative_positions"]
