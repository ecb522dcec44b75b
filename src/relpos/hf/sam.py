"""transformers' SAM, SAM-HQ and ViTDet image encoders on relpos's decomposed relative positions.

Their vision attention modules (``SamVisionAttention`` / ``SamVisionSdpaAttention``, the SAM-HQ
twins, ``VitDetAttention``) add MViTv2's decomposed relative positions as a dense
``(B, H, N, N)`` tensor, in the global layers (the whole patch grid) and the windowed ones (14 x 14
windows) alike. :func:`relpos.hf.accelerate` replaces the ``forward`` of each such *instance*
(never the class) by one that computes the same ``qkv``, the two ``(B, H, N, S)`` terms from the
same ``rel_pos_h`` / ``rel_pos_w`` (resized as SAM does), and :func:`relpos.encodings.decomposed.decomposed_attention`
(CPU: query tiles on SDPA's flash kernel; elsewhere: the fold into one SDPA call). The mask decoder,
prompt encoder and necks are left as they are. Undo restores the instances' own ``forward``.

Attention weights (a module called with ``output_attentions=True``, as ViTDet's layers do) are
computed by transformers' own forward (they are the dense tensor). SAM's eager module applies
``attention_dropout`` in training, as relpos does then (through SDPA's dropout, the math kernel
on CPU); SAM's sdpa module never does, nor does relpos then. Layers without relative positions
(``use_rel_pos=False``; ViTDet's default) run SDPA with no bias.
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..encodings.decomposed import decomposed_attention, decomposed_terms
from ._attention import recording_attentions
from ._family import Family, register

__all__ = ["ATTENTION_CLASSES", "FAMILY", "MODEL_TYPES"]

#: attention class -> (heads attribute, rel-pos switch attribute, applies dropout in training)
ATTENTION_CLASSES = {
    "SamVisionAttention": ("num_attention_heads", "use_rel_pos", True),
    "SamVisionSdpaAttention": ("num_attention_heads", "use_rel_pos", False),
    "SamHQVisionAttention": ("num_attention_heads", "use_rel_pos", True),
    "SamHQVisionSdpaAttention": ("num_attention_heads", "use_rel_pos", False),
    "VitDetAttention": ("num_heads", "use_relative_position_embeddings", False),
}
MODEL_TYPES = ("sam", "sam_vision_model", "sam_hq", "sam_hq_vision_model", "vitdet")


def _attend(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``(B, Hh, Ww, C)`` -> ``(B, Hh, Ww, C)``: qkv, decomposed relative positions, attention, projection."""
    heads_attr, rel_attr, uses_dropout = ATTENTION_CLASSES[type(module).__name__]
    batch, height, width, _ = hidden_states.shape
    heads = getattr(module, heads_attr)
    qkv = module.qkv(hidden_states).reshape(batch, height * width, 3, heads, -1).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
    query, key, value = qkv.unbind(0)  # (B, H, N, d) each
    dropout = float(module.dropout) if uses_dropout and module.training else 0.0
    if getattr(module, rel_attr):
        rel_h, rel_w = decomposed_terms(query, module.rel_pos_h, module.rel_pos_w, (height, width))  # (B, H, N, Hh), (B, H, N, Ww)
        out = decomposed_attention(query, key, value, rel_h, rel_w, scale=module.scale, dropout_p=dropout)  # (B, H, N, d)
    else:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=module.scale)  # (B, H, N, d)
    out = out.permute(0, 2, 1, 3).reshape(batch, height, width, -1)  # (B, Hh, Ww, C)
    return module.proj(out)


def _sam_forward(self, hidden_states: torch.Tensor, output_attentions=None):
    if output_attentions or recording_attentions():  # SAM's layers never pass the flag: transformers records the weights
        return type(self).forward(self, hidden_states, True)
    return _attend(self, hidden_states), None


def _vitdet_forward(self, hidden_state: torch.Tensor, output_attentions=False):
    if output_attentions or recording_attentions():
        return type(self).forward(self, hidden_state, output_attentions)
    return (_attend(self, hidden_state),)


def _check(modules: list[nn.Module]) -> None:
    """Every module has the attributes, and its class the forward, this adapter reproduces (before any change)."""
    sources = {cls: inspect.getsource(cls.forward) for cls in {type(m) for m in modules}}
    for module in modules:
        heads_attr, rel_attr, uses_dropout = ATTENTION_CLASSES[type(module).__name__]
        needed = ["qkv", "proj", "scale", heads_attr, rel_attr] + (["dropout"] if uses_dropout else [])
        if getattr(module, rel_attr, False):
            needed += ["rel_pos_h", "rel_pos_w"]
        missing = [a for a in needed if not hasattr(module, a)]
        source = sources[type(module)]
        if missing or "self.qkv" not in source or "decomposed" not in source:
            import transformers

            raise RuntimeError(
                f"relpos.hf.accelerate does not fit {type(module).__name__} of the installed transformers "
                f"{transformers.__version__}: it needs the attributes {needed} (missing {missing}) and a forward that "
                "adds decomposed relative positions to a qkv attention. Run the model unaccelerated, or use the "
                "transformers version relpos is tested with (>= 5.15, < 5.25)."
            )


def _apply(model: nn.Module, modules: list[nn.Module]):
    """Replace ``forward`` on each attention instance; the undo puts back what the instance had."""
    previous = []
    for module in modules:
        previous.append((module, module.__dict__.get("forward")))
        fn = _vitdet_forward if type(module).__name__ == "VitDetAttention" else _sam_forward
        module.forward = types.MethodType(fn, module)  # instance attribute: this model only

    def undo() -> None:
        for module, own in previous:
            if own is None:
                del module.forward  # the class's method shows through again
            else:
                module.forward = own

    return undo


FAMILY = register(
    Family(
        name="sam",
        title="SAM, SAM-HQ, ViTDet (image encoder)",
        model_types=MODEL_TYPES,
        attention_classes=tuple(ATTENTION_CLASSES),
        check=_check,
        apply=_apply,
        unsupported="attention weights (output_attentions) run transformers' own dense forward; "
        "dropout in training on CPU runs SDPA's math kernel",
    )
)
