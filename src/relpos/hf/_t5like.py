"""The adapter shared by families whose attention module is transformers' T5Attention under another name.

T5, mT5, UMT5, SwitchTransformers, Pop2Piano, Pix2Struct's text decoder, UDOP and LongT5's
full-attention decoder all build their bias with ``compute_bias(query_length, key_length, device,
past_seen_tokens)`` from a ``relative_attention_bias`` table of T5 buckets and call transformers'
attention interface with ``position_bias``. :func:`t5_like_family` makes the :class:`Family` for
such a set of classes; what differs is only whether the buckets are bidirectional.

What ``apply`` changes, on the given model only:

1. its attention implementation becomes ``"relpos"`` (:mod:`relpos.hf._attention`), set with
   transformers' own ``model.set_attn_implementation`` (every sub-model's config too);
2. each module that owns a table gets an instance-level ``compute_bias`` that, while the model's
   implementation is ``"relpos"`` (read from the config at every call), returns the bias per offset
   (``Lq + Lk - 1`` values per head, :class:`relpos.OffsetBias`) instead of ``(1, H, Lq, Lk)``;
   under any other implementation (``model.set_attn_implementation("eager" | "sdpa")``) it returns
   transformers' own dense bias, so switching back and forth with transformers' call works.

A static cache (``cache_implementation="static"``) hands ``compute_bias`` its length as a 0-d tensor
and the keys as the whole preallocated cache. The bias is then a :class:`PositionedOffsets`: the
offsets are shifted by that tensor (index arithmetic, no Python number read from it) and every key in a
query's future, the cache's unseen tail included, is ``-inf`` in the values; shapes depend only on the
cache size, so a compiled decoding step is traced once and never recompiled per step.

No class is modified, no parameter or buffer is added, renamed or moved. The returned undo removes
the instance methods and restores the previous implementation.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Callable

import torch
from torch import nn

from ..core.offsets import offset_range
from ..encodings.buckets import buckets_at, offset_buckets
from ._attention import NAME, OWNS_BIAS, register, transformers_modules
from ._positioned import PositionedOffsets, TableOffsets, positioned_offsets
from ._family import Family

__all__ = ["PositionedOffsets", "TableOffsets", "switch_stale_configs", "t5_like_family"]

#: attributes every T5-like attention module must have
_ATTRIBUTES = ("config", "relative_attention_num_buckets", "relative_attention_max_distance", "is_causal",
               "has_relative_attention_bias")
_COMPUTE_BIAS = ("self", "query_length", "key_length", "device", "past_seen_tokens")


def _bucket_values(module: nn.Module, rel: torch.Tensor, bidirectional: bool) -> torch.Tensor:
    """(H, n): the module's table at the (n,) offsets ``rel`` (a tensor: a static cache's), gradients into the table."""
    buckets = buckets_at(
        rel,
        bidirectional=bidirectional,
        num_buckets=module.relative_attention_num_buckets,
        max_distance=module.relative_attention_max_distance,
    )
    return module.relative_attention_bias(buckets).T  # (H, n)


def _offsets(module: nn.Module, query_length: int, key_length: int, past_seen_tokens, bidirectional: bool) -> TableOffsets:
    """The module's bias per offset: the same values as its ``compute_bias``, ``Lq + Lk - 1`` per head."""
    table = module.relative_attention_bias.weight  # (num_buckets, H)
    if isinstance(past_seen_tokens, torch.Tensor):  # a static cache: its length stays a tensor
        return _positioned_offsets(module, query_length, key_length, past_seen_tokens, bidirectional)
    q_offset = int(past_seen_tokens)
    if key_length > q_offset + query_length and not getattr(module, "is_causal", False):
        # a fresh static cache (keys past the tokens seen) in a layer not flagged causal (transformers 5.15's
        # UMT5 decoder): its unseen tail hidden in the values, as transformers' static-cache mask hides it
        return _positioned_offsets(module, query_length, key_length, q_offset, bidirectional)
    buckets = offset_buckets(  # (n,): a view of kept buckets (a decoding step's offsets are new every step)
        *offset_range(query_length, key_length, q_offset), bidirectional=bidirectional,
        num_buckets=module.relative_attention_num_buckets, max_distance=module.relative_attention_max_distance,
        device=table.device,
    )
    values = module.relative_attention_bias(buckets).T  # (H, n), gradients into the table
    return TableOffsets(values.contiguous(), query_length, key_length, q_offset, table=table)


