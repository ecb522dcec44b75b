"""Diagnostics that test the explanations: where attention goes, by distance, at 1x and past it.

``attention_by_distance`` runs a model with every layer on the eager reference path and records
its softmax weights (the only place the experiment materialises (B, H, L, L): a few windows,
for a diagnostic). A model whose encoding has its own attention path (Shaw, CoPE, forgetting
gates) is not covered and gives ``None``.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch

from ..encodings.fire import FIREBias
from .model import TransformerLM

from ..backends import dispatch as _attention

__all__ = ["distance_bins", "attention_by_distance", "fixed_fire_normalizer", "fire_normalizer_ablation"]


def distance_bins(length: int) -> list[tuple[int, int]]:
    """Distance bins ``[lo, hi)``: 0, 1, then powers of two up to ``length``.

    >>> distance_bins(10)
    [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    """
    bins, lo = [(0, 1)], 1
    while lo < length:
        hi = min(length, 2 * lo)
        bins.append((lo, hi))
        lo = hi
    return bins


@torch.no_grad()
def attention_by_distance(model: TransformerLM, tokens: torch.Tensor, train_len: int) -> dict | None:
    """The share of attention each distance bin gets (mean over queries, heads, layers and
    windows), and the share that goes to distances at or past ``train_len`` (never trained).

    ``tokens``: ``(N, L)`` windows. ``None`` for encodings outside the shared attention path.
    """
    attns = [block.attn for block in model.blocks]
    if any(type(a.position).__name__ in ("ShawRelativePosition", "CoPE", "ForgettingGate") for a in attns):
        return None
    length = tokens.shape[1]
    distance = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).clamp(min=0)  # (L, L), query - key
    mass = torch.zeros(length, dtype=torch.float64)  # by distance, summed
    calls = {"n": 0}
    real = _attention.masked_softmax

    def recording(scores: torch.Tensor) -> torch.Tensor:
        weights = real(scores)  # (B, H, Lq, Lk)
        mass.index_add_(0, distance.flatten(), weights.double().sum((0, 1)).flatten())
        calls["n"] += weights.shape[0] * weights.shape[1] * weights.shape[2]  # queries counted
        return weights

    backends = [a.backend for a in attns]
    model.eval()
    try:
        for a in attns:
            a.backend = "eager"
        with mock.patch.object(_attention, "masked_softmax", recording), contextlib.ExitStack():
            for row in range(tokens.shape[0]):
                model(tokens[row : row + 1])
    finally:
        for a, backend in zip(attns, backends):
            a.backend = backend
    if calls["n"] == 0:
        return None
    share = mass / calls["n"]  # (L,): each query's weights sum to 1
    bins = distance_bins(length)
    return {"bins": [list(b) for b in bins], "share": [float(share[lo:hi].sum()) for lo, hi in bins],
            "past_training": float(share[train_len:].sum()), "length": length,
            "mean_distance": float((share * torch.arange(length)).sum()), "log2_length": math.log2(length)}


@contextlib.contextmanager
def fixed_fire_normalizer(model: TransformerLM):
    """Every FIRE bias of ``model`` normalizes every query by ``psi(L)``, as it does for the queries
    up to its threshold ``L``, instead of by ``psi(max(L, i))``: past ``L`` a distance then reaches
    the MLP as the same input at every position (inputs above 1 for distances past ``L``). Patches
    the instances (an attribute shadowing ``per_offset``) and removes the patch on exit."""
    fires = [m for m in model.modules() if isinstance(m, FIREBias)]
    for fire in fires:
        fire.per_offset = lambda query_length, q_offset=0: True  # the per-offset path: normalizer psi(L)
    try:
        yield fires
    finally:
        for fire in fires:
            del fire.per_offset


@torch.no_grad()
def fire_normalizer_ablation(model: TransformerLM, x: torch.Tensor, y: torch.Tensor, train_len: int) -> dict | None:
    """Tests whether FIRE's loss past the training length comes from its position normalization:
    bits per byte of each ``train_len``-long stretch of the windows ``x`` -> ``y`` ((N, L) each), as
    trained and with :func:`fixed_fire_normalizer`. ``None`` for a model without FIRE."""
    if not any(isinstance(m, FIREBias) for m in model.modules()):
        return None
    was_training = model.training
    model.eval()

    def by_stretch() -> list[float]:
        nats = torch.nn.functional.cross_entropy(model(x).transpose(1, 2), y, reduction="none")  # (N, L)
        return (nats.mean(0).view(-1, train_len).mean(1) / math.log(2)).tolist()  # (L / train_len,)

    as_trained = by_stretch()
    with fixed_fire_normalizer(model) as fires:
        fixed = by_stretch()
    model.train(was_training)
    return {"as_trained": as_trained, "fixed_normalizer": fixed, "windows": x.shape[0], "length": x.shape[1],
            "threshold": [float(f.threshold()) for f in fires]}
