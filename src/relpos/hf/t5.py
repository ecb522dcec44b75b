"""T5, mT5 and UMT5 on relpos attention, through transformers' own extension points.

What :func:`accelerate` changes, on the given model only:

1. Its attention implementation becomes ``"relpos"``, registered in transformers'
   ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface`` (masks stay
   2-D ``(B, L)`` padding masks, as for flash attention, instead of ``(B, 1, Lq, Lk)``), and set
   with ``model.set_attn_implementation`` (every sub-model's config too).
2. Each attention module that owns a bias table gets an instance-level ``compute_bias`` that
   returns the bias in per-offset form (:class:`relpos.OffsetBias`, ``Lq + Lk - 1`` values per head,
   read from the module's own ``relative_attention_bias`` table) instead of ``(1, H, Lq, Lk)``.
   transformers passes that object on to the layers that share the bias (T5) and to the attention
   function, which hands it to :func:`relpos.attention`.

No class is modified, no parameter or buffer is added, renamed or moved: the state dict, the
parameter names, ``save_pretrained``/``from_pretrained`` and optimizers see the same model.
:func:`restore` undoes both changes (or load the model again).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch
from torch import nn

from ..attention import attention
from ..bias import OffsetBias
from ..buckets import relative_offsets, relative_position_bucket
from ._family import Family, register

__all__ = ["FAMILY", "SUPPORTED_MODEL_TYPES", "relpos_attention_forward"]

NAME = "relpos"
#: config.model_type -> the attention class of that family (all share T5Attention's interface)
SUPPORTED_MODEL_TYPES = {"t5": "T5Attention", "mt5": "MT5Attention", "umt5": "UMT5Attention"}


def _transformers():
    try:
        import transformers
        from transformers import AttentionInterface, PreTrainedModel
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(f"relpos.hf needs transformers >= 5: pip install 'relpos[hf]' ({exc})") from exc
    return transformers, AttentionInterface, AttentionMaskInterface, flash_attention_mask, PreTrainedModel


@dataclass(frozen=True)
class TableOffsets(OffsetBias):
    """An :class:`OffsetBias` that remembers the table it was read from (to check gradients reach it)."""

    table: torch.Tensor | None = None


def _compute_offsets(self, query_length, key_length, device=None, past_seen_tokens=0) -> OffsetBias:
    """``compute_bias`` in per-offset form: the same values as transformers', ``Lq + Lk - 1`` per head."""
    table = self.relative_attention_bias.weight  # (num_buckets, H)
    q_offset = int(past_seen_tokens)
    rel = relative_offsets(query_length, key_length, q_offset=q_offset, device=table.device)  # (n,)
    buckets = relative_position_bucket(
        rel,
        bidirectional=not self.is_decoder,
        num_buckets=self.relative_attention_num_buckets,
        max_distance=self.relative_attention_max_distance,
    )
    values = self.relative_attention_bias(buckets).T  # (H, n), gradients into the table
    if device is not None:
        values = values.to(device)
    return TableOffsets(values.contiguous(), query_length, key_length, q_offset, table=table)


def _key_mask(mask: torch.Tensor, key_length: int) -> torch.Tensor:
    """transformers' 2-D padding mask (B, <= Lk) as relpos's key_mask (B, Lk); a static cache's unseen tail is hidden."""
    mask = mask.bool()
    if mask.shape[-1] < key_length:
        mask = torch.nn.functional.pad(mask, (0, key_length - mask.shape[-1]), value=False)
    return mask


