"""relpos's own attention layers with their sequence sharded: a patch on layer *instances*, undoable.

:func:`context_parallel` makes every :class:`relpos.MultiheadAttention` inside a module (``T5Attention``,
``T5Block``, ``T5Stack``, ...) run its self-attention through :func:`ring_attention`: the layer then takes
this rank's rows ``(B, Lc, dim)`` and its position term is evaluated at global positions. Everything else in
the model (norms, feed-forward, embeddings) is per token and needs no change. :func:`all_reduce_grads` sums
each parameter's gradient across the group after backward, as data parallelism does, so that every rank holds
the gradient of the whole sequence's loss.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_choice, check_positive_float
from ..core.bias import AdditiveBias
from ..encodings.rotary import RotaryEmbedding
from ..encodings.xpos import XPos
from ..layers.mha import MultiheadAttention
from ._comm import RingTimeoutError
from .layout import LAYOUTS, Layout
from .ring import DEFAULT_TIMEOUT, ring_attention

__all__ = ["ContextParallel", "all_reduce_grads", "context_parallel"]


@dataclass
class ContextParallel:
    """What :func:`context_parallel` patched; :meth:`undo` (or leaving a ``with`` block) restores it."""

    layers: list[MultiheadAttention] = field(default_factory=list)

    def undo(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)  # the class's forward shows through again
        self.layers.clear()

    def __enter__(self) -> "ContextParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def _refusal(layer: MultiheadAttention) -> str | None:
    position = layer.position
    if position is not None and not isinstance(position, (AdditiveBias, RotaryEmbedding, XPos)):
        return f"its position encoding {type(position).__name__} has an attention of its own, not a per-offset term"
    if isinstance(position, AdditiveBias) and not position.translation_invariant:
        return f"its bias {type(position).__name__} is not translation invariant"
    if layer.dropout:
        return f"it has attention dropout={layer.dropout} (context-parallel attention has none: build it with dropout=0)"
    return None


def context_parallel(
    module: nn.Module, *, layout: Layout = "contiguous", group: dist.ProcessGroup | None = None, timeout: float = DEFAULT_TIMEOUT
) -> ContextParallel:
    """Run every relpos attention layer inside ``module`` over the sequence sharded across ``group``.

    Each patched layer's forward takes ``(x, *, key_mask=None)`` with ``x`` this rank's ``(B, Lc, dim)`` rows
    (:func:`relpos.distributed.shard` cuts them) and ``key_mask`` its ``(B, Lc)`` rows; caches, cross-attention
    and dense masks are refused. Every layer is checked before any is changed. Returns a handle whose
    ``undo()`` restores the module (also a context manager).
    """
    layout = check_choice("layout", layout, LAYOUTS)
    timeout = check_positive_float("timeout", timeout)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    named = [(n, m) for n, m in module.named_modules() if isinstance(m, MultiheadAttention)]
    if not named:
        raise ValueError(f"module ({type(module).__name__}) holds no relpos MultiheadAttention layer to make context-parallel")
    for name, layer in named:
        why = _refusal(layer)
        if why:
            raise ValueError(f"layer {name or type(layer).__name__} cannot run context-parallel: {why}")
        if "forward" in layer.__dict__:
            raise ValueError(f"layer {name or type(layer).__name__} already has its forward patched (undo the other patch first)")
    handle = ContextParallel()
    for _, layer in named:
        layer.forward = types.MethodType(_sharded_forward(layout, group, timeout), layer)
        handle.layers.append(layer)
    return handle


def _sharded_forward(layout: str, group, timeout: float):
    def forward(self: MultiheadAttention, x: torch.Tensor, mask=None, position_bias=None, *, key_mask=None, **rest):
        given = sorted(k for k, v in rest.items() if v is not None)
        given += [name for name, v in (("mask", mask), ("position_bias", position_bias)) if v is not None]
        if given:
            raise ValueError(
                f"a context-parallel layer takes x and key_mask only (it evaluates its own position term at global "
                f"positions); got {', '.join(given)} (caches, cross-attention and dense masks need the whole sequence on one rank: undo the patch for them)"
            )
        self._check_inputs(x, None)
        q, k, v = self._project(x, None)  # (B, H, Lc, dh), (B, Hkv, Lc, dh) x2
        position = self.position
        out = ring_attention(
            q, k, v,
            bias=position if isinstance(position, AdditiveBias) else None,
            rotary=position if isinstance(position, (RotaryEmbedding, XPos)) else None,
            causal=self.causal, key_mask=key_mask, scale=self.scale, layout=layout, group=group, timeout=timeout,
        )  # (B, H, Lc, dh)
        return self.out(out.transpose(1, 2).flatten(-2)), None  # (B, Lc, dim); each layer evaluates its own bias

    return forward


def all_reduce_grads(module: nn.Module, *, group: dist.ProcessGroup | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Sum every parameter gradient of ``module`` across ``group`` (in place), each wait bounded by ``timeout``.

    After a context-parallel backward each rank holds its own tokens' share of every gradient (the position
    term's too); the sum is the gradient of the whole sequence's loss, equal on every rank. Under
    ``DistributedDataParallel`` over the same ranks this is what DDP already does: do not call both.
    """
    timeout = check_positive_float("timeout", timeout)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    works = [
        (name, dist.all_reduce(p.grad, group=group, async_op=True))
        for name, p in module.named_parameters()
        if p.grad is not None
    ]
    for name, work in works:
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as error:
            raise RingTimeoutError(f"the gradient of {name} was not summed across ranks within timeout={timeout:g}s: {error}") from error
