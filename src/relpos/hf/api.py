"""``accelerate`` / ``restore`` / ``is_accelerated``: the public calls, written once for every family.

Each family is an adapter in the table of :mod:`relpos.hf._family`; these functions find the
model's family, check that the installed transformers fits it (before any change), apply it, and
keep its undo on the model.
"""

from __future__ import annotations

from torch import nn

from ._family import find_family, supported_text

__all__ = ["accelerate", "is_accelerated", "restore"]

_STATE = "_relpos_accelerated"  # attribute on an accelerated model: the family's undo


def _pretrained_model_class():
    try:
        from transformers import PreTrainedModel
    except ImportError as exc:  # pragma: no cover - exercised only without transformers
        raise ImportError(f"relpos.hf needs transformers >= 5.15: pip install 'relpos[hf]' ({exc})") from exc
    return PreTrainedModel


def is_accelerated(model: nn.Module) -> bool:
    """True when :func:`accelerate` switched ``model`` (and :func:`restore` has not undone it)."""
    return hasattr(model, _STATE)


def accelerate(model: nn.Module) -> nn.Module:
    """Switch a transformers model to relpos attention, in place, and return it.

    The family is recognised by the attention modules the model holds (then by
    ``config.model_type``); every task head of a supported family is covered, since heads share the
    family's attention module. Outputs, losses and gradients equal transformers'; the bias is never
    built as ``(B, H, Lq, Lk)``. Calling it twice is a no-op. Undo with :func:`restore`.
    Unsupported models are refused with a ``TypeError`` before anything is changed.
    """
    PreTrainedModel = _pretrained_model_class()
    found = find_family(model) if isinstance(model, nn.Module) else None
    if not isinstance(model, PreTrainedModel) or found is None or not found[1]:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise TypeError(
            f"relpos.hf.accelerate supports transformers models of these families: {supported_text()}; got "
            f"{type(model).__name__}" + (f" with model_type={model_type!r}" if model_type else "")
            + (" holding none of the family's attention modules" if found else "")
        )
    if is_accelerated(model):
        return model
    family, modules = found
    family.check(modules)
    undo = family.apply(model, modules)
    setattr(model, _STATE, {"family": family.name, "undo": undo})
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`accelerate`: transformers' own attention again, every instance change removed."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not accelerated by relpos.hf.accelerate; nothing to restore")
    state["undo"]()
    delattr(model, _STATE)
    return model