def relpos_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias=None,
    **kwargs,
):
    """transformers attention function: ``(B, H, L, d)`` inputs -> ``((B, Lq, H, d) output, weights or None)``."""
    bias = position_bias if isinstance(position_bias, OffsetBias) else None
    if isinstance(position_bias, torch.Tensor) and getattr(module, "has_relative_attention_bias", False):
        bias = position_bias  # a dense bias handed in from outside: correct, just not fast
    # Otherwise a tensor here is transformers' zeros placeholder of a layer without a bias (cross-attention).
    if isinstance(bias, TableOffsets) and torch.is_grad_enabled() and bias.table.requires_grad and not bias.values.requires_grad:
        raise RuntimeError(
            "relpos.hf: the per-offset bias reached this layer without its gradient, which happens under gradient "
            "checkpointing with use_reentrant=True (the table would miss the gradients of the layers that share it); "
            "use the default, model.activation_checkpointing_enable() (use_reentrant=False)"
        )
    query_length, key_length = query.shape[-2], key.shape[-2]
    causal = bool(getattr(module, "is_causal", False))  # decoder self-attention; queries are the last Lq positions
    q_offset = bias.q_offset if isinstance(bias, OffsetBias) else (key_length - query_length if causal else 0)
    masks = {}
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            masks["key_mask"] = _key_mask(attention_mask, key_length)
        else:
            masks["attn_mask"] = attention_mask
    common = dict(bias=bias, causal=causal, dropout_p=dropout, scale=scaling, q_offset=q_offset, **masks)
    if kwargs.get("output_attentions"):
        # weights requested: the eager reference, with an identity "value" so one call returns the weights
        eye = torch.eye(key_length, dtype=query.dtype, device=query.device).expand(*query.shape[:2], -1, -1)
        weights = attention(query, key, eye, backend="eager", **common)  # (B, H, Lq, Lk)
        return (weights @ value).transpose(1, 2).contiguous(), weights
    out = attention(query, key, value, **common)  # (B, H, Lq, d)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    _, AttentionInterface, AttentionMaskInterface, flash_attention_mask, _ = _transformers()
    AttentionInterface.register(NAME, relpos_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)  # 2-D (B, L) padding masks, None without padding


def _attention_modules(model: nn.Module, class_name: str) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == class_name]


def _check_fits(module: nn.Module) -> None:
    """The installed transformers' attention module has the interface this integration relies on."""
    params = list(inspect.signature(type(module).compute_bias).parameters)
    needed = ["self", "query_length", "key_length", "device", "past_seen_tokens"]
    missing = [a for a in ("relative_attention_num_buckets", "relative_attention_max_distance", "is_decoder",
                           "is_causal", "has_relative_attention_bias") if not hasattr(module, a)]
    source = inspect.getsource(type(module).forward)
    if params != needed or missing or "ALL_ATTENTION_FUNCTIONS" not in source or "position_bias" not in source:
        transformers = _transformers()[0]
        raise RuntimeError(
            f"relpos.hf.accelerate does not fit {type(module).__name__} of the installed transformers "
            f"{transformers.__version__}: it needs compute_bias{tuple(needed[1:])} (got {tuple(params[1:])}), "
            f"the attributes {missing or 'present'} and a forward that calls the attention interface with "
            "position_bias (transformers >= 5). Upgrade transformers, or run the model unaccelerated."
        )


def _apply(model: nn.Module, modules: list[nn.Module]):
    """Per-offset ``compute_bias`` on the modules that own a table, and the ``"relpos"`` attention."""
    _register()
    previous = model.config._attn_implementation
    owners = [m for m in modules if m.has_relative_attention_bias]
    for module in owners:
        module.compute_bias = types.MethodType(_compute_offsets, module)  # instance attribute: this model only

    def undo() -> None:
        for module in owners:
            del module.compute_bias  # the class's method shows through again
        model.set_attn_implementation(previous)

    model.set_attn_implementation(NAME)
    return undo


def _check(modules: list[nn.Module]) -> None:
    _check_fits(modules[0])


FAMILY = register(
    Family(
        name="t5",
        title="T5, FLAN-T5, ByT5, mT5, UMT5",
        model_types=tuple(SUPPORTED_MODEL_TYPES),
        attention_classes=tuple(SUPPORTED_MODEL_TYPES.values()),
        check=_check,
        apply=_apply,
    )
)
