"""One rule and one mechanism for the results relpos keeps between calls (a model's layers ask for the same
offsets, padded values and masks in turn).

>>> import torch
>>> may_reuse(torch.device("cpu"))
True
>>> kept, mask = KeptResult(), torch.ones(2, 3, dtype=torch.bool)
>>> kept.get(storage_key(mask), mask.device) is None
True
>>> kept.keep(storage_key(mask), mask.device, (mask,), "checked")
>>> kept.get(storage_key(mask), mask.device), kept.get(storage_key(mask[:, :2]), mask.device)
('checked', None)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KeptResult", "may_reuse", "storage_key"]


def may_reuse(device: torch.device) -> bool:
    """Whether a result kept from an earlier call may serve this one (or this one's be kept).

    Never inside ``torch.compile`` (a compiled graph keeps no Python-side state, and its guards would see the
    state change), nor while a CUDA graph is captured on ``device``: every replay would read the kept tensor
    whatever its inputs had become, and once the kept tensor is replaced, freed memory.
    """
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def storage_key(tensor: torch.Tensor) -> tuple:
    """What a result computed from ``tensor`` depends on: its memory, layout, dtype and in-place version. Valid while
    ``tensor`` is kept alive with the result (no other tensor can then take that memory); views of one tensor with the
    same layout share it, and an in-place change moves the version."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device, tensor._version


class KeptResult:
    """The last result one place computed, with the key it was computed for and the tensors that key names."""

    def __init__(self) -> None:
        self._entry: tuple[Any, tuple, Any] | None = None

    def get(self, key: Any, device: torch.device) -> Any | None:
        """The kept result if it was computed for ``key`` and :func:`may_reuse` allows, else None."""
        entry = self._entry
        return entry[2] if entry is not None and entry[0] == key and may_reuse(device) else None

    def keep(self, key: Any, device: torch.device, alive: tuple, result: Any) -> None:
        """Keep ``result`` for ``key`` (replacing the last), holding ``alive``, the tensors ``key`` names."""
        if may_reuse(device):
            self._entry = (key, alive, result)
