"""Seed 000's T5 attention layer and cross-attention, on relpos's bias and attention.

One :class:`RelativePositionalBias` is shared by every layer (T5's layer 0 owns the table
and hands its bias to the others); its parameters count once. Each layer returns the bias
it used, in per-offset form, so the next layer reuses it without recomputing or
materializing it.

T5 does not scale logits by ``1/sqrt(d)`` (the scale is folded into its initialisation):
``scale=1.0`` is the default here, as in transformers. Seed 000 divides by ``sqrt(d)``;
pass ``scale=None`` for that.
"""

from __future__ import annotations

import torch
from torch import nn

from ._checks import check_int
from .attention import Backend, BiasLike, attention, resolve_bias
from .bias import AdditiveBias
from .t5 import RelativePositionalBias

__all__ = ["T5Attention", "cross_attention_with_bias"]


class T5Attention(nn.Module):
    """Multi-head attention with a (shareable) T5 relative position bias.

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

    ``forward(x, mask=None, position_bias=None)`` returns ``(output, position_bias)``.
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
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_int("dim", dim, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(
                    f"dim must be divisible by num_heads when head_dim is not given, got dim={dim}, "
                    f"num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = dim // num_heads
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        inner = self.num_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(dim, inner, bias=False, **factory)
        self.k_proj = nn.Linear(dim, inner, bias=False, **factory)
        self.v_proj = nn.Linear(dim, inner, bias=False, **factory)
        self.o_proj = nn.Linear(inner, dim, bias=False, **factory)
        if relative_bias is None and has_relative_bias:
            relative_bias = RelativePositionalBias(num_heads, num_buckets, max_distance, bidirectional, **factory)
        if relative_bias is not None and relative_bias.num_heads != num_heads:
            raise ValueError(f"relative_bias has num_heads={relative_bias.num_heads}, this layer has {num_heads}")
        self.relative_bias = relative_bias
        self.causal = (not bidirectional) if causal is None else causal
        self.scale = scale
        self.backend = backend

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, dh)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        position_bias: BiasLike = None,
        *,
        key_value_states: torch.Tensor | None = None,
        q_offset: int = 0,
    ) -> tuple[torch.Tensor, BiasLike]:
        """Self-attention over ``x`` (B, L, dim), or cross-attention to ``key_value_states``.

        Returns the output (B, L, dim) and the bias used (an :class:`~relpos.OffsetBias` for
        relative biases), to pass to the next layer as ``position_bias``.
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (B, L, dim={self.dim}), got {tuple(x.shape)}")
        source = x if key_value_states is None else key_value_states
        q = self._heads(self.q_proj(x))  # (B, H, Lq, dh)
        k = self._heads(self.k_proj(source))  # (B, H, Lk, dh)
        v = self._heads(self.v_proj(source))  # (B, H, Lk, dh)
        if position_bias is None:  # this layer owns the bias: build it once, hand it on
            position_bias = resolve_bias(
                self.relative_bias, q.shape[2], k.shape[2], num_heads=self.num_heads, q_offset=q_offset, device=x.device
            )
        out = attention(
            q,
            k,
            v,
            bias=position_bias,
            causal=self.causal and key_value_states is None,
            attn_mask=mask,
            scale=self.scale,
            q_offset=q_offset,
            backend=self.backend,
        )  # (B, H, Lq, dh)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # (B, Lq, H*dh)
        return self.o_proj(out), position_bias

    @classmethod
    def from_hf(cls, hf_attention: nn.Module, *, backend: Backend = "auto") -> "T5Attention":
        """Copy a ``transformers`` ``T5Attention`` (its q/k/v/o and, if any, its bias table).

        Only attributes are read; transformers is not imported.
        """
        config = hf_attention.config
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
            device=hf_attention.q.weight.device,
            dtype=hf_attention.q.weight.dtype,
        )
        with torch.no_grad():
            for ours, theirs in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
                getattr(layer, ours).weight.copy_(getattr(hf_attention, theirs).weight)
            if layer.relative_bias is not None:
                layer.relative_bias.relative_attention_bias.weight.copy_(hf_attention.relative_attention_bias.weight)
        return layer


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
    """Seed 000's cross-attention: q ``(B, H, Lq, d)``, k/v ``(B, H, Lk, d)``, ``Lq != Lk`` allowed.

    The bias is built per offset for the (Lq, Lk) pair; ``scale=None`` is ``1/sqrt(d)`` as in
    the seed.
    """
    return attention(
        query, key, value, bias=relative_bias, attn_mask=mask, scale=scale, q_offset=q_offset, backend=backend
    )
