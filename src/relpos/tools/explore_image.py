"""The image view of ``relpos explore``: 2D biases on a patch grid, windows, the shift, a worked example.

:data:`IMAGE_KINDS` maps a name to ``fn(height, width, seed, options) -> (N, N)``: one head's bias
between the ``N = height * width`` patches of a region (a window, in raster order; row = query).
A new 2D encoding joins the page with one line here. The page's numbers come from
:func:`image_bias` (``/api/image``) and :func:`worked_example` (``/api/image-example``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .patch_scores import patch_scores
from ..layers.window_attention import SWIN_MASK_VALUE, shift_mask
from ..encodings.window_bias import ContinuousPositionBias, FactorizedRelativePositionBias, RelativePositionBias
from ..encodings.windows import table_size

__all__ = ["IMAGE_KINDS", "MAX_GRID", "image_bias", "worked_example", "EXAMPLE_OFFSET_BIAS"]

MAX_GRID = 16  # the page's grid side: 256 patches, a 256 x 256 matrix


def _seeded(module: torch.nn.Module, seed: int, std: float = 1.0) -> torch.nn.Module:
    """Every parameter drawn from N(0, std^2) with ``seed``: visible colours, reproducible numbers."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * std)
    return module


def _table(height: int, width: int, seed: int, options: dict) -> torch.Tensor:
    return _seeded(RelativePositionBias(1, (height, width)), seed)()[0].detach()  # (N, N)


def _factorized(height: int, width: int, seed: int, options: dict) -> torch.Tensor:
    return _seeded(FactorizedRelativePositionBias(1, (height, width)), seed)()[0].detach()  # (N, N)


def _continuous(height: int, width: int, seed: int, options: dict) -> torch.Tensor:
    bias = ContinuousPositionBias(1, (height, width), options.get("pretrained_window", 0), hidden_size=64)
    return _seeded(bias, seed, std=0.5)()[0].detach()  # (N, N), 16 * sigmoid(MLP)


#: name -> fn(height, width, seed, options) -> (N, N) bias over a height x width region (query rows)
IMAGE_KINDS: dict[str, Callable[[int, int, int, dict], torch.Tensor]] = {
    "table": _table,  # Swin V1: a learned (2Wh - 1)(2Ww - 1) table
    "factorized": _factorized,  # a row-offset table plus a column-offset table
    "continuous": _continuous,  # Swin V2: an MLP over log-spaced offsets, 16 * sigmoid
    # global attention's 2D terms (window 0 on the page): one fixed query/key, the position term alone
    "decomposed": lambda h, w, seed, options: patch_scores("decomposed", h, w, seed),  # SAM / ViTDet rel_h + rel_w
    "rope2d_axial": lambda h, w, seed, options: patch_scores("rope2d_axial", h, w, seed),  # EVA-02
    "rope2d_mixed": lambda h, w, seed, options: patch_scores("rope2d_mixed", h, w, seed),  # RoPE-Mixed
    "rope2d_dinov3": lambda h, w, seed, options: patch_scores("rope2d_dinov3", h, w, seed),  # DINOv3
}
TITLES = {"table": "Swin V1 table", "factorized": "factorized (rows + columns)", "continuous": "Swin V2 continuous (MLP)",
          "decomposed": "decomposed rel_h + rel_w (SAM, ViTDet)", "rope2d_axial": "2D RoPE, axial (EVA-02): q.k",
          "rope2d_mixed": "2D RoPE, mixed (RoPE-Mixed): q.k", "rope2d_dinov3": "2D RoPE (DINOv3): q.k"}


def _window_ids(size: int, window: int, shift: int) -> torch.Tensor:
    """(size,) the window (along one axis) each patch falls in after the roll by ``-shift``."""
    return ((torch.arange(size) - shift) % size) // window


def _local_index(size: int, window: int, shift: int) -> torch.Tensor:
    """(size,) the position of each patch inside its window after the roll."""
    return ((torch.arange(size) - shift) % size) % window


