"""Heatmaps of what the encodings do (``relpos plot``), computed by relpos itself.

* ``buckets``: the (L, L) bucket matrix of :func:`relpos.relative_position_bucket`;
* ``bias``: one head of any additive bias of :mod:`relpos.registry` (T5, windowed 2D, clipped, ALiBi,
  log-decay, Kerple, Sandwich, FIRE);
* ``attention``: the worked "The cat sat on mat" example, standard vs biased attention weights.

Needs matplotlib (``pip install "relpos[plot]"``).
"""

from __future__ import annotations

import math
import pathlib
from typing import Literal

import torch

from .._checks import check_choice, check_int, check_positive_float
from .._io import save_with
from .._plotting import bucket_colours, category_colours, pyplot
from .. import registry
from ..encodings.alibi import ALiBi
from ..backends.dispatch import attention
from ..core.offsets import relative_positions
from ..encodings.buckets import relative_position_bucket
from ..encodings.log_decay import LogDecayBias
from ..encodings.window_bias import RelativePositionBias

__all__ = ["BIAS_KINDS", "DECAYS", "EXAMPLE_TOKENS", "bias_matrix", "bias_details", "example_bias", "worked_example_weights",
           "plot_buckets", "plot_bias", "plot_attention", "bucket_colours", "category_colours"]

#: the encodings drawable as a bias matrix (relpos.registry's ``plot=True`` records)
BIAS_KINDS: tuple[str, ...] = registry.names(plot=True)
PLOT_HEAD_DIM = 16  # the head width of the pictured head (Sandwich's d' when not given)
EXAMPLE_TOKENS = ("The", "cat", "sat", "on", "mat")
EXAMPLE_SCORES = [[0, 2, 1, 1, 1.5], [3, 0, 2, 1, 0.5], [1, 2, 2, 1, 1.5], [1, 1, 0, 2, 1], [1, 1, 1, 1, 1.5]]  # Q K^T


#: the largest heatmap side and bucket count a plot draws: more cells than a figure has pixels say
#: nothing new, and each costs memory (a 10**5 side would be a 40 GB matrix)
MAX_PLOT_LENGTH = 1024
MAX_PLOT_BUCKETS = 4096


def _check_plot_size(length: int, num_buckets: int | None = None) -> None:
    if length > MAX_PLOT_LENGTH:
        raise ValueError(f"length={length} is past the plots' limit of {MAX_PLOT_LENGTH} (a heatmap with more cells "
                         "than a figure has pixels); plot a shorter length")
    if num_buckets is not None and num_buckets > MAX_PLOT_BUCKETS:
        raise ValueError(f"num_buckets={num_buckets} is past the plots' limit of {MAX_PLOT_BUCKETS} colours")


def _bias_module(kind: str, length: int, seed: int, causal: bool, options: dict):
    """The one-head module ``bias_matrix`` draws (learned tables at their seeded initialisation)."""
    kind = check_choice("kind", kind, BIAS_KINDS)
    length = check_int("length", length, minimum=1)
    _check_plot_size(length, options.get("num_buckets"))
    torch.manual_seed(seed)
    if kind == "window2d":
        side = math.isqrt(length)
        if side * side != length:
            raise ValueError(f"length must be a square number of window positions for window2d, got {length}")
        options = {**options, "window_size": side}
    return registry.get(kind).create(1, PLOT_HEAD_DIM, causal=causal, picture=True, **options)


def bias_matrix(kind: str, length: int = 32, *, seed: int = 0, causal: bool = False, **options) -> torch.Tensor:
    """(L, L) bias of head 0 of ``kind`` (learned tables at their seeded initialisation).

    ``window2d`` uses a square window of ``length`` positions (``length`` must be a square).
    """
    module = _bias_module(kind, length, seed, causal, options)
    if isinstance(module, RelativePositionBias):
        return module()[0].detach()  # (N, N)
    return module.materialize(length, length)[0, 0].detach()  # (L, L)


def bias_details(kind: str, length: int = 32, *, seed: int = 0, causal: bool = False, **options) -> dict:
    """What each cell of :func:`bias_matrix` is made of, for the explorer's hover readout
    (each encoding's ``details`` in :mod:`relpos.registry`).

    t5: the bucket of every cell and the table (head 0); clipped: the clip distance and the table
    (offsets ``-R .. R``); window2d: the index of every cell and the table; alibi: the slope;
    log_decay: the scale; Kerple and FIRE: their scalar parameters (head 0); Sandwich: ``d'``.
    """
    module = _bias_module(kind, length, seed, causal, options)
    with torch.no_grad():
        return registry.get(kind).details(module, length, causal)


DECAYS: tuple[str, ...] = ("log", "linear")


def example_bias(scale: float = 0.3, decay: str = "log"):
    """The worked example's distance decay: ``-scale * log(1 + |j - i|)`` (log, :class:`LogDecayBias`)
    or ``-scale * |j - i|`` (linear: a symmetric ALiBi with slope ``scale``)."""
    scale = check_positive_float("scale", scale)
    decay = check_choice("decay", decay, DECAYS)
    return LogDecayBias(scale) if decay == "log" else ALiBi(1, mode="symmetric", slopes=[scale])


