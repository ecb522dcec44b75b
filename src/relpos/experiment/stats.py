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

import torch

__all__ = ["t_quantile_975", "summarize", "paired_difference", "paired_bootstrap", "holm", "bootstrap_mean"]

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


def paired_bootstrap(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor | None = None, *,
                     resamples: int = 2000, seed: int = 0) -> dict:
    """``a - b`` for two models measured on the same files under the same seeds, resampling files
    and seeds with replacement (a two-level paired bootstrap).

    ``a``, ``b``: ``(seeds, files)`` per-file means; ``weights``: ``(files,)`` (windows per file;
    default equal), so that the statistic is the window-weighted mean difference the tables show.
    Returns the observed difference, its 95% percentile interval, the bootstrap standard error and
    the two-sided normal p-value of ``observed / se`` (``erfc(|z| / sqrt 2)``; 0 when the
    resamples do not vary and the difference is not 0). The share of resamples on the far side of 0
    would floor p at ``2 / (1 + resamples)``, which Holm's adjustment over a family of hundreds of
    comparisons turns into 1 for every one of them, so no difference could ever be called significant.

    >>> r = paired_bootstrap(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.5, 1.5, 2.5]]))
    >>> r["mean"], r["low"], r["high"]
    (0.5, 0.5, 0.5)
    """
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape or a.dim() != 2 or a.numel() == 0:
        raise ValueError(f"a and b must be (seeds, files) of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    seeds, files = a.shape
    w = torch.ones(files, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    diff = a - b  # (S, F)
    observed = float((diff * w).sum() / (w.sum() * seeds))
    g = torch.Generator().manual_seed(seed)
    f_idx = torch.randint(0, files, (resamples, files), generator=g)  # (R, F)
    s_idx = torch.randint(0, seeds, (resamples, seeds), generator=g)  # (R, S)
    per_seed = diff[:, f_idx] * w[f_idx]  # (S, R, F)
    per_seed = per_seed.sum(-1) / w[f_idx].sum(-1)  # (S, R): each seed's weighted mean over resampled files
    stats = per_seed.gather(0, s_idx.T).mean(0)  # (R,): mean over resampled seeds
    low, high = torch.quantile(stats, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    se = float(stats.std())
    if se > 0:
        p = math.erfc(abs(observed / se) / math.sqrt(2))
    else:  # every resample gives the observed difference
        p = 1.0 if observed == 0 else 0.0
    return {"mean": observed, "low": low, "high": high, "se": se, "p": p, "resamples": resamples}


def bootstrap_mean(values: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of ``values`` (resampled with replacement)."""
    x = torch.as_tensor(list(values), dtype=torch.float64)
    if x.numel() == 0:
        raise ValueError("bootstrap_mean needs at least one value")
    idx = torch.randint(0, x.numel(), (resamples, x.numel()), generator=torch.Generator().manual_seed(seed))
    low, high = torch.quantile(x[idx].mean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment (controls the family-wise error rate): the k-th smallest of ``m``
    p-values is multiplied by ``m - k + 1``, made monotone, and capped at 1.

    >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03, 0.5])]
    [0.04, 0.09, 0.09, 0.5]
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * pvalues[i]))
        adjusted[i] = running
    return adjusted