@torch.no_grad()
def image_bias(kind: str, grid: int, window: int, shift: int, seed: int = 0, options: dict | None = None) -> dict:
    """The page's payload: the bias between every pair of patches of a ``grid x grid`` map.

    Patches attend inside their (shifted) window; ``matrix[p][q]`` is the bias of query patch
    ``p`` and key patch ``q`` in one window, ``None`` across windows. ``masked[p][q]`` marks pairs
    the shift mask separates (patches from opposite borders rolled into one window: their score
    gets ``-100``). ``window`` 0 is global attention (one window, the whole grid).
    """
    if kind not in IMAGE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(IMAGE_KINDS)}, got {kind!r}")
    if not 1 <= grid <= MAX_GRID:
        raise ValueError(f"grid must be between 1 and {MAX_GRID}, got {grid}")
    window = grid if window == 0 else window
    if not 1 <= window <= grid or grid % window:
        raise ValueError(f"window must divide grid={grid} (or be 0: the whole grid), got {window}")
    if not 0 <= shift < window:
        raise ValueError(f"shift must be between 0 and window - 1 = {window - 1}, got {shift}")
    options = options or {}
    local_bias = IMAGE_KINDS[kind](window, window, seed, options)  # (Nw, Nw)
    wid, loc = _window_ids(grid, window, shift), _local_index(grid, window, shift)  # (grid,)
    window_of = (wid[:, None] * (grid // window) + wid[None, :]).flatten()  # (G,)
    local = (loc[:, None] * window + loc[None, :]).flatten()  # (G,)
    same = window_of[:, None] == window_of[None, :]  # (G, G)
    full = local_bias[local[:, None], local[None, :]]  # (G, G): the bias if they share a window
    masked = torch.zeros_like(same)
    if shift:
        rolled = shift_mask(grid, grid, window, shift)  # (nW, Nw, Nw) in rolled coordinates
        masked = rolled[window_of[:, None], local[:, None], local[None, :]] != 0  # (G, G)
        masked &= same
    matrix = [[round(float(full[p, q]), 6) if same[p, q] else None for q in range(grid * grid)] for p in range(grid * grid)]
    return {
        "kind": kind, "title": TITLES.get(kind, kind), "grid": grid, "window": window, "shift": shift, "seed": seed,
        "options": options, "matrix": matrix, "masked": masked.tolist(), "window_of": window_of.tolist(),
        "mask_value": SWIN_MASK_VALUE, "parameters": _parameter_count(kind, window),
        "kinds": {name: TITLES.get(name, name) for name in IMAGE_KINDS},
    }


def _parameter_count(kind: str, window: int) -> str:
    if kind == "table":
        return f"{table_size((window, window))} values per head ((2W-1)^2)"
    if kind == "factorized":
        return f"{2 * (2 * window - 1)} values per head (2 (2W-1))"
    if kind == "continuous":
        return "an MLP 2 -> 64 -> heads (512 wide in Swin V2), evaluated at every offset"
    if kind == "decomposed":
        return "2 (2W-1) vectors of head_dim per table pair (rel_pos_h, rel_pos_w), read through the query"
    if kind.startswith("rope2d"):
        return "no bias table: q and k rotated by row and column angles (learned per head for RoPE-Mixed)"
    return ""


# --- the worked example: a 2x2 grid of patches ---------------------------------------------------

EXAMPLE_CONTENT = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]  # x_i, d = 2
EXAMPLE_POSITIONS = [[0.0, 0.0], [0.0, 0.5], [0.5, 0.0], [0.5, 0.5]]  # absolute p_i of (row, col)
#: bias by offset (d_row, d_col) = query - key (Swin's sign); the two offsets the tutorial leaves out are 0
EXAMPLE_OFFSET_BIAS = {(0, 0): 0.0, (0, 1): -0.2, (1, 0): -0.1, (1, 1): -0.3, (-1, 0): 0.1, (0, -1): 0.2,
                       (-1, -1): 0.3, (1, -1): 0.0, (-1, 1): 0.0}


def _example_bias_module() -> RelativePositionBias:
    module = RelativePositionBias(1, (2, 2))
    with torch.no_grad():
        for (dr, dc), value in EXAMPLE_OFFSET_BIAS.items():
            module.relative_position_bias_table[(dr + 1) * 3 + (dc + 1), 0] = value
    return module


@torch.no_grad()
def worked_example() -> dict:
    """Logits ``q_i . k_j / sqrt(2)`` on the 2x2 grid: content only, + absolute embeddings, + relative bias.

    ``Q = K = X`` (no projections), as in the relative-vs-absolute tutorial; the relative bias is a
    :class:`relpos.RelativePositionBias` over the 2x2 window whose table holds
    :data:`EXAMPLE_OFFSET_BIAS`.
    """
    x = torch.tensor(EXAMPLE_CONTENT, dtype=torch.float64)  # (4, 2)
    p = torch.tensor(EXAMPLE_POSITIONS, dtype=torch.float64)  # (4, 2)
    scale = 2**-0.5
    plain = x @ x.T * scale  # (4, 4)
    absolute = (x + p) @ (x + p).T * scale  # (4, 4)
    bias = _example_bias_module()()[0].double()  # (4, 4), query rows
    relative = plain + bias  # (4, 4)
    coords = [(i // 2, i % 2) for i in range(4)]
    offsets = [[[coords[i][0] - coords[j][0], coords[i][1] - coords[j][1]] for j in range(4)] for i in range(4)]
    r = lambda t: [[round(float(v), 3) for v in row] for row in t]  # noqa: E731
    return {
        "content": EXAMPLE_CONTENT, "positions": EXAMPLE_POSITIONS, "coords": coords, "offsets": offsets,
        "offset_bias": [[dr, dc, v] for (dr, dc), v in EXAMPLE_OFFSET_BIAS.items()],
        "no_position": r(plain), "absolute": r(absolute), "bias": r(bias), "relative": r(relative),
        "relative_weights": r(torch.softmax(relative, -1)), "no_position_weights": r(torch.softmax(plain, -1)),
    }


def api_image(query: dict, param) -> dict:
    """``/api/image``: ``param(query, name, type, default)`` reads and checks one query value."""
    kind = param(query, "kind", str, "table")
    options = {}
    if kind == "continuous":
        pretrained = param(query, "pretrained_window", int, 0)
        if not 0 <= pretrained <= MAX_GRID:
            raise ValueError(f"pretrained_window must be between 0 (none) and {MAX_GRID}, got {pretrained}")
        options["pretrained_window"] = pretrained
    return image_bias(kind, param(query, "grid", int, 8), param(query, "window", int, 4), param(query, "shift", int, 0),
                      param(query, "seed", int, 0), options)
