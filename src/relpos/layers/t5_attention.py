"""The T5 bias explainer's T5 attention layer, cross-attention, and a T5-style stack, on :class:`MultiheadAttention`.

One :class:`RelativePositionalBias` is shared by every layer (T5's layer 0 owns the table and
hands its bias to the others); its parameters count once. Each layer returns the bias it used,
in per-offset form, so the next layer reuses it without recomputing or materializing it.

T5 does not scale logits by ``1/sqrt(d)`` (the scale is folded into its initialisation):
``scale=1.0`` is the default here, as in transformers. The T5 bias explainer divides by ``sqrt(d)``;
pass ``scale=None`` for that.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_bias_heads, check_bool, check_device, check_int
from ..backends.dispatch import Backend, BiasLike, attention
from ..core.bias import AdditiveBias
from .mha import KVCache, MultiheadAttention
from ..encodings.t5 import RelativePositionalBias

__all__ = ["T5Attention", "T5Block", "T5Stack", "cross_attention_with_bias"]


class T5Attention(MultiheadAttention):
    """Multi-head attention with a (shareable) T5 relative position bias, the T5 bias explainer's API.

    Args:
        dim: model width.
        num_heads: heads.
        num_buckets, max_distance, bidirectional: the bias this layer builds when
            ``has_relative_bias`` and no ``relative_bias`` is given.
        has_relative_bias: whether this layer adds a bias of its own (T5: layer 0 only; the
            others receive ``position_bias`` from it).
        relative_bias: a bias module to share between layers (overrides the above).
        head_dim: per-head width (T5's ``d_kv``); ``dim // num_heads`` by default.
        causal: mask future keys in self-attention; defaults to ``not bidirectional``.
        scale: logit scale, ``1.0`` like T5; ``None`` for ``1/sqrt(head_dim)``.
        dropout: attention-weight dropout (T5's ``dropout_rate``), applied only in training mode.

    ``forward(x, mask=None, position_bias=None, *, key_mask=None)`` returns ``(output, position_bias)``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        has_relative_bias: bool = True,
        bidirectional: bool = True,
        *,
        relative_bias: AdditiveBias | None = None,
        head_dim: int | None = None,
        causal: bool | None = None,
        scale: float | None = 1.0,
        dropout: float = 0.0,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_bool("has_relative_bias", has_relative_bias)
        check_bool("bidirectional", bidirectional)
        device = check_device("device", device)
        if relative_bias is None and has_relative_bias:
            relative_bias = RelativePositionalBias(
                num_heads, num_buckets, max_distance, bidirectional, device=device, dtype=dtype
            )
        super().__init__(
            dim,
            num_heads,
            position=relative_bias,
            head_dim=head_dim,
            causal=(not bidirectional) if causal is None else causal,
            scale=scale,
            dropout=dropout,
            backend=backend,
            device=device,
            dtype=dtype,
        )

    @property
    def relative_bias(self) -> AdditiveBias | None:
        return self.position

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        position_bias: BiasLike = None,
        *,
        key_value_states: torch.Tensor | None = None,
        cache: KVCache | None = None,
        q_offset: int | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, BiasLike]:
        """Self-attention over ``x`` (B, L, dim), or cross-attention to ``key_value_states``.

        ``mask``: an attention mask as in :func:`relpos.attention`; ``key_mask`` (B, Lk): True for
        real tokens (padding at no (B, H, L, L) cost).
        """
        return super().forward(
            x, memory=key_value_states, cache=cache, attn_mask=mask, key_mask=key_mask,
            position_bias=position_bias, q_offset=q_offset,
        )

    @classmethod
    def from_hf(cls, hf_attention: nn.Module, *, backend: Backend = "auto") -> "T5Attention":
        """Copy a ``transformers`` ``T5Attention`` (its q/k/v/o and, if any, its bias table).

        Only attributes are read; transformers is not imported.
        """
        config = hf_attention.config
        weight = hf_attention.q.weight
        layer = cls(
            config.d_model,
            config.num_heads,
            config.relative_attention_num_buckets,
            config.relative_attention_max_distance,
            has_relative_bias=hf_attention.has_relative_attention_bias,
            bidirectional=not config.is_decoder,
            head_dim=config.d_kv,
            causal=bool(config.is_decoder),
            scale=1.0,
            backend=backend,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            layer.qkv.weight.copy_(torch.cat([hf_attention.q.weight, hf_attention.k.weight, hf_attention.v.weight]))
            layer.out.weight.copy_(hf_attention.o.weight)
            if layer.relative_bias is not None:
                layer.relative_bias.relative_attention_bias.weight.copy_(hf_attention.relative_attention_bias.weight)
        return layer


class T5Block(nn.Module):
    """Pre-norm T5 block: self-attention, optional cross-attention, ReLU feed-forward (no biases)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ff_dim: int,
        *,
        relative_bias: AdditiveBias,
        causal: bool,
        cross_attention: bool = False,
        dropout: float = 0.0,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        check_int("dim", dim, minimum=1)
        check_int("ff_dim", ff_dim, minimum=1)
        check_bool("cross_attention", cross_attention)
        factory = {"device": device, "dtype": dtype}
        attn = {"dropout": dropout, "backend": backend, **factory}
        self.self_norm = nn.RMSNorm(dim, eps=1e-6, **factory)
        self.self_attn = T5Attention(dim, num_heads, relative_bias=relative_bias, causal=causal, **attn)
        self.cross_norm = nn.RMSNorm(dim, eps=1e-6, **factory) if cross_attention else None
        self.cross_attn = T5Attention(dim, num_heads, has_relative_bias=False, **attn) if cross_attention else None
        self.ff_norm = nn.RMSNorm(dim, eps=1e-6, **factory)
        self.ff = nn.Sequential(
            nn.Linear(dim, ff_dim, bias=False, **factory), nn.ReLU(), nn.Linear(ff_dim, dim, bias=False, **factory)
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        position_bias: BiasLike = None,
        memory: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
        key_mask: torch.Tensor | None = None,
        memory_key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, BiasLike]:
        """``key_mask`` (B, L): True for this stack's real tokens; ``memory_key_mask`` the same for ``memory``."""
        if memory is not None and self.cross_attn is None:
            raise ValueError("memory was given but this block has no cross-attention; build it with cross_attention=True")
        h, position_bias = self.self_attn(self.self_norm(x), position_bias=position_bias, cache=cache, key_mask=key_mask)
        x = x + h  # (B, L, dim)
        if self.cross_attn is not None and memory is not None:  # cross_cache: memory's k/v projected once
            cross = self.cross_attn(self.cross_norm(x), key_value_states=memory, cache=cross_cache, key_mask=memory_key_mask)
            x = x + cross[0]
        return x + self.ff(self.ff_norm(x)), position_bias


class T5Stack(nn.Module):
    """A T5 encoder (``bidirectional=True``) or decoder stack with ONE relative bias for all layers.

    ``forward(x, memory=None, caches=None, key_mask=None, memory_key_mask=None)``: ``x`` (B, L, dim)
    embeddings; ``memory`` the encoder output (decoder with ``cross_attention=True``); ``caches``
    one :class:`KVCache` per layer for token-by-token decoding; ``key_mask`` / ``memory_key_mask``
    (B, L) True for real tokens of ``x`` (all cached ones while decoding) / of ``memory``.
    ``dropout`` is the attention-weight dropout of every layer (training mode only). Layer 0
    builds the bias, the others reuse it.
    """

    def __init__(
        self,
        num_layers: int,
        dim: int,
        num_heads: int,
        ff_dim: int,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        cross_attention: bool = False,
        dropout: float = 0.0,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        check_int("num_layers", num_layers, minimum=1)
        check_int("dim", dim, minimum=1)
        check_bool("bidirectional", bidirectional)
        factory = {"device": device, "dtype": dtype}
        self.relative_bias = RelativePositionalBias(num_heads, num_buckets, max_distance, bidirectional, **factory)
        self.blocks = nn.ModuleList(
            T5Block(
                dim, num_heads, ff_dim, relative_bias=self.relative_bias, causal=not bidirectional,
                cross_attention=cross_attention, dropout=dropout, backend=backend, **factory,
            )
            for _ in range(num_layers)
        )
        self.final_norm = nn.RMSNorm(dim, eps=1e-6, **factory)

    def new_caches(self) -> list[tuple[KVCache, KVCache]]:
        """One (self-attention, cross-attention) cache pair per layer, for decoding."""
        return [(KVCache(), KVCache()) for _ in self.blocks]

    def forward(
        self,
        x: torch.Tensor,
        *,
        memory: torch.Tensor | None = None,
        caches: list[tuple[KVCache, KVCache] | KVCache] | None = None,
        key_mask: torch.Tensor | None = None,
        memory_key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``caches``: from :meth:`new_caches` (or one self-attention ``KVCache`` per layer)."""
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"caches must hold one KVCache per layer ({len(self.blocks)}), got {len(caches)}")
        position_bias = None
        for i, block in enumerate(self.blocks):
            pair = (None, None) if caches is None else caches[i]
            self_cache, cross_cache = (pair, None) if isinstance(pair, KVCache) else pair
            x, position_bias = block(
                x, position_bias=position_bias, memory=memory, cache=self_cache, cross_cache=cross_cache,
                key_mask=key_mask, memory_key_mask=memory_key_mask,
            )
        return self.final_norm(x)


def cross_attention_with_bias(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative_bias: AdditiveBias,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    q_offset: int = 0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """The T5 bias explainer's cross-attention: q ``(B, H, Lq, d)``, k/v ``(B, H, Lk, d)``, ``Lq != Lk`` allowed.

    The bias is built per offset for the (Lq, Lk) pair; ``scale=None`` is ``1/sqrt(d)`` as in
    the explainer.
    """
    # a head-count error names this function's argument; attention() validates everything else
    if isinstance(relative_bias, AdditiveBias) and isinstance(query, torch.Tensor) and query.dim() == 4:
        check_bias_heads("relative_bias", relative_bias.num_heads, query.shape[1], query_length=query.shape[2])
    return attention(
        query, key, value, bias=relative_bias, attn_mask=mask, scale=scale, q_offset=q_offset, backend=backend
    )