def _positioned_offsets(
    module: nn.Module, query_length: int, key_length: int, position: torch.Tensor | int, bidirectional: bool
) -> PositionedOffsets:
    """:class:`PositionedOffsets` for queries at ``position .. position + Lq - 1`` of ``key_length`` cache keys.

    With a cache the queries are its newest tokens: a key after a query's position is its future or not
    yet written, hidden either way (transformers' static-cache mask hides them too, in every release).
    """
    table = module.relative_attention_bias.weight  # (num_buckets, H)
    return positioned_offsets(lambda rel: _bucket_values(module, rel, bidirectional), query_length, key_length,
                              position, device=table.device, table=table)


def _instance_compute_bias(bidirectional: Callable[[nn.Module], bool]):
    """``compute_bias`` for one instance: per offset under ``"relpos"``, the class's dense one otherwise."""

    def compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
        if self.config._attn_implementation != NAME:  # switched with set_attn_implementation: transformers' own
            return type(self).compute_bias(self, query_length, key_length, device, past_seen_tokens)
        offsets = _offsets(self, query_length, key_length, past_seen_tokens, bidirectional(self))
        if device is not None and offsets.values.device != torch.device(device):
            offsets = dataclasses.replace(offsets, values=offsets.values.to(device))
        return offsets

    return compute_bias


def _check_fits(module: nn.Module, extra_attributes: tuple[str, ...]) -> None:
    """The installed transformers' attention module has the interface this adapter relies on."""
    params = tuple(inspect.signature(type(module).compute_bias).parameters)
    missing = [a for a in _ATTRIBUTES + extra_attributes if not hasattr(module, a)]
    source = inspect.getsource(type(module).forward)
    if params != _COMPUTE_BIAS or missing or "ALL_ATTENTION_FUNCTIONS" not in source or "position_bias" not in source:
        transformers = transformers_modules()[0]
        raise RuntimeError(
            f"relpos.hf.accelerate does not fit {type(module).__name__} of the installed transformers "
            f"{transformers.__version__}: it needs compute_bias{_COMPUTE_BIAS[1:]} (got {params[1:]}), "
            f"the attributes {missing or 'present'} and a forward that calls the attention interface with "
            "position_bias (transformers >= 5.15; 5.14 and older compute the bias from cache_position). "
            "Upgrade transformers, or run the model unaccelerated."
        )


def switch_stale_configs(configs) -> Callable[[], None]:
    """Set relpos's implementation on each of ``configs`` that ``set_attn_implementation`` missed; returns the undo.

    transformers 5.15's T5 stacks hold deep copies of the model's config that its ``set_attn_implementation``
    does not update (5.23 and later update them): without this, accelerating would silently change nothing.
    """
    unique = {id(c): c for c in configs}.values()
    stale = [(c, c._attn_implementation) for c in unique if c._attn_implementation != NAME]
    for config, _ in stale:
        config._attn_implementation = NAME

    def undo() -> None:
        for config, name in stale:
            config._attn_implementation = name

    return undo


def t5_like_family(
    name: str,
    title: str,
    model_types: tuple[str, ...],
    attention_classes: tuple[str, ...],
    *,
    bidirectional: Callable[[nn.Module], bool],
    extra_attributes: tuple[str, ...] = (),
    sub_config: str | None = None,
    unsupported: str = "",
) -> Family:
    """A :class:`Family` for T5-like attention classes; ``bidirectional(module)`` says how its buckets run.

    ``sub_config``: in a composite model, only this sub-config (and its sub-models) switches to relpos
    (Pix2Struct: ``"text_config"``; its vision encoder has no relative bias and keeps its implementation).
    """

    def check(modules: list[nn.Module]) -> None:
        for module in {type(m): m for m in modules}.values():  # one instance per class
            _check_fits(module, extra_attributes)

    def apply(model: nn.Module, modules: list[nn.Module]):
        register()
        config = model.config
        subs = getattr(config, "sub_configs", {})
        previous = config._attn_implementation  # undo restores the model and each sub-config as they were
        if subs:
            previous = {"": previous, **{key: getattr(config, key)._attn_implementation for key in subs}}
        target = {sub_config: NAME} if sub_config in subs else NAME
        model.set_attn_implementation(target)  # first: transformers may refuse it, and nothing is changed yet
        undo_stale = switch_stale_configs(m.config for m in modules)  # copies the switch did not reach
        owners = [m for m in modules if OWNS_BIAS(m)]
        compute_bias = _instance_compute_bias(bidirectional)
        for module in owners:
            module.compute_bias = types.MethodType(compute_bias, module)  # instance attribute: this model only

        def undo() -> None:
            for module in owners:
                del module.compute_bias  # the class's method shows through again
            model.set_attn_implementation(previous)
            undo_stale()

        return undo

    return Family(name, title, model_types, attention_classes, check=check, apply=apply, unsupported=unsupported)
