"""A dependency-free progress bar with ETA, written to stderr."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, *, enabled: bool = True, stream=None) -> None:
        self.total, self.done, self.start = max(1, total), 0, time.perf_counter()
        self.enabled = enabled
        self.stream = stream or sys.stderr

    def step(self, label: str, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * max(0, self.total - self.done)
        bar = "#" * int(30 * min(self.done, self.total) / self.total)
        self.stream.write(f"\r[{bar:<30}] {self.done}/{self.total} {label:<44} ETA {eta / 60:4.1f} min")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
