"""Multi-head attention that takes any relpos position encoding, with a KV cache for decoding.

``position`` is one of: an additive bias (T5, clipped, ALiBi, log-decay, Kerple, Sandwich, FIRE,
windowed), a :class:`RotaryEmbedding` or :class:`XPos` (rotate q and k), a
:class:`ShawRelativePosition` (relative keys and values), a :class:`ForgettingGate` (gates from
the layer's input; the cache keeps their running sum), a :class:`CoPE` (contextual positions,
eager), or ``None``. Queries of a decoding step sit after the cached keys
(``q_offset = cache.length``), so every encoding gets its positions right by construction.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bias_heads, check_bool, check_choice, check_device, check_int, check_scale, check_tensor
from ..backends._dropout import check_dropout_p
from ..backends.dispatch import BACKENDS, Backend, BiasLike, attention, check_defines_future, resolve_bias
from ..backends._masks import check_key_mask, fold_key_mask
from ..core.bias import AdditiveBias
from ..encodings.cope import CoPE
from ..encodings.forgetting import ForgettingGate, gated_attention
from ..encodings.rotary import RotaryEmbedding
from ..encodings.shaw import ShawRelativePosition
from ..encodings.xpos import XPos

__all__ = ["KVCache", "MultiheadAttention", "PositionEncoding"]

PositionEncoding = Union[AdditiveBias, RotaryEmbedding, XPos, ShawRelativePosition, ForgettingGate, CoPE, None]


class KVCache:
    """Keys and values seen so far by one attention layer, ``(B, Hkv, T, d)`` each; with a
    :class:`ForgettingGate`, also ``gate``: the running sum of log forget gates ``(B, H, T)``."""

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.gate: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[-2]

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new ``(B, Hkv, L, d)`` keys and values; return everything cached."""
        if self.key is None:
            self.key, self.value = key, value
        else:
            self.key = torch.cat([self.key, key], dim=-2)  # (B, Hkv, T + L, d)
            self.value = torch.cat([self.value, value], dim=-2)
        return self.key, self.value


