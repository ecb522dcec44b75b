"""Swin, Swin V2 and Donut Swin on relpos's window attention.

What :func:`relpos.hf.accelerate` changes, on the given model only: each window attention module
(``SwinAttention``, ``Swinv2SelfAttention``, ``DonutSwinSelfAttention``) gets an instance-level
``forward`` that reads the same projections and the same bias (table, or Swin V2's MLP), adds the
layer's shift mask to it once as ``(nW, H, N, N)``, and runs :func:`relpos.window_attention`
over ``(B, nW, H, N, d)``: the bias is broadcast over the batch instead of transformers'
``(B * nW, H, N, N)`` scores, the forward runs SDPA's fused kernel, and nothing of that size is
kept for the backward. Padding, the cyclic shift and the window partition stay transformers'
(the layers are untouched).

Exactness notes: transformers' ``Swinv2SelfAttention`` adds the shift mask twice (``-200``
between regions, where Swin V2's paper code adds ``-100`` once); the adapter does the same, so
outputs equal transformers'. A call that asks for attention weights (``output_attentions``) runs
transformers' own forward, which computes them. No class is modified and no parameter or buffer
is added or renamed; :func:`relpos.hf.restore` deletes the instance ``forward``.

:func:`recompute_activations` (opt-in, after ``accelerate``) trades a little training time for
memory: each attention branch keeps only its input for the backward (the q, k, v projections run
inside :func:`relpos.projected_window_attention` and are recomputed in the backward) and each MLP
only its pre-activation (:class:`_ActLinear`: the activation is recomputed); the layers' MLP
modules then get instance ``forward`` attributes too, removed by ``enabled=False`` or ``restore``.
"""

from __future__ import annotations

import inspect
import math
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._checks import check_bool
from ..layers.window_attention import projected_window_attention, window_attention
from ._attention import recording_attentions
from ._family import Family, register
from .api import is_accelerated

__all__ = ["FAMILY", "SWIN_ATTENTION_CLASSES", "recompute_activations"]


@dataclass(frozen=True)
class _Kind:
    """How one transformers attention class stores its projections and bias."""

    projections: tuple[str, str, str]  # q, k, v linear layers
    attributes: tuple[str, ...]  # what the adapter reads besides the projections
    forward_args: tuple[str, ...]  # the class's forward parameters the adapter replaces
    mask_repeats: int  # how many times transformers adds the shift mask
    continuous: bool = False  # Swin V2: the MLP bias and cosine attention


_KINDS = {
    "SwinAttention": _Kind(("q_proj", "k_proj", "v_proj"), ("o_proj", "relative_position_bias", "scaling",
                           "attention_dropout", "head_dim"), ("self", "hidden_states", "attention_mask", "kwargs"), 1),
    "DonutSwinSelfAttention": _Kind(("query", "key", "value"), ("relative_position_bias_table", "relative_position_index",
                                    "dropout", "attention_head_size", "window_size"),
                                    ("self", "hidden_states", "attention_mask", "output_attentions"), 1),
    "Swinv2SelfAttention": _Kind(("query", "key", "value"), ("continuous_position_bias_mlp", "relative_coords_table",
                                 "relative_position_index", "logit_scale", "dropout", "attention_head_size", "window_size"),
                                 ("self", "hidden_states", "attention_mask", "output_attentions"), 2, continuous=True),
}
SWIN_ATTENTION_CLASSES = tuple(_KINDS)
_RECOMPUTE_FLAG = "_relpos_recompute"  # instance attribute set by recompute_activations


def _table_bias(module: nn.Module) -> torch.Tensor:
    """(H, N, N) from a Swin V1 table (Donut stores it on the attention module itself)."""
    if hasattr(module, "relative_position_bias"):
        return module.relative_position_bias()[0]  # (H, N, N)
    n = module.window_size[0] * module.window_size[1]
    bias = module.relative_position_bias_table[module.relative_position_index.view(-1)]  # (N*N, H)
    return bias.view(n, n, -1).permute(2, 0, 1)  # (H, N, N)


def _continuous_bias(module: nn.Module) -> torch.Tensor:
    """(H, N, N) from Swin V2's MLP: ``16 * sigmoid`` of its output, gathered by the index."""
    n = module.window_size[0] * module.window_size[1]
    heads = module.num_attention_heads
    table = 16 * torch.sigmoid(module.continuous_position_bias_mlp(module.relative_coords_table).view(-1, heads))  # (T, H)
    return table[module.relative_position_index.view(-1)].view(n, n, heads).permute(2, 0, 1)  # (H, N, N)


def _position_bias(module: nn.Module, kind: _Kind) -> torch.Tensor | None:
    """(1, H, N, N): the module's relative position bias. The one seam of the position term: the model benchmark's
    floor (benchmarks/swin.py) returns None here, attention with the shift mask alone."""
    return (_continuous_bias(module) if kind.continuous else _table_bias(module))[None]


