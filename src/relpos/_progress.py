"""Progress bars: tqdm, terminal-aware (no bar when the output is not a terminal), written to stderr.

One small wrapper so ``relpos extrapolate``, ``relpos bench`` and the model benchmark report
progress the same way: ``step(label, n)`` advances the bar and shows what is running, ``total`` can
be corrected when planned work is skipped, and ``close()`` ends the line.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, *, enabled: bool = True, stream=None) -> None:
        self._stream = stream or sys.stderr
        self._bar = tqdm(
            total=max(1, total),
            file=self._stream,
            disable=None if enabled else True,  # None: only on a terminal, so redirected logs stay clean
            dynamic_ncols=True,
            smoothing=0.05,  # a rate averaged over many steps: the first (warm-up) step does not set the ETA
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]",
        )

    @property
    def total(self) -> int:
        return int(self._bar.total)

    @total.setter
    def total(self, value: int) -> None:
        self._bar.total = max(1, value)
        self._bar.refresh()

    def step(self, label: str, n: int = 1) -> None:
        self._bar.set_description_str(label, refresh=False)
        self._bar.update(n)
        if self._bar.n >= self._bar.total:
            self.close()

    def log(self, line: str) -> None:
        """One plain line on the stream, bar or no bar: a redirected log shows each finished stage."""
        tqdm.write(line, file=self._stream)  # above the bar on a terminal, a plain line otherwise
        self._stream.flush()

    def close(self) -> None:
        self._bar.close()  # idempotent; ends the line
