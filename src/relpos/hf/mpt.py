"""MPT on relpos attention: causal attention with ALiBi per offset, no ``(B, H, Lq, Lk)``.

transformers' ``MptAttention`` adds ``build_mpt_alibi_tensor`` (per key position, slopes
``2**(-8k/H')`` with ``alibi_bias_max=8``), masks with the dtype's minimum, softmax in fp32, and
scales by ``softmax_scale``; ``clip_qkv`` clamps the fused projection. The instance ``forward``
here does the same on :func:`relpos.hf.alibi.alibi_attention` with :class:`relpos.ALiBi` built from
MPT's own slopes. Options transformers' MPT ignores (``qk_ln``, ``attn_type``, ``prefix_lm``,
``attn_impl``) are ignored alike: the accelerated model equals transformers' model.

Attention weights: transformers' ``MptAttention`` always computes them, and ``MptBlock`` gets
``output_attentions`` (per call, else the config's, resolved by ``MptModel``) but never passes it
down. A forward pre-hook on each ``MptBlock`` instance records the flag for the block's attention
(:func:`_record_flags`), so the accelerated MPT returns every layer's weights when transformers'
does, per call or from ``config.output_attentions``; a layer called without the hook (directly)
reads the config.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from ..encodings.alibi import ALiBi
from ._family import Family, register
from .alibi import alibi_attention, cache_position, check_fits, model_alibi, patch_instances

__all__ = ["FAMILY"]

#: MptAttention.forward's parameters: transformers <= 5.23 names the cache past_key_values, 5.24 cache
_PARAMETERS = (["self", "hidden_states", "position_bias", "past_key_values", "attention_mask", "kwargs"],
               ["self", "hidden_states", "position_bias", "cache", "attention_mask", "kwargs"])
_ATTRIBUTES = ("Wqkv", "out_proj", "n_heads", "head_dim", "softmax_scale", "attn_dropout_p", "clip_qkv", "layer_idx")


def _forward(module: nn.Module, alibi_bias: ALiBi, wants: Callable[[], bool], hidden_states, position_bias,
             past_key_values=None, attention_mask=None, cache=None, **kwargs):
    """``MptAttention.forward`` on relpos attention: ``(output (B, L, D), weights or None)``.

    The cache comes as ``past_key_values`` (transformers <= 5.23, the third positional) or ``cache`` (5.24).
    ``wants()``: whether the block asked for the weights (``MptBlock`` passes no flag to its attention).
    """
    past_key_values = cache if past_key_values is None else past_key_values
    batch, query_length = hidden_states.shape[:2]
    qkv = module.Wqkv(hidden_states)  # (B, Lq, 3 * D)
    if module.clip_qkv:
        qkv = qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    heads = (t.reshape(batch, query_length, module.n_heads, module.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    query, key, value = heads  # (B, H, Lq, d) each
    position = cache_position(past_key_values, module.layer_idx)  # before the update adds this call's keys
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)  # (B, H, Lk, d)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = ~attention_mask.bool()  # MPT masks where True; relpos attends where True
    out, weights = alibi_attention(
        query, key, value, bias=alibi_bias if position_bias is not None else None, mask=attention_mask,
        scale=module.softmax_scale, dropout_p=module.attn_dropout_p if module.training else 0.0,
        output_attentions=bool(kwargs.get("output_attentions", wants())),
        scores_learn=False,  # MPT masks with masked_fill
        position=position,
    )
    context = out.transpose(1, 2).reshape(batch, query_length, -1)  # (B, Lq, H * d)
    return module.out_proj(context), weights


def _slopes(module: nn.Module) -> list[float]:
    """MPT's slopes, read from its own builder: the bias of key 0 relative to key 1 is ``-m``."""
    build = sys.modules[type(module).__module__].build_mpt_alibi_tensor
    return (-build(module.n_heads, 2, device=torch.device("cpu"))[:, 0, 0]).tolist()  # (H,)


def _check(modules: list[nn.Module]) -> None:
    check_fits(modules[0], "MPT", parameters=_PARAMETERS, attributes=_ATTRIBUTES, children={"Wqkv", "out_proj"},
               helpers=("build_mpt_alibi_tensor",))


def _record_flags(model: nn.Module, modules: list[nn.Module]) -> tuple[Callable[[], bool], Callable[[], None]]:
    """A pre-hook on each block holding one of ``modules`` records the ``output_attentions`` it gets; returns
    ``(wants, remove)``: the last recorded flag (the config's before any block ran), and the hooks' undo."""
    flag: list[bool | None] = [None]  # one per model: blocks run one after another, each before its attention

    def record(block, args, kwargs):
        flag[0] = bool(kwargs.get("output_attentions", model.config.output_attentions))

    attentions = {id(m) for m in modules}
    blocks = [m for m in model.modules() if id(getattr(m, "attn", None)) in attentions]
    handles = [block.register_forward_pre_hook(record, with_kwargs=True) for block in blocks]

    def wants() -> bool:
        return bool(model.config.output_attentions) if flag[0] is None else flag[0]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return wants, remove


def _apply(model: nn.Module, modules: list[nn.Module]):
    bias = model_alibi(modules[0].n_heads, _slopes(modules[0]))
    wants, remove_hooks = _record_flags(model, modules)

    def bind(module):
        return lambda *args, **kwargs: _forward(module, bias, wants, *args, **kwargs)

    undo_instances = patch_instances(model, {module: bind(module) for module in modules})

    def undo() -> None:
        remove_hooks()
        undo_instances()

    return undo


FAMILY = register(
    Family(
        name="mpt",
        title="MPT",
        model_types=("mpt",),
        attention_classes=("MptAttention",),
        check=_check,
        apply=_apply,
        unsupported="static-cache generation (transformers' MPT has none)",
    )
)
