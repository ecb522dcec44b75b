"""Statistics over seeds: mean, spread, confidence intervals, paired differences.

Every model is trained once per seed; a result cell (one encoding at one length) is then a
handful of numbers. ``summarize`` reduces them to the mean, the sample standard deviation
(``ddof=1``), the extremes and a 95% confidence interval of the mean from Student's t
distribution. ``paired_difference`` compares two encodings seed by seed (same seed: same data
order and same initial weights of the shared parts), which removes the variation the seeds share.

>>> s = summarize([2.0, 2.2, 2.4])
>>> round(s["mean"], 3), round(s["std"], 3), round(s["ci95"], 3)
(2.2, 0.2, 0.497)
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["t_quantile_975", "summarize", "paired_difference"]

# Student's t, 97.5th percentile, for 1 .. 30 degrees of freedom (two-sided 95% intervals)
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)


def t_quantile_975(df: int) -> float:
    """The 97.5th percentile of Student's t with ``df`` degrees of freedom (a table to 30, then ``1.96 + 2.4 / df``)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.960 + 2.4 / df  # within 0.003 of the exact value past 30


def summarize(values: Sequence[float]) -> dict:
    """Mean, sample std, min, max, count and 95% CI half-width (``None`` where undefined).

    Non-finite values (a diverged seed) are not averaged away: the mean is then ``nan``.
    """
    values = [float(v) for v in values]
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None, "ci95": None}
    mean = sum(values) / n
    if n == 1 or not all(math.isfinite(v) for v in values):
        std = ci = None
    else:
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        ci = t_quantile_975(n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "min": min(values), "max": max(values), "ci95": ci}


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """``a - b`` seed by seed: its mean, 95% CI half-width, and whether the interval excludes 0."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same seeds: got {len(a)} and {len(b)} values")
    s = summarize([x - y for x, y in zip(a, b)])
    s["significant"] = s["ci95"] is not None and abs(s["mean"]) > s["ci95"]
    return s
