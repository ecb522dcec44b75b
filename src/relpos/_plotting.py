"""matplotlib, loaded on demand, and the palettes every relpos figure uses (``relpos plot``, the experiment's report).

Below the wings that draw (:mod:`relpos.tools`, :mod:`relpos.experiment`), so neither imports the other for it.
"""

from __future__ import annotations

import math
from typing import Iterable

from ._checks import check_int

__all__ = ["bucket_colours", "category_colours", "pyplot"]


def pyplot(*, required: bool = True):
    """matplotlib.pyplot on the non-interactive Agg backend; without matplotlib, exit with the
    install hint (``required``) or return ``None``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        if not required:
            return None
        raise SystemExit(f"plots need matplotlib: pip install 'relpos[plot]' ({exc})") from None
    return plt


#: darkening of every other bucket, so neighbouring buckets differ in lightness as well as hue
_BUCKET_MAP, _BUCKET_SPAN, _ALTERNATE_DARKEN = "turbo", (0.04, 0.96), 0.7
#: categories up to this many get qualitative colours (tab10, then Dark2); more get turbo, spread
_QUALITATIVE = ("tab10", "Dark2")


def _sample_map(name: str, points: Iterable[float]) -> list[tuple[float, float, float]]:
    """The RGB of colour map ``name`` at ``points`` in [0, 1], interpolated between its entries (so
    any number of points gets as many distinct colours)."""
    import numpy as np
    from matplotlib import colormaps

    table = np.asarray(colormaps[name](np.linspace(0, 1, 256)))[:, :3]
    grid = np.linspace(0, 1, len(table))
    return [tuple(float(np.interp(t, grid, table[:, c])) for c in range(3)) for t in points]


def bucket_colours(num_buckets: int) -> list[tuple[float, float, float]]:
    """One colour per bucket, pairwise distinct for any count: the perceptually ordered ``turbo`` map
    sampled at ``num_buckets`` points in bucket order (so the colour bar reads as distance order), every
    odd bucket darkened so neighbouring buckets always differ."""
    num_buckets = check_int("num_buckets", num_buckets, minimum=1)
    import numpy as np

    low, high = _BUCKET_SPAN
    colours = _sample_map(_BUCKET_MAP, np.linspace(low, high, num_buckets))
    return [tuple(c * _ALTERNATE_DARKEN for c in rgb) if b % 2 else rgb for b, rgb in enumerate(colours)]


def category_colours(count: int) -> list[tuple[float, float, float]]:
    """``count`` pairwise distinct colours for unordered categories (the models of a plot): tab10 then
    Dark2 while they last (18), else ``turbo`` at ``count`` points, visited with a golden-ratio stride so
    consecutive categories get far-apart hues."""
    count = check_int("count", count, minimum=0)
    from matplotlib import colormaps

    qualitative = [tuple(map(float, c[:3])) for name in _QUALITATIVE for c in colormaps[name].colors]
    if count <= len(qualitative):
        return qualitative[:count]
    stride = next(k for k in range(round(count / 1.618), count) if math.gcd(k, count) == 1)
    low, high = _BUCKET_SPAN
    return _sample_map(_BUCKET_MAP, [low + (high - low) * (i * stride % count) / (count - 1) for i in range(count)])
