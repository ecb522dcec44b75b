"""ALiBi: attention with linear biases (Press, Smith & Lewis, ICLR 2022).

A fixed penalty proportional to distance, with one slope per head:
``b[h, i, j] = -m_h * (i - j)`` for the keys a causal query sees (``j <= i``). No parameters.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal, Sequence

import torch

from .._checks import check_choice, check_device, check_int
from .._reuse import KeptResult, storage_key
from ..core.bias import LinearForm, OffsetBias, RelativeBias

__all__ = ["ALiBi", "alibi_slopes"]


MAX_HEADS = 1 << 16  # far beyond any model; keeps a mistyped head count from computing billions of slopes


def alibi_slopes(num_heads: int) -> list[float]:
    """The paper's slopes: for ``n`` a power of two, ``2**(-8k/n)``, k = 1..n; otherwise the
    slopes of the closest power of two below ``n`` followed by every other slope of twice that.

    >>> alibi_slopes(8)
    [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    >>> [round(s, 4) for s in alibi_slopes(6)]
    [0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125]
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)
    if num_heads > MAX_HEADS:
        raise ValueError(f"num_heads must be at most {MAX_HEADS} (one slope per head), got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (k + 1) for k in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    if closest == num_heads:
        return power_of_two(num_heads)
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


class ALiBi(RelativeBias):
    """Fixed linear distance penalty per head.

    Args:
        num_heads: heads; slopes from :func:`alibi_slopes` unless ``slopes`` is given.
        mode: ``"causal"`` (the paper): ``b = m * (j - i)`` for past keys ``j <= i`` and 0 for
            future keys, which causal attention masks (``relpos.attention`` refuses this mode
            without ``causal=True`` when future keys are visible, instead of adding 0 to them);
            ``"symmetric"``: ``b = -m * |j - i|``, the bidirectional form used by encoders.
        slopes: explicit positive slopes, one per head.

    The slopes are a non-persistent buffer: nothing to learn, nothing in the state dict.

    >>> ALiBi(2, slopes=[1.0, 0.5]).materialize(3, 3)[0]
    tensor([[[ 0.0000,  0.0000,  0.0000],
             [-1.0000,  0.0000,  0.0000],
             [-2.0000, -1.0000,  0.0000]],
    <BLANKLINE>
            [[ 0.0000,  0.0000,  0.0000],
             [-0.5000,  0.0000,  0.0000],
             [-1.0000, -0.5000,  0.0000]]])
    """

    def __init__(
        self,
        num_heads: int,
        *,
        mode: Literal["causal", "symmetric"] = "causal",
        slopes: Sequence[float] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.mode = check_choice("mode", mode, ("causal", "symmetric"))
        if slopes is None:
            slopes = alibi_slopes(self.num_heads)
        slopes = [float(s) for s in slopes]
        if len(slopes) != self.num_heads:
            raise ValueError(f"slopes must have num_heads={self.num_heads} entries, got {len(slopes)}")
        if not all(s > 0 and math.isfinite(s) for s in slopes):
            raise ValueError(f"slopes must be finite and > 0, got {slopes}")
        self._slopes = tuple(slopes)
        self.register_buffer("slopes", torch.empty(0), persistent=False)
        self._init_buffers(device)

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        self.slopes = torch.tensor(self._slopes, dtype=torch.float32, device=device)  # (H,)

    @property
    def defines_future(self) -> bool:  # causal mode has no bias for future keys: attention must mask them
        return self.mode == "symmetric"

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, mode={self.mode!r}"

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        rel = relative_position.clamp(max=0) if self.mode == "causal" else -relative_position.abs()  # (n,)
        return self.slopes[:, None] * rel.to(self.slopes.dtype)  # (H, n)

    def offsets(self, query_length: int, key_length: int, *, q_offset: int = 0, device=None) -> OffsetBias:
        """Per-offset values, with the closed form (:class:`LinearForm`) a GPU kernel computes in place.

        The last call's are kept: a model's layers share one ALiBi and ask for the same offsets in turn, so a
        forward (or a decoding step) builds them once, not once per layer (half a dozen small operators, each a
        launch on a GPU). Where :mod:`relpos._reuse` allows; rebuilt when the slopes or their device change."""
        key = (query_length, key_length, q_offset, device, self.mode, storage_key(self.slopes))
        kept = self.__dict__.setdefault("_last_offsets", KeptResult())  # plain attribute: not state, not a buffer
        offsets = kept.get(key, self.slopes.device)
        if offsets is None:
            offsets = super().offsets(query_length, key_length, q_offset=q_offset, device=device)
            slopes = self.slopes.to(device=offsets.values.device, dtype=torch.float32)  # (H,)
            offsets = replace(offsets, linear=LinearForm(slopes, symmetric=self.mode == "symmetric"))
            kept.keep(key, self.slopes.device, (self.slopes,), offsets)
        return offsets
