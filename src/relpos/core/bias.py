"""The interface every additive attention bias in relpos implements.

An additive bias adds ``b[h, i, j]`` to the attention logits of head ``h``, query ``i``
and key ``j``. Two kinds exist:

* **relative** biases (T5, clipped, ALiBi, log-decay, ...) depend only on the offset
  ``j - i``. They implement :meth:`RelativeBias.bias_at` (values at given offsets) and
  inherit everything else. Their natural form is :class:`OffsetBias`: one value per
  distinct offset, ``Lq + Lk - 1`` of them, O(H * (Lq + Lk)) memory, never (H, Lq, Lk).
* **table** biases over a fixed window (Swin) are not translation invariant in 1D
  sequence terms; they return their dense ``(H, N, N)`` tensor.

Attention takes either: ``bias.offsets(Lq, Lk, q_offset=...)`` where it can,
``bias.materialize(Lq, Lk, q_offset=...)`` (a dense ``(1, H, Lq, Lk)`` tensor) where it must.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .._checks import check_device, check_int
from .offsets import relative_offsets

__all__ = ["OffsetBias", "AdditiveBias", "LinearForm", "RelativeBias", "hankel_view"]


def hankel_view(values: torch.Tensor, key_length: int, *, rows: int | None = None, offset: int = 0) -> torch.Tensor:
    """(1, H, rows, Lk) strided view of ``values (H, n)`` whose row ``r`` is ``values[:, offset + r : offset + r + Lk]``.

    ``rows`` defaults to every full window, ``n - Lk + 1 - offset``. No copy; gradients flow into
    ``values``. Built with ``as_strided``, not ``unfold``: ``unfold`` would pin ``key_length`` to a
    constant under ``torch.compile``.
    """
    values = values.contiguous()  # (H, n), stride (n, 1)
    if rows is None:
        rows = values.shape[1] - key_length + 1 - offset
    shape = (1, values.shape[0], rows, key_length)
    strides = (0, values.stride(0), 1, 1)
    if offset == 0:  # the common case keeps the input's storage offset (simplest graph under torch.compile)
        return values.as_strided(shape, strides)
    return values.as_strided(shape, strides, values.storage_offset() + offset)


@dataclass(frozen=True)
class LinearForm:
    """A bias that is a closed form of the offset ``o = j - i`` with one slope ``m`` per head.

    ``symmetric=False``: ``m * min(o, 0)`` (ALiBi's causal form, 0 for future keys);
    ``symmetric=True``: ``-m * |o|``. A GPU kernel computes it inside each tile from the slopes
    instead of reading per-offset values.
    """

    slopes: torch.Tensor  # (H,) fp32
    symmetric: bool


@dataclass(frozen=True)
class OffsetBias:
    """A Toeplitz bias stored once per offset.

    ``values[h, t]`` is the bias of head ``h`` at offset ``j - i = t - (q_offset + Lq - 1)``;
    query ``i`` sits at position ``q_offset + i`` among keys ``0 .. Lk-1``.

    >>> ob = OffsetBias(torch.tensor([[-2., -1., 0., 1., 2., 3.]]), query_length=3, key_length=4)
    >>> ob.dense()[0, 0]           # b[i, j] = j - i
    tensor([[ 0.,  1.,  2.,  3.],
            [-1.,  0.,  1.,  2.],
            [-2., -1.,  0.,  1.]])
    >>> ob.hankel()[0, 0]          # zero-copy view, query rows reversed
    tensor([[-2., -1.,  0.,  1.],
            [-1.,  0.,  1.,  2.],
            [ 0.,  1.,  2.,  3.]])
    """

    values: torch.Tensor  # (H, Lq + Lk - 1)
    query_length: int
    key_length: int
    q_offset: int = 0
    #: ``(lo, hi)``: every offset ``<= lo`` reads one parameter (one table entry), and so does every
    #: offset ``>= hi`` (T5 beyond ``max_distance``, clipped beyond R). A kernel then adds one scalar per
    #: head to a tile that lies wholly in such a range, and sends that tile's gradient to one entry.
    flat: tuple[int, int] | None = None
    #: the same values as a closed form of the offset (ALiBi), when one exists.
    linear: LinearForm | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.values, torch.Tensor) or not self.values.dtype.is_floating_point:
            got = self.values.dtype if isinstance(self.values, torch.Tensor) else type(self.values).__name__
            raise TypeError(f"values must be a floating tensor (num_heads, query_length + key_length - 1), got {got}")
        check_int("query_length", self.query_length, minimum=1)
        check_int("key_length", self.key_length, minimum=1)
        check_int("q_offset", self.q_offset, minimum=0)
        expected = self.query_length + self.key_length - 1
        if self.values.dim() != 2 or self.values.shape[-1] != expected:
            raise ValueError(
                f"values must have shape (num_heads, query_length + key_length - 1) = (H, {expected}), "
                f"got {tuple(self.values.shape)}"
            )

    @property
    def num_heads(self) -> int:
        return self.values.shape[0]

    def offsets(self) -> torch.Tensor:
        """The offset ``j - i`` of each entry of :attr:`values`."""
        return relative_offsets(self.query_length, self.key_length, q_offset=self.q_offset, device=self.values.device)

    def hankel(self) -> torch.Tensor:
        """(1, H, Lq, Lk) strided *view* of :attr:`values` whose row ``r`` is query ``Lq - 1 - r``.

        Attention with reversed queries and this view as its additive mask gives the exact
        biased result with no (H, Lq, Lk) copy (``as_strided`` cannot express the Toeplitz
        form itself: it would need a negative stride). Gradients flow into :attr:`values`.
        """
        return hankel_view(self.values, self.key_length)  # (1, H, Lq, Lk)

    def dense(self) -> torch.Tensor:
        """(1, H, Lq, Lk) materialized bias ``b[h, i, j]`` (a copy)."""
        return self.hankel().flip(-2)  # (1, H, Lq, Lk)

    def row(self, i: int) -> torch.Tensor:
        """(H, Lk) bias of query row ``i``: a view, no computation."""
        i = check_int("i", i, minimum=0)
        if i >= self.query_length:
            raise ValueError(f"i must be < query_length={self.query_length}, got {i}")
        start = self.query_length - 1 - i
        return self.values[:, start : start + self.key_length]  # (H, Lk)

    def mask_future(self) -> "OffsetBias":
        """The same bias with every key in a query's future (``j - i > 0``) set to ``-inf``.

        A causal mask is itself Toeplitz, so it folds into the per-offset values.
        """
        future = self.offsets() > 0  # (n,)
        values = self.values.masked_fill(future, float("-inf"))  # (H, n)
        return OffsetBias(values, self.query_length, self.key_length, self.q_offset)

    def to(self, dtype: torch.dtype) -> "OffsetBias":
        return replace(self, values=self.values.to(dtype))

    def flat_indices(self) -> tuple[int, int]:
        """:attr:`flat` as indices into :attr:`values`: ``values[:, :lo + 1]`` share one entry, as do
        ``values[:, hi:]``; ``(-1, n)`` when there is no such range.

        >>> OffsetBias(torch.zeros(1, 9), 5, 5, flat=(-2, 2)).flat_indices()   # offsets -4 .. 4
        (2, 6)
        """
        n = self.values.shape[-1]
        if self.flat is None:
            return -1, n
        base = self.q_offset + self.query_length - 1  # index of offset 0
        return max(-1, min(self.flat[0] + base, n - 1)), min(n, max(self.flat[1] + base, 0))


class AdditiveBias(nn.Module):
    """Base class of every additive bias: ``num_heads`` and a dense form on demand."""

    num_heads: int
    #: True when the bias depends only on ``j - i`` (then :meth:`offsets` works).
    translation_invariant: bool = False
    #: False when the bias defines no value for future keys (``j > i``): attention then requires
    #: ``causal=True`` rather than silently adding 0 there (ALiBi's causal mode).
    defines_future: bool = True

    def materialize(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The dense ``(1, H, Lq, Lk)`` bias."""
        raise NotImplementedError

    def resolve(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> "OffsetBias | torch.Tensor":
        """What attention uses: :meth:`offsets` for a translation-invariant bias, else :meth:`materialize`.

        A bias that is per-offset only for some calls (FIRE up to its threshold) overrides this.
        """
        if self.translation_invariant:
            return self.offsets(query_length, key_length, q_offset=q_offset, device=device)
        return self.materialize(query_length, key_length, q_offset=q_offset, device=device)

    def offsets(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> OffsetBias:
        """The per-offset form; only for translation-invariant biases."""
        raise TypeError(
            f"{type(self).__name__} is not translation invariant, so it has no per-offset form; "
            "use .materialize(query_length, key_length) for its dense tensor"
        )


class RelativeBias(AdditiveBias):
    """A bias that depends only on ``j - i``: subclasses implement :meth:`bias_at`."""

    translation_invariant = True

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        """(H, n) bias values at the (n,) integer offsets ``key - query``."""
        raise NotImplementedError

    def offsets(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> OffsetBias:
        """Per-offset bias for queries at ``q_offset .. q_offset + Lq - 1``: O(Lq + Lk) work and memory."""
        device = check_device("device", device)
        rel = relative_offsets(query_length, key_length, q_offset=q_offset, device=self._device())  # (n,)
        values = self.bias_at(rel).contiguous()  # (H, n)
        if device is not None:
            values = values.to(device)
        return OffsetBias(values, query_length, key_length, q_offset)

    def materialize(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        return self.offsets(query_length, key_length, q_offset=q_offset, device=device).dense()  # (1, H, Lq, Lk)

    def forward(
        self, query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The dense ``(1, H, Lq, Lk)`` bias (T5's ``compute_bias`` form): every relative bias is callable.

        ``q_offset`` and ``device`` are keyword-only: a third positional number is refused, not
        taken as a device. :meth:`offsets` is the per-offset form attention uses.
        """
        return self.materialize(query_length, key_length, q_offset=q_offset, device=device)

    def _device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")
