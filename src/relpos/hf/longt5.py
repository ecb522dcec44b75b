"""LongT5 on relpos attention: the decoder's T5 bias per offset, the encoder's local and transient-global
attention as banded tiles.

* ``LongT5Attention`` (the decoder, and the decoder-side attention of every head) is T5's under another
  name: its causal T5 bias goes per offset through the T5-like adapter (:mod:`relpos.hf._t5like`).
* ``LongT5LocalAttention`` (``encoder_attention_type="local"``; LongT5, Guo et al. 2022) lets each block
  of ``block_len = local_radius + 1`` queries see its own block and the two beside it (``3 * block_len``
  keys, of which those within ``local_radius`` count). Each *instance* gets a ``forward`` that runs
  chunks of blocks through one fused SDPA call each: queries ``(B * c, H, block_len, d)`` against their
  ``3 * block_len`` window, the T5 bias per offset inside the window (``(H, block_len, 3 * block_len)``,
  the same for every block: one broadcast mask) with the locality cut folded in; only a chunk whose
  blocks hold padding (or the sequence's ends) builds a per-block mask. Never ``(B, H, L, L)``, and no
  ``(B, H, L, 3 * block_len)`` for the whole sequence either: one chunk at a time.
* ``LongT5TransientGlobalAttention`` (``"transient-global"``) adds, for every query, keys of the
  ``L // global_block_size`` global tokens (sums of fixed blocks of the input, layer-normed), with their own
  T5 bias bucketed from ``global position - the query's global block`` (block ids per example, from the
  padding mask) and a mask keeping globals past an example's last block out. They are appended to each
  chunk's window keys, and their bias is built for that chunk's queries only.

Padding follows transformers exactly: the same ``-1e10`` additive mask (a padded query row sees nothing
and averages its window, as in transformers), the same block ids and orphan tokens. The bias passes
from layer 0 (which owns the tables) to the other layers as a :class:`BlockBias`. A call with
``output_attentions`` or under another attention implementation (``set_attn_implementation("eager")``)
runs transformers' own ``forward`` for that call. ``LongT5EncoderModel`` and every head are accepted.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..encodings.buckets import relative_position_bucket
from ._attention import NAME, _check_checkpointed_gradient
from ._family import Family, register
from ._t5like import switch_stale_configs, t5_like_family

__all__ = ["BlockBias", "FAMILY", "local_bias"]

#: transformers' (and Flaxformer's) additive mask value for LongT5's blocked attention
_MASKED = -1e10
#: mask elements (B * c * H * block_len * keys) per chunk of blocks: bounds a chunk's mask and SDPA
#: workspace at 16 MiB in fp32 while keeping each SDPA call large enough that its per-call cost is
#: small (LongT5 at L = 8192, block_len 128, 8 heads: 16 blocks per chunk for B = 1)
_CHUNK_ELEMENTS = 1 << 22

_LOCAL_CLASSES = ("LongT5LocalAttention", "LongT5TransientGlobalAttention")
_LOCAL_ATTRIBUTES = ("q", "k", "v", "o", "n_heads", "key_value_proj_dim", "block_len", "dropout", "is_decoder",
                     "has_relative_attention_bias", "relative_attention_num_buckets", "relative_attention_max_distance")
_GLOBAL_ATTRIBUTES = ("global_block_size", "global_input_layer_norm")
_HELPERS = ("_get_local_attention_mask", "_make_global_fixed_block_ids")

_DECODER = t5_like_family(
    "longt5",
    "LongT5",
    ("longt5",),
    ("LongT5Attention",),
    bidirectional=lambda module: not module.is_decoder,
    extra_attributes=("is_decoder",),
)


@dataclass(frozen=True)
class BlockBias:
    """What layer 0 of a LongT5 encoder hands the other layers (transformers hands them a dense block tensor).

    Attributes:
        local: ``(H, block_len, 3 * block_len)``: layer 0's T5 bias per (query, key) of a block's window.
        side_table: layer 0's ``global_relative_attention_bias`` weight ``(num_buckets, H)`` (transient-global),
            else ``None``.
        table: layer 0's ``relative_attention_bias`` weight, to check that gradients still reach it in the layers
            it is handed to (a reentrant gradient checkpoint would cut them).
    """

    local: torch.Tensor
    side_table: torch.Tensor | None = None
    table: torch.Tensor | None = None

    @property
    def values(self) -> torch.Tensor:
        """The tensor derived from ``table`` (what the checkpoint check reads)."""
        return self.local


def _buckets(module: nn.Module, relative: torch.Tensor) -> torch.Tensor:
    return relative_position_bucket(
        relative, bidirectional=not module.is_decoder, num_buckets=module.relative_attention_num_buckets,
        max_distance=module.relative_attention_max_distance,
    )


def local_bias(module: nn.Module) -> torch.Tensor:
    """``(H, bl, 3 bl)``: the module's T5 bias over a block's window (transformers' ``compute_bias(block_len)``).

    The window's keys are the previous, own and next block: ``key - query`` from ``-2 bl + 1`` to ``2 bl - 1``.
    """
    bl = module.block_len
    relative = _window_offsets(bl, module.q.weight.device)  # (bl, 3 bl)
    if not module.has_relative_attention_bias:  # a layer without a table that got no bias: transformers uses zeros
        return module.q.weight.new_zeros(module.n_heads, bl, 3 * bl)
    return F.embedding(_buckets(module, relative), module.relative_attention_bias.weight).permute(2, 0, 1)  # (H, bl, 3 bl)


def _window_offsets(bl: int, device) -> torch.Tensor:
    """``(bl, 3 bl)``: ``key - query`` for each query of a block and each key of its window."""
    positions = torch.arange(3 * bl, device=device)
    return positions[None, :] - positions[bl:-bl, None]  # (bl, 3 bl)


def _heads(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(B, n, D)`` -> ``(B, n, H, d)``."""
    return x.view(x.shape[0], x.shape[1], module.n_heads, module.key_value_proj_dim)


def _pad_blocks(x: torch.Tensor, bl: int, blocks: int, halo: int) -> torch.Tensor:
    """Zeros before (``halo`` rows) and after ``x`` (B, L, ...) so it holds ``halo + blocks * bl + halo`` rows."""
    after = blocks * bl - x.shape[1] + halo
    pad = [0, 0] * (x.dim() - 2) + [halo, after]
    return F.pad(x, pad)


def _global_inputs(module: nn.Module, hidden: torch.Tensor, block_ids: torch.Tensor, globals_: int) -> torch.Tensor:
    """``(B, G, D)``: per example, the sum of each fixed block's hidden states (padding left out), layer-normed."""
    batch, _, width = hidden.shape
    index = block_ids.long().masked_fill(block_ids < 0, globals_)  # (B, L): padding into a dropped slot
    sums = hidden.new_zeros(batch, globals_ + 1, width).scatter_add(1, index[..., None].expand(-1, -1, width), hidden)
    return module.global_input_layer_norm(sums[:, :globals_])  # (B, G, D)


def _side_mask(module, bias: BlockBias, ids: torch.Tensor, real: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """``(B, H, n, G)`` for ``n`` queries: the global tokens' bucketed bias plus transformers' segment mask."""
    globals_ = segments.shape[-1]
    relative = torch.arange(globals_, device=ids.device) - ids[..., None].long()  # (B, n, G)
    side = F.embedding(_buckets(module, relative), bias.side_table).permute(0, 3, 1, 2)  # (B, H, n, G)
    allowed = real[..., None] == segments[:, None, :]  # (B, n, G)
    return side + torch.where(allowed, 0.0, _MASKED)[:, None].to(side.dtype)  # (B, H, n, G)


def _attend_blocks(module, hidden: torch.Tensor, mask, bias: BlockBias) -> torch.Tensor:
    """LongT5's local (and transient-global) attention of ``hidden`` (B, L, D), chunk by chunk: (B, L, H * d)."""
    batch, length, _ = hidden.shape
    bl, heads = module.block_len, module.n_heads
    blocks = -(-length // bl)
    helpers = _transformers_helpers()
    transient = bias.side_table is not None
    if transient:
        attention_mask = mask if mask is not None else torch.ones(batch, length, device=hidden.device)
        block_ids, segments = helpers["_make_global_fixed_block_ids"](attention_mask, module.global_block_size)
        globals_ = segments.shape[-1]
        global_inputs = _global_inputs(module, hidden, block_ids, globals_)  # (B, G, D)
        side_k = _heads(module, module.k(global_inputs)).transpose(1, 2)  # (B, H, G, d)
        side_v = _heads(module, module.v(global_inputs)).transpose(1, 2)  # (B, H, G, d)
        block_ids = _pad_blocks(block_ids, bl, blocks, 0)  # (B, nb * bl)
        real = _pad_blocks(attention_mask, bl, blocks, 0)  # (B, nb * bl)
        local_mask = helpers["_get_local_attention_mask"](attention_mask, bl, hidden.device)  # (B, 1, nb, bl, 3 bl)
    else:
        globals_ = 0
        local_mask = mask  # the stack's (B, 1, nb, bl, 3 bl) boolean, or None
    locality = _window_offsets(bl, hidden.device).abs() < bl  # (bl, 3 bl): keys within local_radius
    near = (bias.local + torch.where(locality, 0.0, _MASKED)).to(hidden.dtype)  # (H, bl, 3 bl)
    raw = bias.local.to(hidden.dtype)  # (H, bl, 3 bl): where padding is masked, locality is in the mask too
    query = _pad_blocks(_heads(module, module.q(hidden)), bl, blocks, 0)  # (B, nb * bl, H, d)
    key = _pad_blocks(_heads(module, module.k(hidden)), bl, blocks, bl)  # (B, bl + nb * bl + bl, H, d)
    value = _pad_blocks(_heads(module, module.v(hidden)), bl, blocks, bl)  # (B, bl + nb * bl + bl, H, d)
    dropout = module.dropout if module.training else 0.0
    per_block = batch * heads * bl * (3 * bl + globals_)
    chunk = max(1, _CHUNK_ELEMENTS // per_block)
    outputs = []
    for start in range(0, blocks, chunk):
        stop = min(blocks, start + chunk)
        c = stop - start
        q = query[:, start * bl : stop * bl].reshape(batch, c, bl, heads, -1).permute(0, 1, 3, 2, 4)  # (B, c, H, bl, d)
        k = key[:, start * bl : (stop + 2) * bl].unfold(1, 3 * bl, bl).permute(0, 1, 2, 4, 3)  # (B, c, H, 3 bl, d)
        v = value[:, start * bl : (stop + 2) * bl].unfold(1, 3 * bl, bl).permute(0, 1, 2, 4, 3)  # (B, c, H, 3 bl, d)
        if local_mask is None:
            m = locality.expand(batch, 1, c, bl, 3 * bl)
        else:
            m = local_mask[:, :, start:stop]  # (B, 1, c, bl, 3 bl)
        if torch.equal(m, locality.expand_as(m)):  # no padding and no sequence end here: one broadcast bias
            attn_mask = near.expand(batch, c, heads, bl, 3 * bl)  # (B, c, H, bl, 3 bl), stride 0 over B, c
        else:
            attn_mask = raw + torch.where(m.transpose(1, 2), 0.0, _MASKED).to(raw.dtype)  # (B, c, H, bl, 3 bl)
        if transient and globals_:  # (a sequence shorter than global_block_size has no global token)
            rows = slice(start * bl, stop * bl)
            side = _side_mask(module, bias, block_ids[:, rows], real[:, rows], segments)  # (B, H, c bl, G)
            side = side.reshape(batch, heads, c, bl, globals_).transpose(1, 2).to(near.dtype)  # (B, c, H, bl, G)
            attn_mask = torch.cat([attn_mask, side], dim=-1)  # (B, c, H, bl, 3 bl + G)
            k = torch.cat([k, side_k[:, None].expand(batch, c, heads, globals_, -1)], dim=3)  # (B, c, H, 3 bl + G, d)
            v = torch.cat([v, side_v[:, None].expand(batch, c, heads, globals_, -1)], dim=3)  # (B, c, H, 3 bl + G, d)
        out = F.scaled_dot_product_attention(
            q.reshape(batch * c, heads, bl, -1), k.reshape(batch * c, heads, k.shape[3], -1),
            v.reshape(batch * c, heads, v.shape[3], -1), attn_mask=attn_mask.reshape(batch * c, heads, bl, -1),
            dropout_p=dropout, scale=1.0,
        )  # (B c, H, bl, d)
        outputs.append(out.view(batch, c, heads, bl, -1).permute(0, 1, 3, 2, 4).reshape(batch, c * bl, -1))
    return torch.cat(outputs, dim=1)[:, :length]  # (B, L, H d)


def _transformers_helpers() -> dict:
    from transformers.models.longt5 import modeling_longt5

    return {name: getattr(modeling_longt5, name) for name in _HELPERS}


def _block_forward(self, hidden_states, mask=None, position_bias=None, output_attentions=False):
    """An instance ``forward`` for LongT5's local / transient-global attention: relpos's tiles under ``"relpos"``.

    ``self._relpos_config`` is the config of the stack holding the module (where the implementation is read,
    at every call; a deep copy of the model copies it along).
    """
    if output_attentions or self._relpos_config._attn_implementation != NAME or isinstance(position_bias, torch.Tensor):
        return type(self).forward(self, hidden_states, mask, position_bias, output_attentions)
    if position_bias is None:
        side = None
        if type(self).__name__ == _LOCAL_CLASSES[1]:
            side = self.global_relative_attention_bias.weight if self.has_relative_attention_bias else None
            if side is None:  # no table and no bias handed down: transformers' zeros
                side = torch.zeros(self.relative_attention_num_buckets, self.n_heads, device=hidden_states.device)
        table = self.relative_attention_bias.weight if self.has_relative_attention_bias else None
        position_bias = BlockBias(local_bias(self), side, table)
    _check_checkpointed_gradient(position_bias)
    out = _attend_blocks(self, hidden_states, mask, position_bias)  # (B, L, H d)
    return self.o(out), position_bias


def _check_blocks(modules: list[nn.Module]) -> None:
    """The installed transformers' blocked attention modules have what :func:`_attend_blocks` reproduces."""
    import transformers
    from transformers.models.longt5 import modeling_longt5

    for module in {type(m): m for m in modules}.values():
        needed = _LOCAL_ATTRIBUTES + (_GLOBAL_ATTRIBUTES if type(module).__name__ == _LOCAL_CLASSES[1] else ())
        missing = [a for a in needed if not hasattr(module, a)] + [h for h in _HELPERS if not hasattr(modeling_longt5, h)]
        params = tuple(inspect.signature(type(module).forward).parameters)
        if missing or params != ("self", "hidden_states", "mask", "position_bias", "output_attentions"):
            raise RuntimeError(
                f"relpos.hf.accelerate does not fit {type(module).__name__} of the installed transformers "
                f"{transformers.__version__}: it needs the attributes and helpers {missing or 'present'} and "
                f"forward(hidden_states, mask, position_bias, output_attentions) (got {params[1:]}). Upgrade "
                "transformers, or run the model unaccelerated."
            )


def _split(modules: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
    blocked = [m for m in modules if type(m).__name__ in _LOCAL_CLASSES]
    return [m for m in modules if type(m).__name__ not in _LOCAL_CLASSES], blocked


def _check(modules: list[nn.Module]) -> None:
    full, blocked = _split(modules)
    if full:
        _DECODER.check(full)
    _check_blocks(blocked)


def _apply(model: nn.Module, modules: list[nn.Module]):
    full, blocked = _split(modules)
    undo_full = _DECODER.apply(model, full)  # the implementation becomes "relpos" (read by the blocked forwards too)
    config_of = {}
    for stack in model.modules():  # each blocked module reads the implementation of the innermost stack holding it
        if hasattr(stack, "config"):
            config_of.update({m: stack.config for m in stack.modules() if type(m).__name__ in _LOCAL_CLASSES})
    undo_stale = switch_stale_configs(config_of[m] for m in blocked)  # the encoder stack's copy (transformers 5.15)
    for module in blocked:
        module._relpos_config = config_of[module]  # a plain attribute: no parameter, buffer or state_dict entry
        module.forward = types.MethodType(_block_forward, module)  # instance attribute: this model only

    def undo() -> None:
        for module in blocked:
            del module.forward  # the class's method shows through again
            del module._relpos_config
        undo_stale()
        undo_full()

    return undo


FAMILY = register(
    Family(
        name="longt5",
        title="LongT5 (local and transient-global encoders, decoder)",
        model_types=("longt5",),
        attention_classes=("LongT5Attention",) + _LOCAL_CLASSES,
        check=_check,
        apply=_apply,
        unsupported=(
            "output_attentions runs transformers' own blocked forward for that call; with attention dropout in "
            "training the encoder's tiles run SDPA's math kernel (equal in distribution, not bitwise)"
        ),
    )
)
