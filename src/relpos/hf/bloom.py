"""Bloom on relpos attention: causal attention with ALiBi per offset, no ``(B, H, Lq, Lk)``.

transformers' ``BloomAttention`` adds ``alibi`` per key position, counted from each example's first
real token (``attention_mask.cumsum``), with ``baddbmm(beta=1, alpha=1/sqrt(d))``, then the
``(B, 1, Lq, Lk)`` mask, softmax in fp32. Here each attention instance's ``forward`` calls
:func:`relpos.hf.alibi.alibi_attention` with :class:`relpos.ALiBi` built from Bloom's own slopes:
the same scores up to a constant per query row (see :mod:`relpos.hf.alibi`). A padding mask with
holes (not one run of real tokens per example) changes Bloom's positions; such a batch takes the
exact per-key path (:func:`~relpos.hf.alibi.per_key_channel`). Under ``torch.compile`` every batch
with a padding mask takes the per-key path: which path fits is a fact about the mask's values, a
data-dependent branch that ``fullgraph=True`` refuses; the per-key path is exact for any mask. On a GPU with
triton a long call takes Bloom's own per-key alibi in the Triton kernel instead (added to every tile's scores:
exact for any padding, no check of the mask read back, no extra channel; :func:`~relpos.hf.alibi.per_key_kernel`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..encodings.alibi import ALiBi
from ._family import Family, register
from .alibi import (
    PER_KEY_ROWS, PerKey, alibi_attention, cache_position, check_fits, contiguous, model_alibi, patch_instances,
    per_key_channel, per_key_kernel,
)

__all__ = ["FAMILY"]

_PARAMETERS = ["self", "hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache",
               "output_attentions", "kwargs"]
_ATTRIBUTES = ("query_key_value", "dense", "attention_dropout", "num_heads", "head_dim", "inv_norm_factor", "beta",
               "hidden_dropout", "pretraining_tp", "slow_but_exact", "layer_idx", "_reshape")


def _per_offset_fits(attention_mask: torch.Tensor | None) -> bool:
    """Whether Bloom's per-key ALiBi equals the per-offset one here: no 2-D mask, or one run of real keys per row
    (eagerly checked; under ``torch.compile`` a 2-D mask is not checked: the check would be a data-dependent branch,
    and the per-key path, exact for any mask, serves it)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return True
    if torch.compiler.is_compiling():
        return False
    return contiguous(attention_mask)


def _forward(module: nn.Module, alibi_bias: ALiBi, hidden_states, residual, alibi, attention_mask, layer_past=None,
             use_cache=False, output_attentions=False, **kwargs):
    """``BloomAttention.forward`` on relpos attention: ``(output (B, L, D), weights or None)``."""
    batch, query_length, _ = hidden_states.shape
    query, key, value = module._reshape(module.query_key_value(hidden_states))  # (B, H, Lq, d) each
    position = cache_position(layer_past, module.layer_idx)  # before the update adds this call's keys
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)  # (B, H, Lk, d)
    dropout_p = module.attention_dropout.p if module.training else 0.0
    scale = module.inv_norm_factor
    few_rows = query_length <= PER_KEY_ROWS  # a decoding step
    in_kernel = per_key_kernel(query, key, value, attention_mask, position, output_attentions)
    if few_rows or in_kernel or _per_offset_fits(attention_mask):
        # Bloom's scores: inv_norm_factor * q.k + beta * alibi (baddbmm); a few rows, and long ones on a GPU (in the
        # Triton kernel, per key: any padding, nothing read back), take its own alibi as it is
        own = few_rows or in_kernel
        bias = PerKey(alibi.view(batch, module.num_heads, -1), module.beta) if own else alibi_bias
        out, weights = alibi_attention(query, key, value, bias=bias, mask=attention_mask, scale=scale,
                                       dropout_p=dropout_p, output_attentions=output_attentions, position=position)
    else:  # holes in the padding (or compiled): Bloom's positions skip holes; its own per-key values in a channel
        per_key = alibi.view(batch, module.num_heads, -1).float() * (module.beta / scale)  # (B, H, Lk)
        query, key, value = per_key_channel(query, key, value, per_key)  # (B, H, L, d + 1)
        out, weights = alibi_attention(query, key, value, bias=None, mask=attention_mask, scale=scale,
                                       dropout_p=dropout_p, output_attentions=output_attentions, position=position)
        out = out[..., : module.head_dim]  # (B, H, Lq, d): the extra channel dropped
    context = out.transpose(1, 2).reshape(batch, query_length, -1)  # (B, Lq, H * d)
    dropout_add = sys.modules[type(module).__module__].dropout_add
    output = dropout_add(module.dense(context), residual, module.hidden_dropout, module.training)  # (B, Lq, D)
    return output, weights


def _slopes(module: nn.Module) -> list[float]:
    """Bloom's fp32 slopes, exactly: its ``build_alibi_tensor`` at position 1 of an all-real mask is ``slope * 1``.

    ``build_alibi_tensor`` exists in every transformers release relpos supports; the private helper it
    calls in newer ones (``_get_alibi_slopes``) does not exist in 5.17."""
    build = sys.modules[type(module).__module__].build_alibi_tensor
    alibi = build(torch.ones(1, 2, device="cpu"), module.num_heads, torch.float32)  # (H, 1, 2): slopes * [0, 1]
    return alibi[:, 0, 1].tolist()


def _check(modules: list[nn.Module]) -> None:
    check_fits(modules[0], "Bloom", parameters=_PARAMETERS, attributes=_ATTRIBUTES,
               children={"query_key_value", "dense", "attention_dropout"},
               helpers=("dropout_add", "build_alibi_tensor"))
    module = modules[0]
    if module.pretraining_tp > 1 and module.slow_but_exact:
        raise ValueError(
            f"relpos.hf.accelerate (Bloom): config.slow_but_exact=True with pretraining_tp={module.pretraining_tp} "
            "(an output projection summed in slices) is not supported; set model.config.slow_but_exact=False "
            "(the default) before loading, or run the model unaccelerated"
        )


def _apply(model: nn.Module, modules: list[nn.Module]):
    bias = model_alibi(modules[0].num_heads, _slopes(modules[0]))  # one per model, shared by its layers

    def bind(module):
        return lambda *args, **kwargs: _forward(module, bias, *args, **kwargs)

    return patch_instances(model, {module: bind(module) for module in modules})


FAMILY = register(
    Family(
        name="bloom",
        title="Bloom",
        model_types=("bloom",),
        attention_classes=("BloomAttention",),
        check=_check,
        apply=_apply,
        unsupported="slow_but_exact=True with pretraining_tp > 1",
    )
)