def worked_example_weights(scale: float = 0.3, decay: str = "log") -> tuple[torch.Tensor, torch.Tensor]:
    """The 'The cat sat on mat' example's standard and biased attention weights, (5, 5) each, via
    relpos.attention; ``decay`` is the bias's shape (``log`` as in the example, or ``linear``)."""
    bias = example_bias(scale, decay)
    scores = torch.tensor(EXAMPLE_SCORES, dtype=torch.float64)
    q = (scores * math.sqrt(5) / 2)[None, None]  # q k^T / sqrt(5) = scores / 2 (the example's d_k = 4) with k = I
    k = v = torch.eye(5, dtype=torch.float64)[None, None]  # identity values: the output is the weights
    standard = attention(q, k, v, backend="eager")[0, 0]
    biased = attention(q, k, v, bias=bias, backend="eager")[0, 0]
    return standard, biased


#: the ordered map bucket colours are sampled from (its darkest and brightest ends left out) and the
def _save(fig, path) -> pathlib.Path:
    path = pathlib.Path(path)
    fig.tight_layout()
    save_with(lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png"), path)
    return path


def _masked_future(matrix: torch.Tensor, causal: bool):
    """A NumPy masked array hiding the keys a causal query cannot see (drawn in the colour map's "bad" grey)."""
    import numpy as np

    values = matrix.double().numpy()
    if not causal:
        return np.ma.masked_invalid(values)
    future = (relative_positions(matrix.shape[0], matrix.shape[1]) > 0).numpy()
    return np.ma.masked_array(values, mask=future | ~np.isfinite(values))


def _title(ax, text: str, width: int = 60) -> None:
    """A title wrapped to the axes' width, so it is never clipped."""
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(text, width)), fontsize=9)


def plot_buckets(
    path, *, num_buckets: int = 32, max_distance: int = 128, causal: bool = False,
    strategy: Literal["log", "linear", "uniform", "quadratic"] = "log", length: int = 64,
) -> pathlib.Path:
    length = check_int("length", length, minimum=1)
    _check_plot_size(length, check_int("num_buckets", num_buckets, minimum=1))
    plt = pyplot()
    buckets = relative_position_bucket(
        relative_positions(length, length), bidirectional=not causal, num_buckets=num_buckets,
        max_distance=max_distance, strategy=strategy,
    )
    from matplotlib.colors import BoundaryNorm, ListedColormap

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    cmap = ListedColormap(bucket_colours(num_buckets)).with_extremes(bad="#d9d9d9")  # one distinct colour per bucket
    norm = BoundaryNorm([b - 0.5 for b in range(num_buckets + 1)], num_buckets)
    im = ax.imshow(_masked_future(buckets, causal), cmap=cmap, norm=norm, interpolation="nearest")
    ticks = list(range(0, num_buckets, max(1, num_buckets // 16)))
    fig.colorbar(im, ax=ax, label="bucket", ticks=ticks)
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    mode = "causal (grey: future keys, masked)" if causal else "bidirectional"
    _title(ax, f"T5 buckets of j - i: {num_buckets} buckets, max_distance {max_distance}, {mode}, {strategy}")
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_bias(path, kind: str = "t5", *, length: int = 32, causal: bool = False, seed: int = 0, **options) -> pathlib.Path:
    plt = pyplot()
    matrix = bias_matrix(kind, length, seed=seed, causal=causal, **options)
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    shown = _masked_future(matrix, causal and kind != "window2d")
    limit = float(abs(shown).max()) or 1.0  # centre the diverging map at 0: red adds, blue subtracts
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")
    im = ax.imshow(shown, cmap=cmap, vmin=-limit, vmax=limit, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="bias added to the logit (0 = white)")
    ax.set_xlabel("key position j" if kind != "window2d" else "key patch (raster order)")
    ax.set_ylabel("query position i" if kind != "window2d" else "query patch (raster order)")
    details = ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
    has_parameters = any(True for _ in _bias_module(kind, length, seed, causal, options).parameters())
    learned = " (learned: at its seeded initialisation)" if has_parameters else ""
    masked = ", causal (grey: masked future keys)" if causal and kind != "window2d" else ""
    _title(ax, f"{kind} bias, head 0, L={length}{masked}{', ' + details if details else ''}{learned}")
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_attention(path, *, scale: float = 0.3) -> pathlib.Path:
    plt = pyplot()
    standard, biased = worked_example_weights(scale)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.3))
    panels = [(standard, "standard attention", "viridis"), (biased, f"with -{scale} log(1 + |i - j|)", "viridis"),
              (biased - standard, "difference (biased - standard)", "RdBu_r")]
    for ax, (matrix, title, cmap) in zip(axes, panels):
        limit = matrix.abs().max().item() if cmap == "RdBu_r" else None
        im = ax.imshow(matrix.numpy(), cmap=cmap, vmin=-limit if limit else None, vmax=limit)
        for i in range(5):
            for j in range(5):
                r, g, b, _ = im.cmap(im.norm(matrix[i, j].item()))
                dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # text colour by the cell's luminance
                ax.text(j, i, f"{matrix[i, j]:.3f}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
        ax.set_xticks(range(5), EXAMPLE_TOKENS)
        ax.set_yticks(range(5), EXAMPLE_TOKENS)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle("Worked example 'The cat sat on mat': attention weights", fontsize=11)
    path = _save(fig, path)
    plt.close(fig)
    return path
