"""Plots of the encodings that are not a bias on (i, j), for their pages in docs/encodings/, computed by relpos.

    python tools/encoding_plots.py docs/encodings/img     # rope.png, sinusoidal.png, rotary2d.png

* RoPE: the score ``q_i . k_j / d`` of one all-ones vector rotated at every position (``relpos.RotaryEmbedding``,
  head_dim 64): a function of ``j - i`` alone (the matrix is Toeplitz), decaying with the distance.
* sinusoidal: the table ``relpos.SinusoidalPositionEmbedding`` adds (positions x dimensions).
* 2D RoPE: the same score from the centre patch of a 16 x 16 grid to every patch (``relpos.AxialRotary2D``).

Needs matplotlib (the plot extra).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

import relpos
from relpos._io import save_with
from relpos._plotting import pyplot

LENGTH, HEAD_DIM, GRID = 128, 64, 16


def rope_scores() -> torch.Tensor:
    ones = torch.ones(1, 1, LENGTH, HEAD_DIM)  # (B, H, L, d)
    q, k = relpos.RotaryEmbedding(HEAD_DIM)(ones, ones)
    return (q @ k.transpose(-1, -2))[0, 0] / HEAD_DIM  # (L, L)


def rotary2d_scores() -> torch.Tensor:
    ones = torch.ones(1, 1, GRID * GRID, HEAD_DIM)  # (B, H, N, d) over the grid
    q, k = relpos.AxialRotary2D(HEAD_DIM)(ones, ones, (GRID, GRID))
    centre = (GRID // 2) * GRID + GRID // 2
    return (q[0, 0, centre] @ k[0, 0].T / HEAD_DIM).reshape(GRID, GRID)  # (H, W)


def plot_rope(plt, path: pathlib.Path) -> None:
    scores = rope_scores()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    image = left.imshow(scores, cmap="RdBu_r", vmin=-1, vmax=1)
    left.set(title="RoPE: q_i . k_j / d (all-ones q, k; d = 64)", xlabel="key position j", ylabel="query position i")
    fig.colorbar(image, ax=left)
    right.plot(range(LENGTH), scores[0])
    right.set(title="row i = 0: a function of j - i alone", xlabel="j - i", ylabel="score")
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    save_with(lambda tmp: fig.savefig(tmp, format="png", dpi=100), path)
    plt.close(fig)


def plot_sinusoidal(plt, path: pathlib.Path) -> None:
    table = relpos.SinusoidalPositionEmbedding(HEAD_DIM)(torch.zeros(1, LENGTH, HEAD_DIM))[0]  # (L, d)
    fig, ax = plt.subplots(figsize=(6, 4))
    image = ax.imshow(table.T, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    ax.set(title="sinusoidal table (d = 64)", xlabel="position", ylabel="dimension")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_with(lambda tmp: fig.savefig(tmp, format="png", dpi=100), path)
    plt.close(fig)


def plot_rotary2d(plt, path: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 4))
    image = ax.imshow(rotary2d_scores(), cmap="RdBu_r", vmin=-1, vmax=1)
    ax.set(title="axial 2D RoPE: centre patch to every patch", xlabel="column", ylabel="row")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_with(lambda tmp: fig.savefig(tmp, format="png", dpi=100), path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for rope.png, sinusoidal.png and rotary2d.png (created if missing)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    for name, draw in (("rope.png", plot_rope), ("sinusoidal.png", plot_sinusoidal), ("rotary2d.png", plot_rotary2d)):
        draw(plt, out / name)
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
