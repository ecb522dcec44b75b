"""One rule for the results relpos keeps between calls (a model's layers ask for the same offsets in turn).

>>> import torch
>>> may_reuse(torch.device("cpu"))
True
"""

from __future__ import annotations

import torch

__all__ = ["may_reuse"]


def may_reuse(device: torch.device) -> bool:
    """Whether a result kept from an earlier call may serve this one (or this one's be kept).

    Never inside ``torch.compile`` (a compiled graph keeps no Python-side state, and its guards would see the
    state change), nor while a CUDA graph is captured on ``device``: every replay would read the kept tensor
    whatever its inputs had become, and once the kept tensor is replaced, freed memory.
    """
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