def _heads(module: nn.Module) -> tuple[int, int]:
    d = getattr(module, "head_dim", None) or module.attention_head_size
    return getattr(module, "num_attention_heads"), d


def _windowed_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      output_attentions: bool | None = False, **kwargs):
    """The module's attention on relpos's window path: same inputs, same outputs as transformers'.

    After :func:`recompute_activations`, training keeps only the branch's input: the projections run
    inside :func:`relpos.projected_window_attention`, which projects again in the backward (or, for
    projections that are not plain ``nn.Linear`` layers, e.g. adapters, the branch runs in a
    non-reentrant checkpoint). Gradients are unchanged.
    """
    if output_attentions or kwargs.get("output_attentions") or recording_attentions():  # config.output_attentions too
        return type(self).forward(self, hidden_states, attention_mask, output_attentions=True, **kwargs)
    recompute = getattr(self, _RECOMPUTE_FLAG, False) and torch.is_grad_enabled()
    kind = _KINDS[type(self).__name__]
    if recompute and not all(type(getattr(self, name)) is nn.Linear for name in kind.projections):
        out = checkpoint(_attend, self, hidden_states, attention_mask, False, use_reentrant=False)  # (B * nW, N, C)
    else:
        out = _attend(self, hidden_states, attention_mask, recompute)  # (B * nW, N, C)
    if hasattr(self, "o_proj"):  # SwinAttention projects and returns (output, weights)
        return self.o_proj(out), None
    return (out,)


