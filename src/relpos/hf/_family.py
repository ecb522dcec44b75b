"""One seam for every transformers family: a table from family to a small adapter.

An adapter (:class:`Family`) says which attention modules identify its models, checks that the
installed transformers has the interface it relies on (before anything is changed), and applies
its changes to one model's *instances* only, returning the function that undoes them.
:func:`relpos.hf.accelerate` reads this table; nothing else knows the families.

A family module registers itself with :func:`register` when :mod:`relpos.hf` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

__all__ = ["Family", "FAMILIES", "register", "find_family", "supported_text"]

#: what an adapter's ``apply`` returns: a function that undoes every change it made
Undo = Callable[[], None]


@dataclass(frozen=True)
class Family:
    """How relpos accelerates one transformers family.

    Attributes:
        name: short key (``"t5"``, ``"bloom"``).
        title: the models it covers, for messages and docs (``"T5, mT5, UMT5"``).
        model_types: ``config.model_type`` values of the family (a fallback: modules decide).
        attention_classes: class names of the attention modules that identify the family; a model
            holding any of them belongs to it, whatever its ``config.model_type`` says.
        check: ``check(modules)`` raises ``RuntimeError`` naming what does not fit in the installed
            transformers (called before any change).
        apply: ``apply(model, modules) -> undo``: changes instances only (never classes).
        unsupported: what the adapter does not support, and why (docs and error messages).
    """

    name: str
    title: str
    model_types: tuple[str, ...]
    attention_classes: tuple[str, ...]
    check: Callable[[list[nn.Module]], None]
    apply: Callable[[nn.Module, list[nn.Module]], Undo]
    unsupported: str = ""


#: every registered family, by name, in registration order
FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to the table (a second registration under one name replaces the first)."""
    FAMILIES[family.name] = family
    return family


def _modules_of(model: nn.Module, family: Family) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in family.attention_classes]


def find_family(model: nn.Module) -> tuple[Family, list[nn.Module]] | None:
    """The family of ``model`` and its attention modules, recognised by the modules it holds.

    A model that holds none of the families' attention modules is matched by ``config.model_type``
    (then with no modules, which ``accelerate`` refuses); ``None`` when nothing matches.
    """
    for family in FAMILIES.values():
        modules = _modules_of(model, family)
        if modules:
            return family, modules
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family, []
    return None


def supported_text() -> str:
    """One line per family: what ``accelerate`` supports (for error messages)."""
    return "; ".join(f"{f.title} (model_type {', '.join(f.model_types)})" for f in FAMILIES.values())
