"""UDOP (document understanding: text, layout boxes and image) on relpos attention.

``UdopAttention`` is T5's attention under another name. Its two stacks use the bias differently:

* the decoder: layer 0's table with causal T5 buckets, through ``compute_bias``: per offset under
  relpos, like T5;
* the encoder: the stack sums the 1D bucket bias and the 2D layout biases (UDOP, Tang et al. 2023:
  horizontal and vertical distances between token box centres, scaled by 100 and bucketed, per
  example) in ``RelativePositionBiasAggregated``; transformers builds it as one dense ``(B, H, L, L)``
  tensor for layer 0 and every layer after it. Under relpos that module's *instance* returns a
  :class:`LayoutBias` instead: each component's table looked up once per *distance* (every integer
  distance the batch's boxes can produce: ``(H, R)`` values, no per-pair bucketing), and the
  attention runs query tile by query tile, each tile's ``(B, H, T, L)`` bias gathered from those
  values (the 1D offsets, the tile's x and y distances), the padding added, one fused SDPA call.
  Never ``(B, H, L, L)``.

A bias with ``prefix_bucket`` or ``augmentation`` (random rescaling in training), or a component of
another class, keeps transformers' dense build (correct, not faster); so does training the layout
tables (:func:`_tables_learn`). The decoder's bias is per offset in training too.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..encodings.buckets import relative_position_bucket
from ._attention import NAME
from ._family import Family, register
from ._t5like import t5_like_family

__all__ = ["FAMILY", "LayoutBias"]

#: bias elements (B * H * T * L) per query tile: 16 MiB in fp32 (the tile's bias, its mask and SDPA's
#: workspace stay in cache-sized pieces; a whole (B, H, L, L) bias at L = 2048, B = 2, 8 heads is 256 MiB)
_TILE_ELEMENTS = 1 << 22
#: the component classes this adapter rebuilds per tile (transformers' three; any other keeps the dense build)
_COMPONENTS = ("RelativePositionBias1D", "RelativePositionBiasHorizontal", "RelativePositionBiasVertical")

_BASE = t5_like_family(
    "udop",
    "UDOP",
    ("udop",),
    ("UdopAttention",),
    bidirectional=lambda module: not module.is_decoder,
    extra_attributes=("is_decoder",),
)


@dataclass(frozen=True)
class _Component:
    """One bias component: ``values[:, distance - low]`` for every integer distance in ``[low, low + R)``."""

    values: torch.Tensor  # (H, R)
    low: int
    positions: torch.Tensor | None  # (B, L) box centres (x or y), None for the 1D (token index) component
    scale: float


@dataclass(frozen=True)
class LayoutBias:
    """UDOP's encoder bias (1D + layout) in per-distance form; the attention builds it one query tile at a time.

    ``attend`` is the protocol :func:`relpos.hf._attention.relpos_attention_forward` looks for.
    """

    components: tuple[_Component, ...]
    length: int

    def tile(self, start: int, stop: int) -> torch.Tensor:
        """``(B or 1, H, stop - start, L)``: the summed bias of queries ``start:stop``, in transformers' order."""
        total = None
        for c in self.components:
            if c.positions is None:
                keys = torch.arange(self.length, device=c.values.device)
                distance = keys[None, :] - keys[start:stop, None]  # (T, L): key - query
                part = c.values[:, distance - c.low][None]  # (1, H, T, L)
            else:
                relative = (c.positions[:, None, :] - c.positions[:, start:stop, None]).float() * c.scale  # (B, T, L)
                part = F.embedding(relative.to(torch.long) - c.low, c.values.T).permute(0, 3, 1, 2)  # (B, H, T, L)
            total = part if total is None else part + total
        return total

    def dense(self) -> torch.Tensor:
        """``(B, H, L, L)`` (attention weights requested: transformers' eager reference)."""
        return self.tile(0, self.length)

    def attend(self, query, key, value, key_mask, dropout_p: float, scale) -> torch.Tensor:
        """``(B, H, L, d)``: attention of every query tile with its bias tile and the padding ``key_mask`` (B, L)."""
        batch, heads, length, _ = query.shape
        size = max(1, _TILE_ELEMENTS // (batch * heads * length))
        blocked = None  # (B, 1, 1, L): the padding, added to each tile's bias
        if key_mask is not None:
            blocked = torch.where(key_mask, 0.0, torch.finfo(query.dtype).min)[:, None, None].to(query.dtype)
        outputs = []
        for start in range(0, length, size):
            bias = self.tile(start, min(length, start + size)).to(query.dtype)  # (B, H, T, L)
            if blocked is not None:
                bias = bias + blocked
            outputs.append(F.scaled_dot_product_attention(
                query[:, :, start : start + size], key, value, attn_mask=bias, dropout_p=dropout_p, scale=scale,
            ))  # (B, H, T, d)
        return torch.cat(outputs, dim=2)  # (B, H, L, d)


def _component(module: nn.Module, length: int, bbox) -> _Component:
    """One component's values per integer distance (bucketed and looked up once), and its token positions."""
    table = module.relative_attention_bias.weight  # (buckets, H)
    device = table.device
    if type(module).__name__ == _COMPONENTS[0]:
        positions, scale, low, high = None, 1.0, -(length - 1), length - 1
    else:
        columns = [0, 2] if type(module).__name__ == _COMPONENTS[1] else [1, 3]
        positions = bbox[:, :, columns].mean(dim=-1)  # (B, L): box centres, as transformers reads them
        scale = float(module.scaling_factor)
        span = float((positions.max() - positions.min()).abs()) * scale  # the widest distance, scaled
        low, high = -int(span) - 2, int(span) + 2  # truncation toward zero stays within +-(span + 1)
    distances = torch.arange(low, high + 1, device=device)  # (R,)
    buckets = relative_position_bucket(distances, bidirectional=module.bidirectional,
                                       num_buckets=module.relative_attention_num_buckets, max_distance=module.max_distance)
    values = F.embedding(buckets.clamp(0, table.shape[0] - 1), table).T  # (H, R), gradients into the table
    return _Component(values, low, positions, scale)


def _per_tile(module: nn.Module) -> bool:
    return all(type(b).__name__ in _COMPONENTS and not b.prefix_bucket and not b.augmentation for b in module.biases)


def _tables_learn(module: nn.Module) -> bool:
    """A layout table needs a gradient. Per tile, autograd would then keep every tile's ``(B, H, T, L)`` bias,
    its distance indices and SDPA's math-kernel scores: more than transformers' dense build (training grid,
    B = 4, L = 2048: 1.37x its memory at 0.69x its speed; docs/integrations/t5-like.md), so training takes the dense build."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())


def _aggregated_forward(self, attention_mask=None, bbox=None):
    """``RelativePositionBiasAggregated.forward`` for one instance: a :class:`LayoutBias` under ``"relpos"``
    (transformers' dense build while a layout table learns)."""
    if (self._relpos_config._attn_implementation != NAME or not _per_tile(self) or _tables_learn(self)
            or (bbox is None and len(self.biases) > 1)):
        return type(self).forward(self, attention_mask, bbox)
    length = attention_mask.shape[1]
    return LayoutBias(tuple(_component(b, length, bbox) for b in self.biases), length)


def _aggregators(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """(each encoder stack's ``relative_bias`` module, the stack's config)."""
    return [(m.relative_bias, m.config) for m in model.modules()
            if type(m.__dict__.get("_modules", {}).get("relative_bias")).__name__ == "RelativePositionBiasAggregated"]


_COMPONENT_ATTRIBUTES = ("relative_attention_bias", "relative_attention_num_buckets", "max_distance", "bidirectional",
                         "scaling_factor", "prefix_bucket", "augmentation")


def _check_aggregators(aggregators: list[tuple[nn.Module, object]]) -> None:
    """Each layout-bias component has what :func:`_component` reads (checked before any change)."""
    for module, _ in aggregators:
        for part in getattr(module, "biases", [None]):
            missing = [a for a in _COMPONENT_ATTRIBUTES if not hasattr(part, a)]
            if missing:
                import transformers

                raise RuntimeError(
                    f"relpos.hf.accelerate does not fit UDOP's RelativePositionBiasAggregated of the installed "
                    f"transformers {transformers.__version__}: a component lacks {missing}. Upgrade transformers, "
                    "or run the model unaccelerated."
                )


def _apply(model: nn.Module, modules: list[nn.Module]):
    aggregators = _aggregators(model)
    _check_aggregators(aggregators)
    undo_base = _BASE.apply(model, modules)
    for module, config in aggregators:
        module._relpos_config = config  # a plain attribute: no parameter, buffer or state_dict entry
        module.forward = types.MethodType(_aggregated_forward, module)  # instance attribute: this model only

    def undo() -> None:
        for module, _ in aggregators:
            del module.forward
            del module._relpos_config
        undo_base()

    return undo


FAMILY = register(
    Family(
        name="udop",
        title="UDOP",
        model_types=("udop",),
        attention_classes=("UdopAttention",),
        check=_BASE.check,
        apply=_apply,
        unsupported=(
            "a layout bias with prefix_bucket or augmentation, or layout tables that learn (training), keep "
            "transformers' dense (B, H, L, L) encoder bias; "
            "output_attentions builds the dense bias for that call"
        ),
    )
)
