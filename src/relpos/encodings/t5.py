"""T5's bucketed relative position bias (Raffel et al., 2020).

``RelativePositionalBias`` has the T5 bias explainer's API and Hugging Face's parameter name
(``relative_attention_bias``, an ``nn.Embedding(num_buckets, num_heads)``), so the
weights of any T5 checkpoint's bias load as they are and give exactly what
``T5Attention.compute_bias`` gives. The bucket lookup runs once per distinct offset
(``Lq + Lk - 1`` of them), not once per (query, key) pair.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .._checks import check_device, check_int, check_positive_float
from ..core.bias import OffsetBias, RelativeBias
from ..core.offsets import offset_range
from .buckets import BucketStrategy, check_bucket_config, offset_buckets, relative_position_bucket

__all__ = ["RelativePositionalBias"]


class RelativePositionalBias(RelativeBias):
    """T5's learned bias per (bucket, head), buckets from :func:`relpos.relative_position_bucket`.

    Also available as ``relpos.T5RelativeBias``. Not to be confused with
    :class:`relpos.RelativePositionBias` (alias ``relpos.WindowRelativeBias``), Swin's table over
    the offsets inside one window.

    Args:
        num_heads: attention heads; one bias column each.
        num_buckets: buckets (32 in T5).
        max_distance: distances at or beyond it share the last bucket (128 in T5).
        bidirectional: ``True`` for encoders, ``False`` for causal decoders.
        strategy: ``"log"`` (T5) or another bucketing of :data:`relpos.STRATEGIES`.

    ``forward(Lq, Lk)`` returns the dense ``(1, H, Lq, Lk)`` tensor (T5's ``compute_bias``);
    ``offsets(Lq, Lk)`` the ``(H, Lq + Lk - 1)`` per-offset form that attention uses.

    >>> bias = RelativePositionalBias(num_heads=1, num_buckets=8, max_distance=16)
    >>> with torch.no_grad():
    ...     _ = bias.relative_attention_bias.weight.copy_(torch.arange(8.0)[:, None])
    ...     print(bias(4, 4)[0, 0])    # weight[b] = b, so the bias shows the buckets (the T5 bucketing walkthrough)
    tensor([[0., 5., 6., 6.],
            [1., 0., 5., 6.],
            [2., 1., 0., 5.],
            [2., 2., 1., 0.]])
    """

    def __init__(
        self,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        *,
        strategy: BucketStrategy = "log",
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.num_buckets, self.max_distance, self.bidirectional, self.strategy = check_bucket_config(
            num_buckets, max_distance, bidirectional, strategy
        )
        self.init_std = check_positive_float("init_std", init_std)
        self.relative_attention_bias = nn.Embedding(self.num_buckets, self.num_heads, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.relative_attention_bias.weight, std=self.init_std)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}, strategy={self.strategy!r}"
        )

    def bucket(self, relative_position: torch.Tensor) -> torch.Tensor:
        """Bucket indices of integer offsets ``key - query`` (any shape)."""
        return relative_position_bucket(
            relative_position,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
            strategy=self.strategy,
        )

    def bias_at(self, relative_position: torch.Tensor) -> torch.Tensor:
        """(H, n) bias at the (n,) offsets: one bucket and one table row per offset."""
        return self._lookup(self.bucket(relative_position))  # (H, n)

    def _lookup(self, buckets: torch.Tensor) -> torch.Tensor:
        """(H, n) table rows of the (n,) bucket indices."""
        return self.relative_attention_bias(buckets).transpose(0, 1)  # (H, n)

    def offsets(self, query_length: int, key_length: int, *, q_offset: int = 0, device=None) -> OffsetBias:
        """Per-offset values; offsets at or beyond ``max_distance`` (and, in the causal form, every
        future offset, which shares offset 0's bucket) are marked :attr:`OffsetBias.flat`.

        The buckets of every offset are kept (:func:`~relpos.encodings.buckets.offset_buckets`): a call then
        costs one table lookup, not the bucket function's dozen elementwise kernels (each a launch on a GPU),
        whatever its lengths (a decoding step's offsets are new every step).
        """
        query_length = check_int("query_length", query_length, minimum=1)
        key_length = check_int("key_length", key_length, minimum=1)
        q_offset = check_int("q_offset", q_offset, minimum=0)
        device = check_device("device", device)
        buckets = self._offset_buckets(query_length, key_length, q_offset)  # (Lq + Lk - 1,)
        values = self._lookup(buckets).contiguous()  # (H, n)
        if device is not None:
            values = values.to(device)
        far = self.max_distance if self.bidirectional else 0
        return OffsetBias(values, query_length, key_length, q_offset, flat=(-self.max_distance, far))

    def _offset_buckets(self, query_length: int, key_length: int, q_offset: int) -> torch.Tensor:
        """(Lq + Lk - 1,) buckets of the call's offsets: a view of kept ones (:func:`offset_buckets`)."""
        return offset_buckets(
            *offset_range(query_length, key_length, q_offset), bidirectional=self.bidirectional,
            num_buckets=self.num_buckets, max_distance=self.max_distance, strategy=self.strategy,
            device=self.relative_attention_bias.weight.device,
        )

    @classmethod
    def from_t5_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        *,
        prefix: str = "encoder.block.0.layer.0.SelfAttention.",
        bidirectional: bool | None = None,
        max_distance: int = 128,
    ) -> "RelativePositionalBias":
        """Build the bias of a T5 checkpoint's state dict (no copy of the model needed).

        ``prefix`` selects the layer that owns the table: the encoder's is
        ``encoder.block.0.layer.0.SelfAttention.``, the decoder's
        ``decoder.block.0.layer.0.SelfAttention.``. ``bidirectional`` defaults to ``True``
        for an ``encoder.`` prefix and ``False`` for ``decoder.``. ``max_distance`` is not in
        the state dict: pass the config's ``relative_attention_max_distance`` (128 in T5).
        """
        key = prefix + "relative_attention_bias.weight"
        if key not in state_dict:
            found = sorted(k for k in state_dict if k.endswith("relative_attention_bias.weight"))
            raise KeyError(f"{key!r} is not in the state dict; relative bias tables found: {found}")
        weight = state_dict[key]
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
            got = (
                f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, torch.Tensor) else type(weight).__name__
            )
            raise ValueError(
                f"state_dict[{key!r}] must be a floating (num_buckets, num_heads) tensor, as T5's nn.Embedding "
                f"weight is; got {got}"
            )
        if bidirectional is None:
            bidirectional = not prefix.startswith("decoder.")
        module = cls(
            num_heads=weight.shape[1],
            num_buckets=weight.shape[0],
            max_distance=max_distance,
            bidirectional=bidirectional,
            device=weight.device,
            dtype=weight.dtype,
        )
        module.relative_attention_bias.load_state_dict({"weight": weight})
        return module