def _attend(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, inside: bool) -> torch.Tensor:
    """``(B * nW, N, C) -> (B * nW, N, C)``: projections, bias + mask once per layer, window attention;
    ``inside``: the projections run inside the attention function (kept: their input only)."""
    kind = _KINDS[type(self).__name__]
    bnw, n, c = hidden_states.shape  # (B * nW, N, C)
    nw = 1 if attention_mask is None else attention_mask.shape[0]
    heads, d = _heads(self)
    if kind.continuous:  # Swin V2: cosine attention, q and k normalised inside the attention function
        cosine_scale, scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp().view(-1), None  # (H,)
    else:
        cosine_scale, scale = None, getattr(self, "scaling", None) or 1.0 / math.sqrt(d)
    bias = _position_bias(self, kind)  # (1, H, N, N), or None
    if attention_mask is not None:
        mask = kind.mask_repeats * attention_mask[:, None]  # (nW, 1, N, N)
        bias = mask.expand(-1, heads, -1, -1) if bias is None else bias + mask.to(bias.dtype)  # (nW, H, N, N): per layer
    dropout = getattr(self, "attention_dropout", None)
    dropout = self.dropout.p if dropout is None else dropout
    options = dict(scale=scale, cosine_scale=cosine_scale, dropout_p=dropout if self.training else 0.0, training=self.training)
    x = hidden_states.view(bnw // nw, nw, n, c)  # (B, nW, N, C)
    projections = [getattr(self, name) for name in kind.projections]
    bias = None if bias is None else bias.to(x.dtype)
    if inside:
        out = projected_window_attention(x, [p.weight for p in projections], [p.bias for p in projections],
                                         bias, heads=heads, **options)  # (B, nW, N, C)
        return out.view(bnw, n, -1)  # (B * nW, N, C)
    q, k, v = (p(x).view(bnw // nw, nw, n, heads, d).transpose(2, 3) for p in projections)  # (B, nW, H, N, d)
    out = window_attention(q, k, v, bias, **options)  # (B, nW, H, N, d)
    return out.transpose(2, 3).reshape(bnw, n, c)  # (B * nW, N, C): a view of the fused path's output


def _check(modules: list[nn.Module]) -> None:
    """Every module has the attributes and the forward signature the adapter reads."""
    for module in modules:
        kind = _KINDS[type(module).__name__]
        missing = [a for a in (*kind.projections, *kind.attributes) if not hasattr(module, a)]
        params = tuple(inspect.signature(type(module).forward).parameters)
        if missing or params != kind.forward_args:
            import transformers

            raise RuntimeError(
                f"relpos.hf.accelerate does not fit {type(module).__name__} of the installed transformers "
                f"{transformers.__version__}: it reads {kind.projections + kind.attributes} (missing: {missing or 'none'}) "
                f"and replaces forward{kind.forward_args[1:]} (got {params[1:]}). Run the model unaccelerated, "
                "or use a transformers release whose Swin attention has this interface."
            )


def _apply(model: nn.Module, modules: list[nn.Module]) -> Callable[[], None]:
    for module in modules:
        module.forward = types.MethodType(_windowed_forward, module)  # instance attribute: this model only

    def undo() -> None:
        _switch_off(model)
        for module in modules:
            del module.forward  # the class's forward shows through again

    return undo


class _ActLinear(torch.autograd.Function):
    """``linear(act(h), weight, bias)`` keeping only ``h``: ``act(h)`` is recomputed in the backward."""

    @staticmethod
    def forward(ctx, h, weight, bias, act):  # h (..., F); weight (C, F)
        ctx.save_for_backward(h, weight)
        ctx.act, ctx.has_bias = act, bias is not None
        return F.linear(act(h), weight, bias)  # (..., C)

    @staticmethod
    def backward(ctx, grad_out):
        h, weight = ctx.saved_tensors
        with torch.enable_grad():
            leaf = h.detach().requires_grad_()
            g = ctx.act(leaf)  # (..., F), recomputed
        grad_h = torch.autograd.grad(g, leaf, grad_out @ weight)[0] if ctx.needs_input_grad[0] else None
        flat = grad_out.reshape(-1, grad_out.shape[-1])  # (M, C)
        grad_w = flat.t() @ g.detach().reshape(-1, g.shape[-1]) if ctx.needs_input_grad[1] else None  # (C, F)
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # (C,)
        return grad_h, grad_w, grad_b, None


def _pre_activation(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Instance ``forward`` of a layer's ``intermediate`` under recomputation: ``dense`` only (the
    activation moves into the ``output``'s :class:`_ActLinear`)."""
    return self.dense(hidden_states)  # (B, L, F)


def _activated_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Instance ``forward`` of a layer's ``output``: ``dropout(dense(act(h)))`` keeping only ``h``."""
    return self.dropout(_ActLinear.apply(hidden_states, self.dense.weight, self.dense.bias, self._relpos_act))


def _swin_mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Instance ``forward`` of Swin's ``SwinMLP`` under recomputation: ``fc2(act(fc1(x)))`` keeping ``fc1(x)``."""
    return _ActLinear.apply(self.fc1(hidden_states), self.fc2.weight, self.fc2.bias, self.activation_fn)  # (B, L, C)


def _mlp_pairs(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(intermediate, output) of every Swin layer whose MLP is ``dense -> act`` then ``dense -> dropout``."""
    pairs = []
    for layer in model.modules():
        inter, out = getattr(layer, "intermediate", None), getattr(layer, "output", None)
        if (type(inter).__name__.endswith("Intermediate") and all(hasattr(inter, a) for a in ("dense", "intermediate_act_fn"))
                and all(hasattr(out, a) for a in ("dense", "dropout")) and callable(inter.intermediate_act_fn)):
            pairs.append((inter, out))
    return pairs


def _switch_off(model: nn.Module) -> None:
    for module in model.modules():
        if module.__dict__.pop(_RECOMPUTE_FLAG, None) and type(module).__name__ not in _KINDS:
            module.__dict__.pop("forward", None)  # an MLP module: the class's forward again
            module.__dict__.pop("_relpos_act", None)


def recompute_activations(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Trade time for memory in training: keep only each window attention's and MLP activation's input.

    ``model`` must be accelerated (:func:`relpos.hf.accelerate`). With ``enabled``, every Swin /
    Swin V2 / Donut Swin attention branch keeps only its input (the q, k, v projections run inside
    :func:`relpos.projected_window_attention` and are recomputed in the backward: three matmuls) and
    each MLP keeps its pre-activation only (the activation is recomputed); outputs and gradients are
    unchanged (tested against the unmodified models). Measured on a Swin V2 tiny-like model
    (docs/benchmarks/vision/swin.md).
    ``enabled=False`` or :func:`relpos.hf.restore` removes it.
    """
    enabled = check_bool("enabled", enabled)
    modules = [m for m in model.modules() if type(m).__name__ in _KINDS] if isinstance(model, nn.Module) else []
    if not modules or not is_accelerated(model):
        raise ValueError(f"model must be a Swin, Swin V2 or Donut Swin model after relpos.hf.accelerate(model), "
                         f"got {type(model).__name__}{'' if modules else ' (no Swin attention modules)'}: accelerate it first")
    _switch_off(model)
    if not enabled:
        return model
    for module in modules:
        setattr(module, _RECOMPUTE_FLAG, True)
    for mlp in [m for m in model.modules() if all(hasattr(m, a) for a in ("fc1", "fc2", "activation_fn"))]:
        mlp.forward = types.MethodType(_swin_mlp, mlp)  # Swin V1's SwinMLP
        setattr(mlp, _RECOMPUTE_FLAG, True)
    for inter, out in _mlp_pairs(model):
        inter.forward = types.MethodType(_pre_activation, inter)
        out.__dict__["_relpos_act"] = inter.intermediate_act_fn  # a plain attribute, not a registered submodule
        out.forward = types.MethodType(_activated_output, out)
        setattr(inter, _RECOMPUTE_FLAG, True)
        setattr(out, _RECOMPUTE_FLAG, True)
    return model


FAMILY = register(
    Family(
        name="swin",
        title="Swin, Swin V2, Donut Swin",
        model_types=("swin", "swinv2", "donut-swin"),
        attention_classes=SWIN_ATTENTION_CLASSES,
        check=_check,
        apply=_apply,
        unsupported="attention weights (output_attentions) run transformers' own forward",
    )
)
