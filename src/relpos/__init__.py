"""relpos: relative position encodings for transformer attention (PyTorch).

The sign convention everywhere is T5's: ``relative_position = key_position - query_position``.
"""

# core: relative offsets and the bias interface every encoding and backend shares
from .core.bias import AdditiveBias, OffsetBias, RelativeBias
from .core.offsets import relative_offsets, relative_positions

# encodings: one module each
from .encodings.buckets import STRATEGIES, BucketRange, bucket_ranges, bucket_table, check_bucket_config, relative_position_bucket, t5_bucket
from .encodings.absolute import LearnedAbsolutePositionEmbedding, SinusoidalPositionEmbedding
from .encodings.alibi import ALiBi, alibi_slopes
from .encodings.clipped import ClippedRelativeBias
from .encodings.cope import CoPE
from .encodings.decomposed import DecomposedRelPos, decomposed_attention
from .encodings.fire import FIREBias
from .encodings.forgetting import ForgettingGate, gated_attention
from .encodings.kerple import KerpleBias
from .encodings.log_decay import LogDecayBias
from .encodings.resize import resize_bias_table, resize_state_dict
from .encodings.rotary import RotaryEmbedding
from .encodings.rotary2d import AxialRotary2D, DINOv3Rotary2D, MixedRotary2D
from .encodings.sandwich import SandwichBias
from .encodings.shaw import ShawRelativePosition
from .encodings.t5 import RelativePositionalBias
from .encodings.window_bias import ContinuousPositionBias, FactorizedRelativePositionBias, RelativePositionBias
from .encodings.windows import table_size, window_coords, window_relative_position_index
from .encodings.xpos import XPos

# attention backends
from .backends.dispatch import BackendChoice, attention, resolve_bias, select_backend

# layers
from .layers.mha import KVCache, MultiheadAttention
from .layers.t5_attention import T5Attention, T5Block, T5Stack, cross_attention_with_bias
from .layers.window_attention import (
    WindowAttention, projected_window_attention, shift_mask, window_attention, window_merge, window_partition,
)

# Unmistakable names for the two tables whose usual names differ by two letters:
# RelativePositionalBias (T5, bucketed, any length) and RelativePositionBias (Swin, one window).
T5RelativeBias = RelativePositionalBias
WindowRelativeBias = RelativePositionBias

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "STRATEGIES",
    "ALiBi",
    "AxialRotary2D",
    "DINOv3Rotary2D",
    "DecomposedRelPos",
    "MixedRotary2D",
    "decomposed_attention",
    "AdditiveBias",
    "BackendChoice",
    "BucketRange",
    "ClippedRelativeBias",
    "ContinuousPositionBias",
    "CoPE",
    "FIREBias",
    "ForgettingGate",
    "KerpleBias",
    "SandwichBias",
    "XPos",
    "gated_attention",
    "FactorizedRelativePositionBias",
    "KVCache",
    "LearnedAbsolutePositionEmbedding",
    "LogDecayBias",
    "MultiheadAttention",
    "OffsetBias",
    "RelativeBias",
    "RelativePositionBias",
    "RelativePositionalBias",
    "T5RelativeBias",
    "WindowAttention",
    "WindowRelativeBias",
    "RotaryEmbedding",
    "ShawRelativePosition",
    "SinusoidalPositionEmbedding",
    "T5Attention",
    "T5Block",
    "T5Stack",
    "alibi_slopes",
    "attention",
    "bucket_ranges",
    "bucket_table",
    "check_bucket_config",
    "cross_attention_with_bias",
    "relative_offsets",
    "relative_position_bucket",
    "relative_positions",
    "resize_bias_table",
    "resize_state_dict",
    "resolve_bias",
    "select_backend",
    "shift_mask",
    "t5_bucket",
    "table_size",
    "window_attention",
    "projected_window_attention",
    "window_coords",
    "window_merge",
    "window_partition",
    "window_relative_position_index",
]
