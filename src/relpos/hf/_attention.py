"""The ``"relpos"`` attention implementation inside transformers, written once for every family.

:func:`register` adds two entries to transformers' registries (global, but inert: a model uses them
only when its config names ``"relpos"``):

* ``AttentionInterface["relpos"]``: :func:`relpos_attention_forward`, which hands a family's
  per-offset bias (:class:`relpos.OffsetBias`), the padding mask and the causal flag to
  :func:`relpos.attention`;
* ``AttentionMaskInterface["relpos"]``: :func:`relpos_mask`, the padding mask as a boolean
  ``(B, 1, 1, Lk)`` key mask (never ``(B, 1, Lq, Lk)``), with no data-dependent branch under
  ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backends._masks import branch_free
from ..backends.dispatch import attention
from ..core.bias import OffsetBias

__all__ = ["NAME", "OWNS_BIAS", "register", "relpos_attention_forward", "relpos_mask", "transformers_modules"]

NAME = "relpos"


def transformers_modules():
    """(transformers, AttentionInterface, AttentionMaskInterface), or an ImportError naming the extra."""
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(f"relpos.hf needs transformers >= 5.15: pip install 'relpos[hf]' ({exc})") from exc
    return transformers, AttentionInterface, AttentionMaskInterface


def relpos_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' 2-D padding mask ``(B, >= Lk)`` as a boolean key mask ``(B, 1, 1, Lk)``; None without one.

    The causal part is not in the mask: :func:`relpos_attention_forward` passes the layer's causal
    flag. Eagerly on the CPU an all-ones mask gives None (one check); under ``torch.compile`` and on a GPU
    the mask is returned as is (no data-dependent branch, no wait for the GPU).
    """
    if attention_mask is None:
        return None
    keep = attention_mask[:, -kv_length:].bool()  # (B, <= Lk)
    if not branch_free(keep) and keep.shape[1] == kv_length and bool(keep.all()):
        return None
    return keep[:, None, None, :]  # (B, 1, 1, <= Lk)


def _key_mask(mask: torch.Tensor, key_length: int) -> torch.Tensor | None:
    """A padding mask (B, <= Lk) or (B, 1, 1, <= Lk) as relpos's key_mask (B, Lk); None for any other mask.

    A mask shorter than the keys (a static cache's unseen tail) hides the missing keys.
    """
    shape = mask.shape
    if len(shape) == 4 and shape[1] == 1 and shape[2] == 1 and mask.dtype == torch.bool:
        mask = mask.view(shape[0], shape[3])  # (B, <= Lk): view, not indexing (1 us less per call)
    elif len(shape) != 2:
        return None
    mask = mask.bool()
    if mask.shape[-1] < key_length:
        mask = torch.nn.functional.pad(mask, (0, key_length - mask.shape[-1]), value=False)
    return mask  # (B, Lk)


def _is_cross_attention(module: nn.Module) -> bool:
    """A decoder's attention over the encoder (never causal, never owns a bias table)."""
    config = getattr(module, "config", None)
    return bool(getattr(config, "is_decoder", False)) and not getattr(module, "is_causal", False) and not OWNS_BIAS(module)


def OWNS_BIAS(module: nn.Module) -> bool:  # noqa: N802 - reads like the attribute it wraps
    """Whether ``module`` computes a relative bias from its own table (T5: layer 0 of a stack)."""
    return bool(getattr(module, "has_relative_attention_bias", False))


def _bias(module: nn.Module, position_bias):
    """What relpos adds to the scores: a per-offset bias, a dense tensor, or None."""
    if isinstance(position_bias, OffsetBias) or hasattr(position_bias, "attend"):
        return position_bias  # per offset, or a bias built per query tile (UDOP's layout bias)
    if isinstance(position_bias, torch.Tensor) and not _is_cross_attention(module):
        return position_bias  # a dense bias (a model switched to "relpos" without accelerate): correct, not fast
    return None  # cross-attention's zeros placeholder: adds nothing


