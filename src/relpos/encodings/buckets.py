"""The one bucket function every part of relpos uses (T5's, and its strategies).

Relative positions follow :mod:`relpos.core.offsets`: ``key - query``, > 0 for a key in the
query's future. See docs/conventions.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .._checks import check_bool, check_choice, check_device, check_int
from .._reuse import may_reuse
from ..core.offsets import relative_positions  # noqa: F401 - the doctests below use it

__all__ = [
    "BucketStrategy",
    "STRATEGIES",
    "check_bucket_config",
    "relative_position_bucket",
    "offset_buckets",
    "buckets_at",
    "t5_bucket",
    "BucketRange",
    "bucket_ranges",
    "bucket_table",
]

BucketStrategy = Literal["log", "linear", "uniform", "quadratic"]
STRATEGIES: tuple[str, ...] = ("log", "linear", "uniform", "quadratic")


def check_bucket_config(
    num_buckets: int, max_distance: int, bidirectional: bool = True, strategy: str = "log"
) -> tuple[int, int, bool, str]:
    """Validate a bucketing configuration; return it normalised.

    Rules: bidirectional needs an even ``num_buckets >= 4`` (one half per direction, each
    with at least one exact and one far bucket); causal needs ``num_buckets >= 2``.
    ``max_distance`` must lie above the exact range (``max_distance > max_exact`` with
    ``max_exact = num_buckets // 4`` bidirectional, ``num_buckets // 2`` causal): at or
    below it, T5's ``log(max_distance / max_exact)`` is zero or negative and the far
    buckets are undefined.
    """
    bidirectional = check_bool("bidirectional", bidirectional)
    strategy = check_choice("strategy", strategy, STRATEGIES)
    num_buckets = check_int("num_buckets", num_buckets)
    minimum = 4 if bidirectional else 2
    if num_buckets < minimum:
        mode = "bidirectional" if bidirectional else "causal"
        raise ValueError(f"num_buckets must be >= {minimum} for {mode} bucketing, got {num_buckets}")
    if bidirectional and num_buckets % 2:
        raise ValueError(
            f"num_buckets must be even for bidirectional bucketing (half per direction), got {num_buckets}; "
            f"use {num_buckets - 1} or {num_buckets + 1}"
        )
    max_distance = check_int("max_distance", max_distance)
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must be > the exact range max_exact={max_exact} "
            f"(num_buckets={num_buckets}, bidirectional={bidirectional}), got {max_distance}"
        )
    return num_buckets, max_distance, bidirectional, strategy


def _far_buckets(distance: torch.Tensor, max_exact: int, half: int, max_distance: int, strategy: str) -> torch.Tensor:
    """Bucket of a non-negative distance ``>= max_exact`` (other entries: don't care)."""
    n_far = half - max_exact
    if strategy == "log":
        # Exactly transformers' T5Attention._relative_position_bucket, operation for operation,
        # in float32 whatever the caller's dtype (bf16 here misplaces distances 16, 32, 90).
        scaled = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * n_far
        return max_exact + scaled.to(torch.long)
    distance = distance.clamp(max=max_distance)  # beyond max_distance everything is the last bucket
    if strategy == "linear":
        return max_exact + (distance - max_exact) * n_far // (max_distance - max_exact)
    # quadratic: bucket edges grow quadratically, bucket = max_exact + floor(n_far * sqrt(x)),
    # x = (d - max_exact) / (max_distance - max_exact); integer square root, exact on any device.
    m = (distance - max_exact).clamp(min=0) * n_far * n_far // (max_distance - max_exact)
    root = m.float().sqrt().floor().to(torch.long)
    root = root - (root * root > m).long()
    root = root + ((root + 1) * (root + 1) <= m).long()
    return max_exact + root


def relative_position_bucket(
    relative_position: torch.Tensor,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
    strategy: BucketStrategy = "log",
) -> torch.Tensor:
    """Map relative positions (``key - query``) to bucket indices in ``[0, num_buckets)``.

    Bidirectional: the upper half of the buckets is for keys in the future (``rel > 0``).
    Causal: future keys all fall in bucket 0 (they are masked anyway), past keys use every
    bucket. Within a half of ``n`` buckets, distances below ``max_exact = n // 2`` get a
    bucket each; the far buckets cover ``[max_exact, max_distance)`` by ``strategy``:

    * ``"log"``: T5's logarithmic spacing, identical to Hugging Face transformers;
    * ``"linear"``: equal-width far buckets;
    * ``"quadratic"``: far bucket edges at ``max_exact + (max_distance - max_exact) * (k/n_far)**2``;
    * ``"uniform"``: no exact region, ``n`` equal-width buckets over ``[0, max_distance)``.

    Every distance ``>= max_distance`` shares the last bucket of its half.

    >>> t5_bucket(relative_positions(4, 4), num_buckets=8, max_distance=16)   # the T5 bucketing walkthrough
    tensor([[0, 5, 6, 6],
            [1, 0, 5, 6],
            [2, 1, 0, 5],
            [2, 2, 1, 0]])
    """
    num_buckets, max_distance, bidirectional, strategy = check_bucket_config(
        num_buckets, max_distance, bidirectional, strategy
    )
    if not isinstance(relative_position, torch.Tensor):
        raise TypeError(
            f"relative_position must be a torch.Tensor of integers, got {type(relative_position).__name__}; "
            "build one with relpos.relative_positions(...) or torch.tensor(..., dtype=torch.long)"
        )
    if relative_position.is_floating_point() or relative_position.is_complex() or relative_position.dtype == torch.bool:
        raise TypeError(
            f"relative_position must have an integer dtype, got {relative_position.dtype}; "
            "positions are whole numbers (cast with .long())"
        )
    # |-2**63| overflows int64; every distance past 2**62 shares the last bucket, so clamp first
    relative_position = relative_position.long().clamp(-(2**62), 2**62)
    half = num_buckets
    if bidirectional:
        half = num_buckets // 2
        sign_offset = (relative_position > 0).long() * half  # future keys: upper half
        distance = relative_position.abs()
    else:
        sign_offset = 0
        distance = -relative_position.clamp(max=0)  # future keys -> distance 0 -> bucket 0
    if strategy == "uniform":
        far = distance.clamp(max=max_distance) * half // max_distance
        return sign_offset + far.clamp(max=half - 1)
    max_exact = half // 2
    far = _far_buckets(distance, max_exact, half, max_distance, strategy).clamp(max=half - 1)
    return sign_offset + torch.where(distance < max_exact, distance, far)


def t5_bucket(
    relative_position: torch.Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """T5's bucket function: :func:`relative_position_bucket` with ``strategy="log"``.

    Equal to ``transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket``
    for every integer input.

    >>> t5_bucket(torch.tensor([-100, -10, -1, 0, 1, 10, 100]))
    tensor([15,  8,  1,  0, 17, 24, 31])
    """
    return relative_position_bucket(
        relative_position, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )


_RAMP_MIN = 1024  # the smallest ramp kept: offsets -1023 .. 1023 (16 KiB of int64)
_RAMPS_KEPT = 16  # bucket configurations (and devices) kept at once: a process's few models, the oldest dropped
_ramps: dict[tuple, torch.Tensor] = {}  # (bucket configuration, device) -> buckets of offsets -(C - 1) .. C - 1


def offset_buckets(
    low: int,
    high: int,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
    strategy: BucketStrategy = "log",
    device: torch.device | None = None,
) -> torch.Tensor:
    """(high - low + 1,) buckets of the offsets ``low .. high``: :func:`relative_position_bucket` of
    ``torch.arange(low, high + 1)``, as a view of a kept ramp of the buckets of every offset in ``-(C-1) .. C-1``.

    A call then dispatches no bucket function (a dozen elementwise operators, each a launch on a GPU), which a
    decoding step would otherwise pay every step: its offsets are new each step. The ramp, one per bucket
    configuration and device, grows by doubling (``C`` a power of two, at least 1024). Where nothing may be kept
    (:func:`relpos._reuse.may_reuse`: inside ``torch.compile``, during a CUDA graph's capture) the buckets are
    computed for the call. Read-only: a view of the kept ramp.

    >>> offset_buckets(-3, 2, num_buckets=8, max_distance=16)  # offsets -3 .. 2
    tensor([2, 2, 1, 0, 5, 6])
    """
    low, high = check_int("low", low), check_int("high", high)
    if high < low:
        raise ValueError(f"offset_buckets needs low <= high (the offsets low .. high), got low={low}, high={high}")
    device = torch.device("cpu") if device is None else check_device("device", device)
    config = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance, strategy=strategy)
    if not may_reuse(device):
        return relative_position_bucket(torch.arange(low, high + 1, device=device), **config)
    key = (bidirectional, num_buckets, max_distance, strategy, device)
    ramp, reach = _ramps.get(key), max(-low, high) + 1  # offsets -(reach - 1) .. reach - 1 needed
    if ramp is None or ramp.numel() < 2 * reach - 1:
        capacity = max(_RAMP_MIN, 1 << (reach - 1).bit_length())  # a power of two >= reach
        ramp = relative_position_bucket(torch.arange(1 - capacity, capacity, device=device), **config)  # (2C - 1,)
        _ramps.pop(key, None)
        if len(_ramps) >= _RAMPS_KEPT:
            _ramps.pop(next(iter(_ramps)))  # the oldest
        _ramps[key] = ramp
    centre = ramp.numel() // 2  # the index of offset 0
    return ramp[centre + low : centre + high + 1]


@dataclass(frozen=True)
class BucketRange:
    """The relative positions ``low .. high`` (inclusive; ``None`` = unbounded) of one bucket."""

    bucket: int
    low: int | None
    high: int | None
    exact: bool

    def describe(self) -> str:
        if self.low == self.high:
            return f"{self.low}"
        low = "-inf" if self.low is None else str(self.low)
        high = "+inf" if self.high is None else str(self.high)
        return f"{low} .. {high}"


def _first_reaching(f, values: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """For each ``v`` of ``values``: the smallest ``d`` in ``lo .. hi`` with ``f(d) >= v`` (``hi + 1`` if none).

    ``f`` is non-decreasing; a binary search for every value at once: O(len(values) * log(hi - lo)).
    """
    left = torch.full_like(values, lo)
    right = torch.full_like(values, hi + 1)
    while bool((left < right).any()):
        active = left < right
        mid = (left + right) // 2
        ok = f(mid) >= values
        right = torch.where(active & ok, mid, right)
        left = torch.where(active & ~ok, mid + 1, left)
    return left


def _side_segments(f, values: range, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(bucket, first distance, last distance) of each bucket that ``f`` reaches on ``lo .. hi``."""
    candidates = torch.tensor(list(values), dtype=torch.long)
    firsts = _first_reaching(f, candidates, lo, hi)  # (V,) non-decreasing
    reached = firsts <= hi
    present = reached & (f(firsts.clamp(max=hi)) == candidates)
    starts = [(int(v), int(d)) for v, d in zip(candidates[present].tolist(), firsts[present].tolist())]
    return [(v, d, (starts[i + 1][1] - 1) if i + 1 < len(starts) else hi) for i, (v, d) in enumerate(starts)]


def bucket_ranges(
    num_buckets: int = 32, max_distance: int = 128, *, bidirectional: bool = True, strategy: BucketStrategy = "log"
) -> list[BucketRange]:
    """Which relative positions fall in each bucket, computed from :func:`relative_position_bucket`.

    Buckets that no distance reaches (possible when ``max_distance`` is small for the
    number of buckets) are left out. Work is O(num_buckets * log(max_distance)): each bucket's
    first distance is found by binary search (the bucket is non-decreasing in the distance).
    """
    num_buckets, max_distance, bidirectional, strategy = check_bucket_config(
        num_buckets, max_distance, bidirectional, strategy
    )
    reach = max_distance + 1  # stands for every distance beyond max_distance (saturated)
    half = num_buckets // 2 if bidirectional else num_buckets
    max_exact = 0 if strategy == "uniform" else half // 2

    def bucket_of(rel: torch.Tensor) -> torch.Tensor:
        return relative_position_bucket(
            rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance, strategy=strategy
        )

    ranges = []
    for v, d0, d1 in _side_segments(lambda d: bucket_of(-d), range(half), 0, reach):  # past keys: rel = -d
        low, high = -d1, -d0
        if v == 0 and not bidirectional:
            high = reach  # a causal bucket 0 also holds every future key
        ranges.append((v, low, high))
    if bidirectional:
        ranges += [(v, d0, d1) for v, d0, d1 in _side_segments(bucket_of, range(half, num_buckets), 1, reach)]
    return [
        BucketRange(
            bucket=v,
            low=None if low == -reach else low,
            high=None if high == reach else high,
            exact=low == high and abs(low) < max_exact,
        )
        for v, low, high in sorted(ranges)
    ]


def bucket_table(
    num_buckets: int = 32, max_distance: int = 128, *, bidirectional: bool = True, strategy: BucketStrategy = "log"
) -> dict:
    """JSON-ready description of a bucketing: its ranges, exact region and unused buckets.

    The one source of ``relpos buckets --json`` and of the explorer page.
    """
    num_buckets, max_distance, bidirectional, strategy = check_bucket_config(
        num_buckets, max_distance, bidirectional, strategy
    )
    ranges = bucket_ranges(num_buckets, max_distance, bidirectional=bidirectional, strategy=strategy)
    half = num_buckets // 2 if bidirectional else num_buckets
    return {
        "num_buckets": num_buckets,
        "max_distance": max_distance,
        "bidirectional": bidirectional,
        "strategy": strategy,
        "convention": "relative_position = key_position - query_position",
        "max_exact": 0 if strategy == "uniform" else half // 2,
        "buckets": [{"bucket": r.bucket, "low": r.low, "high": r.high, "exact": r.exact} for r in ranges],
        "unused_buckets": sorted(set(range(num_buckets)) - {r.bucket for r in ranges}),
    }


def buckets_at(
    relative_position: torch.Tensor,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
    strategy: BucketStrategy = "log",
) -> torch.Tensor:
    """:func:`relative_position_bucket` of a tensor of offsets, read from the kept ramp of :func:`offset_buckets`.

    Every distance ``>= max_distance`` shares the last bucket of its half, so the offsets clamped to
    ``-max_distance .. max_distance`` index the buckets of those ``2 max_distance + 1`` offsets: three operators
    (clamp, shift, index) instead of the bucket function's dozen, for offsets known only as a tensor (a static
    cache's, shifted by its length: a decoding step's are new every step). Where nothing may be kept (inside
    ``torch.compile``, a CUDA graph's capture), the bucket function itself.

    >>> rel = torch.tensor([-100, -10, -1, 0, 1, 10, 100])
    >>> torch.equal(buckets_at(rel), t5_bucket(rel))
    True
    """
    config = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance, strategy=strategy)
    rel = relative_position
    integers = isinstance(rel, torch.Tensor) and not (rel.is_floating_point() or rel.is_complex() or rel.dtype == torch.bool)
    if not integers or not may_reuse(rel.device):
        return relative_position_bucket(rel, **config)  # the bucket function, and its refusals of anything else
    ramp = offset_buckets(-max_distance, max_distance, device=rel.device, **config)  # (2R + 1,)
    return ramp[rel.clamp(-max_distance, max_distance) + max_distance]
