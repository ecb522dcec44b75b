"""The torch operators a call dispatches (on a GPU each is a launch, and CPU time before it): what the tests of
results kept between calls and of decoding steps count."""

from __future__ import annotations

import collections
from typing import Callable

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["dispatched"]


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
