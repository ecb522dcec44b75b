"""Context parallelism: attention over a sequence sharded along its length across ``torch.distributed`` ranks.

``import relpos.distributed`` (``import relpos`` does not import it). See docs/distributed.md.
"""

from .._process import exit_process
from ._comm import DistributedMismatchError, RingTimeoutError
from .layout import LAYOUTS, Layout, global_positions, shard, unshard
from .layers import ContextParallel, all_reduce_grads, context_parallel
from .ring import PIECE_ROWS, ring_attention

__all__ = [
    "LAYOUTS", "PIECE_ROWS", "ContextParallel", "DistributedMismatchError", "Layout", "RingTimeoutError",
    "all_reduce_grads", "context_parallel", "exit_process", "global_positions", "ring_attention", "shard", "unshard",
]
