"""Falcon with ``alibi=True`` on relpos attention, no ``(B, H, Lq, Lk)``.

transformers' Falcon builds its ALiBi per key position as ``bfloat16(slope) * position`` rounded to
bfloat16 (``build_alibi_tensor``), then (sdpa) merges it with the causal mask into a
``(B, H, Lq, Lk)`` float mask, or (eager) adds it before the ``1/sqrt(d)`` scale. Rounded to
bfloat16, the values are no longer a function of the offset once positions pass 256, so a
per-offset ALiBi would not reproduce them. The instance ``forward`` here takes the model's own
per-key values and folds them into one extra query/key channel
(:func:`relpos.hf.alibi.per_key_channel`): exact, ``O(B H L)`` memory, and causal masking and
padding go to :func:`relpos.attention` as a causal flag and a ``(B, Lk)`` key mask. A decoding step
(a few query rows) takes the per-key values as a ``(B, H, Lq, Lk)`` term instead: as small, and no
copy of the key/value cache. On a GPU with triton a prompt takes them in the Triton kernel, added to every
tile's scores (:func:`relpos.hf.alibi.per_key_kernel`): no channel, no copy of q, k and v.
Multi-query and grouped key/value heads (``multi_query``, ``new_decoder_architecture``) are kept.
Falcon with ``alibi=False`` (rotary positions) is not an ALiBi model and is refused.
"""

from __future__ import annotations

from torch import nn

from ._family import Family, register
from .alibi import (
    PER_KEY_ROWS, PerKey, alibi_attention, cache_position, check_fits, patch_instances, per_key_channel, per_key_kernel,
)

__all__ = ["FAMILY"]

_PARAMETERS = ["self", "hidden_states", "alibi", "attention_mask", "position_ids", "layer_past", "use_cache",
               "output_attentions", "position_embeddings", "kwargs"]
_ATTRIBUTES = ("query_key_value", "dense", "attention_dropout", "num_heads", "num_kv_heads", "head_dim",
               "inv_norm_factor", "new_decoder_architecture", "layer_idx", "config", "_split_heads")


def _forward(module: nn.Module, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
             use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    """``FalconAttention.forward`` (ALiBi branch) on relpos attention: ``(output (B, L, D), weights or None)``."""
    if alibi is None:
        raise ValueError("relpos.hf (Falcon): this layer got no alibi; only Falcon configs with alibi=True are accelerated")
    batch, query_length, _ = hidden_states.shape
    kv_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
    query, key, value = module._split_heads(module.query_key_value(hidden_states))  # (B, Lq, H|Hkv, d)
    query = query.transpose(1, 2).reshape(batch, module.num_heads, query_length, module.head_dim)  # (B, H, Lq, d)
    key = key.transpose(1, 2).reshape(batch, kv_heads, query_length, module.head_dim)  # (B, Hkv, Lq, d)
    value = value.transpose(1, 2).reshape(batch, kv_heads, query_length, module.head_dim)  # (B, Hkv, Lq, d)
    position = cache_position(layer_past, module.layer_idx)  # before the update adds this call's keys
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)  # (B, Hkv, Lk, d)
    per_key = alibi.view(batch, module.num_heads, -1)  # (B, H, <= Lk): added before the 1/sqrt(d)
    bias = None
    if query_length <= PER_KEY_ROWS or per_key_kernel(query, key, value, attention_mask, position, output_attentions):
        # decoding: the per-key term as a (B, H, Lq, Lk) bias, no copy of the cache; on a GPU with triton, a prompt
        # too: the per-key term in the kernel, added to every tile's scores
        bias = PerKey(per_key, module.inv_norm_factor)
    else:  # a prompt: the per-key term folded into one extra channel, O(B H L)
        query, key, value = per_key_channel(query, key, value, per_key)  # (B, H, L, d + 1)
    out, weights = alibi_attention(
        query, key, value, bias=bias, mask=attention_mask, scale=module.inv_norm_factor,
        dropout_p=module.attention_dropout.p if module.training else 0.0, output_attentions=output_attentions,
        position=position,
    )
    context = out[..., : module.head_dim].transpose(1, 2).reshape(batch, query_length, -1)  # (B, Lq, H * d)
    return module.dense(context), weights


def _check(modules: list[nn.Module]) -> None:
    module = modules[0]
    if not getattr(getattr(module, "config", None), "alibi", False):
        raise ValueError(
            "relpos.hf.accelerate (Falcon): config.alibi=False: this Falcon uses rotary positions (RoPE), not ALiBi, "
            "and relpos accelerates Falcon only with alibi=True; run it unaccelerated (its sdpa/flash paths already "
            "serve RoPE)"
        )
    check_fits(module, "Falcon", parameters=_PARAMETERS, attributes=_ATTRIBUTES,
               children={"query_key_value", "dense", "attention_dropout"})


def _apply(model: nn.Module, modules: list[nn.Module]):
    def bind(module):
        return lambda *args, **kwargs: _forward(module, *args, **kwargs)

    return patch_instances(model, {module: bind(module) for module in modules})


FAMILY = register(
    Family(
        name="falcon",
        title="Falcon (alibi=True)",
        model_types=("falcon",),
        attention_classes=("FalconAttention",),
        check=_check,
        apply=_apply,
        unsupported="alibi=False (rotary positions: not an ALiBi model); flash-attention modules",
    )
)