_UNSET = object()
_collector = _UNSET  # transformers' context variable of the outputs being captured, looked up on first use


def _output_collector():
    """``transformers.utils.output_capturing._active_collector`` (found once: an import per attention call cost
    a decoding step 3% on the CPU), or None in releases without it."""
    global _collector
    if _collector is _UNSET:
        try:
            from transformers.utils.output_capturing import _active_collector as found
        except ImportError:  # pragma: no cover - other transformers releases: the flags decide
            found = None
        _collector = found
    return _collector


def recording_attentions() -> bool:
    """Whether transformers' output capture is recording attention weights right now (a sub-model such as
    Pix2Struct's vision encoder records them for its parent without ``output_attentions`` reaching it)."""
    collector = _output_collector()
    collected = None if collector is None else collector.get()
    return bool(collected) and any(key.endswith("attentions") for key in collected)


def _wants_weights(module: nn.Module, kwargs: dict) -> bool:
    """``output_attentions`` per call, else the model's config, or transformers recording the weights."""
    per_call = kwargs.get("output_attentions")
    if per_call is not None:
        return bool(per_call)
    return bool(getattr(getattr(module, "config", None), "output_attentions", False)) or recording_attentions()


def _check_checkpointed_gradient(bias) -> None:
    table = getattr(bias, "table", None)
    if table is not None and torch.is_grad_enabled() and table.requires_grad and not bias.values.requires_grad:
        raise RuntimeError(
            "relpos.hf: the per-offset bias reached this layer without its gradient, which happens under gradient "
            "checkpointing with use_reentrant=True (the table would miss the gradients of the layers that share it); "
            "use the default, model.activation_checkpointing_enable() (use_reentrant=False)"
        )


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
    bias = _bias(module, position_bias)
    if hasattr(bias, "attend"):  # a bias built per query tile: it runs its own tiles with the padding mask
        key_mask = None if attention_mask is None else _key_mask(attention_mask, key.shape[-2])
        if (attention_mask is None or key_mask is not None) and not _wants_weights(module, kwargs):
            return bias.attend(query, key, value, key_mask, dropout, scaling).transpose(1, 2).contiguous(), None
        bias = bias.dense()  # (B, H, Lq, Lk): weights requested, or a mask that is no padding mask
    _check_checkpointed_gradient(bias)
    query_length, key_length = query.shape[-2], key.shape[-2]
    causal = bool(getattr(module, "is_causal", False))  # decoder self-attention; queries are the last Lq positions
    causal = causal and not getattr(bias, "causal_folded", False)  # a static cache's bias holds its causal mask
    q_offset = bias.q_offset if isinstance(bias, OffsetBias) else (key_length - query_length if causal else 0)
    masks = {}
    if attention_mask is not None:
        key_mask = _key_mask(attention_mask, key_length)
        masks = {"key_mask": key_mask} if key_mask is not None else {"attn_mask": attention_mask}
    common = dict(bias=bias, causal=causal, dropout_p=dropout, scale=scaling, q_offset=q_offset, **masks)
    if _wants_weights(module, kwargs):
        # weights requested: the eager reference, with an identity "value" so one call returns the weights
        eye = torch.eye(key_length, dtype=query.dtype, device=query.device).expand(*query.shape[:2], -1, -1)
        weights = attention(query, key, eye, backend="eager", **common)  # (B, H, Lq, Lk)
        return (weights @ value).transpose(1, 2).contiguous(), weights
    out = attention(query, key, value, **common)  # (B, H, Lq, d)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Add ``"relpos"`` to transformers' attention and mask registries (idempotent)."""
    _, AttentionInterface, AttentionMaskInterface = transformers_modules()
    AttentionInterface.register(NAME, relpos_attention_forward)
    AttentionMaskInterface.register(NAME, relpos_mask)
