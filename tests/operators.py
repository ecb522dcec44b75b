"""The torch operators a call dispatches (on a GPU each is a launch, and CPU time before it): what the tests of
results kept between calls and of decoding steps count."""

from __future__ import annotations

import collections
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LargestTensor", "dispatched"]


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func).removeprefix("aten.").removesuffix(".default"))
        return func(*args, **(kwargs or {}))


def dispatched(fn: Callable[[], object]) -> collections.Counter:
    """The operators ``fn()`` dispatches, counted by name (``aten.`` and ``.default`` dropped: ``masked_fill.Scalar``,
    ``_scaled_dot_product_flash_attention_for_cpu``)."""
    log = _Log()
    with log:
        fn()
    return collections.Counter(log.names)


class LargestTensor(TorchDispatchMode):
    """The largest tensor an operator returns inside it: in elements (``largest``) and in bytes (``largest_bytes``:
    Triton's interpreter copies its arguments' storages as bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = self.largest_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.largest_bytes = max(self.largest_bytes, t.numel() * t.element_size())
        return out