class MultiheadAttention(nn.Module):
    """Self- or cross-attention with a relpos position encoding.

    Args:
        embed_dim: model width.
        num_heads: query heads.
        position: the position encoding (see the module docstring); an additive bias module may
            be shared by many layers (its parameters count once).
        num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``).
        head_dim: per-head width (default ``embed_dim // num_heads``).
        causal: mask future keys in self-attention.
        scale: logit scale, ``None`` for ``1/sqrt(head_dim)``.
        dropout: attention-weight dropout probability, applied only in training mode.
        bias: whether the projections have biases.
        backend: attention backend (:func:`relpos.attention`).

    The q, k and v projections are one fused ``qkv`` linear layer (the Swin indexing notes); cross-attention
    applies its query rows to ``x`` and its key/value rows to ``memory``.
    ``forward`` returns ``(output, position_bias)``: the bias it used (an ``OffsetBias`` for
    relative biases), to hand to the next layer so the bias is built once per forward.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        position: PositionEncoding = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = False,
        scale: float | None = None,
        dropout: float = 0.0,
        bias: bool = False,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        check_bool("bias", bias)
        self.embed_dim = check_int("embed_dim", embed_dim, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.num_kv_heads = check_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads, minimum=1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim must be divisible by num_heads when head_dim is not given, got embed_dim={embed_dim}, "
                    f"num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self._check_position(position)
        self.position = position
        self.causal = check_bool("causal", causal)
        self.scale = check_scale("scale", scale)
        self.dropout = check_dropout_p("dropout", dropout)
        if isinstance(position, CoPE) and self.dropout:
            raise ValueError(f"dropout must be 0 with a CoPE position (its eager path has no attention dropout), got {dropout}")
        self.backend = check_choice("backend", backend, BACKENDS)
        factory = {"device": device, "dtype": dtype}
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(embed_dim, q_width + 2 * kv_width, bias=bias, **factory)
        self.out = nn.Linear(q_width, embed_dim, bias=bias, **factory)

    def _check_position(self, position: PositionEncoding) -> None:
        if position is None:
            return
        if isinstance(position, AdditiveBias):
            check_bias_heads("position bias", position.num_heads, self.num_heads, owner="this layer")
        elif isinstance(position, ForgettingGate):
            if (position.dim, position.num_heads) != (self.embed_dim, self.num_heads):
                raise ValueError(
                    f"position (ForgettingGate) has dim={position.dim}, num_heads={position.num_heads}; this layer has "
                    f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
                )
        elif isinstance(position, (RotaryEmbedding, XPos, ShawRelativePosition, CoPE)):
            if position.head_dim != self.head_dim:
                raise ValueError(f"position has head_dim={position.head_dim}, this layer has head_dim={self.head_dim}")
        else:
            raise TypeError(
                "position must be a relpos additive bias, RotaryEmbedding, XPos, ShawRelativePosition, ForgettingGate, "
                "CoPE or None; "
                f"got {type(position).__name__}"
            )

    def _gates(self, position: ForgettingGate, x: torch.Tensor, memory, cache: KVCache | None) -> torch.Tensor:
        """``c`` (B, H, T) of every key so far; a cache keeps it (one new row per decoding step)."""
        if memory is not None:
            raise ValueError("a ForgettingGate layer is self-attention only (its gates come from the keys' own tokens)")
        start = None if cache is None or cache.gate is None else cache.gate[..., -1]  # (B, H)
        gate = position.cumulative(x, start)  # (B, H, Lq)
        if cache is not None:
            cache.gate = gate if cache.gate is None else torch.cat([cache.gate, gate], dim=-1)  # (B, H, T)
            gate = cache.gate
        return gate

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)  # (B, heads, L, dh)

    def _project(self, x: torch.Tensor, memory: torch.Tensor | None):
        q_width = self.num_heads * self.head_dim
        if memory is None:
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)  # (B, L, H*dh), (B, L, Hkv*dh) x2
        else:
            w, b = self.qkv.weight, self.qkv.bias
            q = F.linear(x, w[:q_width], None if b is None else b[:q_width])  # (B, Lq, H*dh)
            k, v = F.linear(memory, w[q_width:], None if b is None else b[q_width:]).chunk(2, dim=-1)  # (B, Lk, Hkv*dh)
        return self._split(q, self.num_heads), self._split(k, self.num_kv_heads), self._split(v, self.num_kv_heads)

    def _check_inputs(self, x: torch.Tensor, memory: torch.Tensor | None) -> None:
        check_tensor("x", x, shape="(B, L, embed_dim)")
        if memory is not None:
            check_tensor("memory", memory, shape="(B, Lk, embed_dim)")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, L, embed_dim={self.embed_dim}), got {tuple(x.shape)}")
        weight = self.qkv.weight
        autocast = torch.is_autocast_enabled(x.device.type)  # autocast casts mixed dtypes itself
        for name, t in (("x", x), ("memory", memory)):
            if t is not None and ((t.dtype != weight.dtype and not autocast) or t.device != weight.device):
                raise TypeError(
                    f"{name} is {t.dtype} on {t.device} but this layer's weights are {weight.dtype} on {weight.device}; "
                    "cast one to the other with .to(...)"
                )

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, q_offset: int, *, cross: bool):
        """RoPE and xPos rotate the queries and the new keys (a cross-attention's keys from position 0)."""
        position, k_offset = self.position, 0 if cross else q_offset
        if isinstance(position, RotaryEmbedding):
            return position.rotate(q, q_offset), position.rotate(k, k_offset)  # (B, H, Lq, dh), (B, Hkv, L, dh)
        if isinstance(position, XPos):
            return position.rotate(q, q_offset), position.rotate(k, k_offset, downscale=True)
        return q, k

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _own_path(self, q, k, v, gate, *, causal: bool, attn_mask, key_mask, q_offset: int) -> torch.Tensor:
        """The encodings with an attention function of their own: forgetting gates, CoPE, Shaw. (B, H, Lq, dh)"""
        position = self.position
        if isinstance(position, ForgettingGate):
            return gated_attention(
                q, k, v, gate, causal=causal, attn_mask=attn_mask, key_mask=key_mask, dropout_p=self._dropout_p(),
                scale=self.scale, q_offset=q_offset, backend=self.backend,
            )
        if isinstance(position, CoPE):
            if attn_mask is not None:
                raise ValueError("CoPE layers take key_mask= for padding, not attn_mask= (positions count visible keys)")
            return position.attention(q, k, v, causal=causal, key_mask=key_mask, scale=self.scale, q_offset=q_offset)
        group = self.num_heads // self.num_kv_heads  # Shaw: every query head reads its own copy of the keys
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T, dh)
        if key_mask is not None:
            attn_mask = fold_key_mask(attn_mask, check_key_mask(key_mask, q.shape[0], k.shape[-2]))
        return position.attention(
            q, k, v, causal=causal, attn_mask=attn_mask, scale=self.scale, q_offset=q_offset, dropout_p=self._dropout_p()
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        memory: torch.Tensor | None = None,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        position_bias: BiasLike = None,
        q_offset: int | None = None,
    ) -> tuple[torch.Tensor, BiasLike]:
        """``x`` (B, Lq, embed_dim); ``memory`` (B, Lk, embed_dim) for cross-attention.

        ``attn_mask`` and ``key_mask`` as in :func:`relpos.attention` (``key_mask`` (B, Lk): True
        for real tokens among all the keys, cached ones included).

        With a ``cache`` (self-attention) the new keys and values are appended to it and the
        queries take positions ``cache.length ..``; ``q_offset`` overrides that position. With a
        ``cache`` in cross-attention the memory's keys and values are stored on the first call and
        reused after (the queries' positions start at 0 unless ``q_offset`` says otherwise).
        """
        self._check_inputs(x, memory)
        if q_offset is None:
            q_offset = cache.length if cache is not None and memory is None else 0
        q, k, v = self._project(x, memory)  # (B, H, Lq, dh), (B, Hkv, L, dh) x2
        q, k = self._rotate(q, k, q_offset, cross=memory is not None)
        gate = self._gates(self.position, x, memory, cache) if isinstance(self.position, ForgettingGate) else None  # (B, H, T)
        if cache is not None and memory is None:
            k, v = cache.update(k, v)  # (B, Hkv, T, dh): all keys so far
        elif cache is not None:  # cross-attention: the memory's keys and values are cached once
            k, v = cache.update(k, v) if cache.key is None else (cache.key, cache.value)
        causal = self.causal and memory is None
        if isinstance(self.position, (ForgettingGate, CoPE, ShawRelativePosition)):
            out = self._own_path(q, k, v, gate, causal=causal, attn_mask=attn_mask, key_mask=key_mask, q_offset=q_offset)
        else:
            if position_bias is None and isinstance(self.position, AdditiveBias):
                check_defines_future(self.position, causal, k.shape[-2], q_offset, attn_mask)  # before resolving it away
                position_bias = resolve_bias(
                    self.position, q.shape[-2], k.shape[-2], num_heads=self.num_heads, q_offset=q_offset, device=x.device
                )
            out = attention(
                q, k, v, bias=position_bias, causal=causal, attn_mask=attn_mask, key_mask=key_mask,
                dropout_p=self._dropout_p(), scale=self.scale, q_offset=q_offset, backend=self.backend,
            )  # (B, H, Lq, dh)
        out = out.transpose(1, 2).flatten(-2)  # (B, Lq, H*dh)
        return self.out(out), position_bias

