"""Heatmaps of what the encodings do (``relpos plot``), computed by relpos itself.

* ``buckets``: the (L, L) bucket matrix of :func:`relpos.relative_position_bucket`;
* ``bias``: one head of any additive bias (T5, windowed 2D, clipped, ALiBi, log-decay);
* ``attention``: seed 004's "The cat sat on mat" example, standard vs biased attention weights.

Needs matplotlib (``pip install "relpos[plot]"``).
"""

from __future__ import annotations

import math
import pathlib
from typing import Literal

import torch

from ._checks import check_choice, check_int, check_positive_float
from .alibi import ALiBi
from .attention import attention
from .buckets import relative_position_bucket, relative_positions
from .clipped import ClippedRelativeBias
from .log_decay import LogDecayBias
from .t5 import RelativePositionalBias
from .window_bias import RelativePositionBias

__all__ = ["BIAS_KINDS", "bias_matrix", "seed004_weights", "plot_buckets", "plot_bias", "plot_attention"]

BIAS_KINDS: tuple[str, ...] = ("t5", "window2d", "clipped", "alibi", "log_decay")
SEED004_TOKENS = ("The", "cat", "sat", "on", "mat")
SEED004_SCORES = [[0, 2, 1, 1, 1.5], [3, 0, 2, 1, 0.5], [1, 2, 2, 1, 1.5], [1, 1, 0, 2, 1], [1, 1, 1, 1, 1.5]]  # Q K^T


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


def bias_matrix(kind: str, length: int = 32, *, seed: int = 0, causal: bool = False, **options) -> torch.Tensor:
    """(L, L) bias of head 0 of ``kind`` (learned tables at their seeded initialisation).

    ``window2d`` uses a square window of ``length`` positions (``length`` must be a square).
    """
    kind = check_choice("kind", kind, BIAS_KINDS)
    length = check_int("length", length, minimum=1)
    torch.manual_seed(seed)
    if kind == "window2d":
        side = math.isqrt(length)
        if side * side != length:
            raise ValueError(f"length must be a square number of window positions for window2d, got {length}")
        module = RelativePositionBias(1, (side, side), init_std=1.0)
        return module()[0].detach()
    module = {
        "t5": lambda: RelativePositionalBias(
            1, options.get("num_buckets", 32), options.get("max_distance", 128), bidirectional=not causal,
            init_std=1.0,
        ),
        "clipped": lambda: ClippedRelativeBias(1, options.get("max_distance", 8)),
        "alibi": lambda: ALiBi(1, mode="causal" if causal else "symmetric", slopes=[options.get("slope", 0.25)]),
        "log_decay": lambda: LogDecayBias(options.get("scale", 0.3)),
    }[kind]()
    if kind == "clipped":
        torch.nn.init.normal_(module.relative_bias)
    return module.materialize(length, length)[0, 0].detach()


def seed004_weights(scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed 004's standard and log-decay-biased attention weights, (5, 5) each, via relpos.attention."""
    scale = check_positive_float("scale", scale)
    scores = torch.tensor(SEED004_SCORES, dtype=torch.float64)
    q = (scores * math.sqrt(5) / 2)[None, None]  # q k^T / sqrt(5) = scores / 2 (the seed's d_k = 4) with k = I
    k = v = torch.eye(5, dtype=torch.float64)[None, None]  # identity values: the output is the weights
    standard = attention(q, k, v, backend="eager")[0, 0]
    biased = attention(q, k, v, bias=LogDecayBias(scale), backend="eager")[0, 0]
    return standard, biased


def _save(fig, path) -> pathlib.Path:
    path = pathlib.Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_buckets(
    path, *, num_buckets: int = 32, max_distance: int = 128, causal: bool = False,
    strategy: Literal["log", "linear", "uniform", "quadratic"] = "log", length: int = 64,
) -> pathlib.Path:
    plt = pyplot()
    length = check_int("length", length, minimum=1)
    buckets = relative_position_bucket(
        relative_positions(length, length), bidirectional=not causal, num_buckets=num_buckets,
        max_distance=max_distance, strategy=strategy,
    )
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    im = ax.imshow(buckets.numpy(), cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="bucket")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    mode = "causal" if causal else "bidirectional"
    ax.set_title(f"T5 buckets of j - i: {num_buckets} buckets, max_distance {max_distance}, {mode}, {strategy}", fontsize=9)
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_bias(path, kind: str = "t5", *, length: int = 32, causal: bool = False, seed: int = 0, **options) -> pathlib.Path:
    plt = pyplot()
    matrix = bias_matrix(kind, length, seed=seed, causal=causal, **options)
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    im = ax.imshow(matrix.numpy(), cmap="RdBu_r", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="bias added to the logit")
    ax.set_xlabel("key position j" if kind != "window2d" else "key patch (raster order)")
    ax.set_ylabel("query position i" if kind != "window2d" else "query patch (raster order)")
    details = ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
    learned = " (learned: seeded random initialisation)" if kind in ("t5", "window2d", "clipped") else ""
    ax.set_title(f"{kind} bias, head 0, L={length}{', causal' if causal else ''}{', ' + details if details else ''}{learned}", fontsize=9)
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_attention(path, *, scale: float = 0.3) -> pathlib.Path:
    plt = pyplot()
    standard, biased = seed004_weights(scale)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.3))
    panels = [(standard, "standard attention", "viridis"), (biased, f"with -{scale} log(1 + |i - j|)", "viridis"),
              (biased - standard, "difference (biased - standard)", "RdBu_r")]
    for ax, (matrix, title, cmap) in zip(axes, panels):
        limit = matrix.abs().max().item() if cmap == "RdBu_r" else None
        im = ax.imshow(matrix.numpy(), cmap=cmap, vmin=-limit if limit else None, vmax=limit)
        for i in range(5):
            for j in range(5):
                ax.text(j, i, f"{matrix[i, j]:.3f}", ha="center", va="center", fontsize=7, color="white" if cmap == "viridis" else "black")
        ax.set_xticks(range(5), SEED004_TOKENS)
        ax.set_yticks(range(5), SEED004_TOKENS)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle("Seed 004's 'The cat sat on mat': attention weights", fontsize=11)
    path = _save(fig, path)
    plt.close(fig)
    return path
