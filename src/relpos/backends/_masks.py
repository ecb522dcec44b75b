"""Attention masks: typed once at the boundary, and key padding recognised so it stays cheap.

Typing rule (one for every entry point): a **boolean** mask means *keep* (``True`` = attend), a
**floating** mask is *added* to the logits. Integer masks are refused: ``1`` would be added as a
number, not read as "keep" (transformers' ``attention_mask`` is int64; pass ``mask.bool()``).

Key padding: a mask that only hides keys, the same for every query row (``(B, 1, 1, Lk)``,
``key_mask`` ``(B, Lk)``), or that hides keys *and* the future (transformers' 4-D decoder masks,
``(B, 1, Lq, Lk)``), is reduced to one contiguous run of kept keys per example,
:class:`KeyRanges`. Attention then slices the keys instead of materializing ``(B, H, Lq, Lk)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..core.offsets import relative_positions

__all__ = ["KeyRanges", "check_attn_mask", "check_key_mask", "fold_key_mask", "key_ranges"]


def _check_device(name: str, tensor: torch.Tensor, device: torch.device | None) -> None:
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the query is on {device}; move it with .to(query.device)")


def _permuted_hint(got: tuple[int, ...], shape: tuple[int, int, int, int], name: str) -> str:
    """A hint when ``got`` is ``shape`` with its dimensions in another order (a (B, Lq, H, Lk) tensor).

    >>> _permuted_hint((2, 10, 4, 12), (2, 4, 10, 12), "bias")
    '; its dimensions look permuted: bias.permute(0, 2, 1, 3) has the shape relpos takes'
    """
    if len(got) != 4 or got == shape or sorted(got) != sorted(shape):
        return ""
    for order in itertools.permutations(range(4)):
        if tuple(got[d] for d in order) == shape:
            return f"; its dimensions look permuted: {name}.permute{order} has the shape relpos takes"
    return ""


def check_attn_mask(
    attn_mask, shape: tuple[int, int, int, int], *, name: str = "attn_mask", device: torch.device | None = None
) -> torch.Tensor | None:
    """Refuse anything but ``None`` or a boolean/floating tensor broadcastable to ``shape`` (B, H, Lq, Lk)
    on ``device`` (the query's)."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(attn_mask).__name__}")
    _check_device(name, attn_mask, device)
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"{name} has dtype {attn_mask.dtype}; relpos takes a boolean mask (True = attend) or a floating "
            f"mask added to the logits, and refuses integer masks (a 0/1 int mask would be added as numbers). "
            f"For a 0/1 padding mask such as transformers' attention_mask pass {name}.bool()"
        )
    try:
        if torch.broadcast_shapes(attn_mask.shape, shape) != torch.Size(shape):
            raise RuntimeError
    except RuntimeError:
        hint = _permuted_hint(tuple(attn_mask.shape), shape, name)
        if attn_mask.dim() == 2 and attn_mask.shape == (shape[0], shape[3]):
            hint = "; a 2-D attn_mask is (Lq, Lk) as in SDPA: pass a (B, Lk) key padding mask as key_mask="
        raise ValueError(
            f"{name} of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Lq, Lk) = {shape}{hint}"
        ) from None
    return attn_mask


def check_key_mask(key_mask, batch: int, key_length: int, *, device: torch.device | None = None) -> torch.Tensor | None:
    """``key_mask``: ``None`` or a boolean ``(B, Lk)`` tensor, ``True`` where the key is a real token."""
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor):
        raise TypeError(f"key_mask must be a boolean tensor (B, Lk) or None, got {type(key_mask).__name__}")
    _check_device("key_mask", key_mask, device)
    if key_mask.dtype != torch.bool:
        raise TypeError(
            f"key_mask must be boolean (True = a real token to attend to), got dtype {key_mask.dtype}; "
            "for transformers' 0/1 attention_mask pass attention_mask.bool()"
        )
    if tuple(key_mask.shape) != (batch, key_length):
        raise ValueError(f"key_mask must have shape (B, Lk) = {(batch, key_length)}, got {tuple(key_mask.shape)}")
    return key_mask


def branch_free(tensor: torch.Tensor) -> bool:
    """Whether code must not branch on ``tensor``'s values: under ``torch.compile`` (a data-dependent branch
    breaks the graph) and on a GPU (reading a value back makes the CPU wait for the GPU, every call)."""
    return torch.compiler.is_compiling() or tensor.is_cuda


def fold_key_mask(attn_mask: torch.Tensor | None, key_mask: torch.Tensor) -> torch.Tensor:
    """One dense mask hiding what ``attn_mask`` hides and the keys ``key_mask`` (B, Lk) marks False."""
    keep = key_mask.view(key_mask.shape[0], 1, 1, key_mask.shape[1])  # (B, 1, 1, Lk): view, not indexing (1 us less)
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


@dataclass(frozen=True)
class KeyRanges:
    """Example ``b`` attends to keys ``starts[b] <= j < ends[b]`` (and nothing when ``ends[b] <= starts[b]``).

    ``causal`` is True when the mask it came from also hid every key after the query's position.
    """

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    causal: bool = False

    def __len__(self) -> int:
        return len(self.starts)

    def covers_all(self, key_length: int) -> bool:
        return all(s == 0 for s in self.starts) and all(e == key_length for e in self.ends)

    def keep(self, key_length: int, device=None) -> torch.Tensor:
        """(B, Lk) boolean form: True inside each example's run."""
        j = torch.arange(key_length, device=device)  # (Lk,)
        starts = torch.tensor(self.starts, device=device)[:, None]  # (B, 1)
        ends = torch.tensor(self.ends, device=device)[:, None]
        return (j >= starts) & (j < ends)  # (B, Lk)


def _keep_of(mask: torch.Tensor) -> torch.Tensor | None:
    """Boolean keep-form of a mask that only keeps or hides (float: 0 or <= finfo.min); else None."""
    if mask.dtype == torch.bool:
        return mask
    keep = mask == 0
    hidden = mask <= torch.finfo(mask.dtype).min  # -inf too
    if not bool((keep | hidden).all()):
        return None  # a real additive bias, not a mask
    return keep


def _runs(keep: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Per row of ``keep`` (B, Lk): the one contiguous run of True, or None if some row has holes."""
    batch, key_length = keep.shape
    count = keep.sum(-1)  # (B,)
    index = torch.arange(key_length, device=keep.device)
    start = torch.where(keep, index, key_length).amin(-1)  # (B,) first kept key (Lk if none)
    end = torch.where(keep, index + 1, 0).amax(-1)  # (B,) one past the last kept key (0 if none)
    if bool(((end - start).clamp(min=0) != count).any()):
        return None
    return tuple(start.tolist()), tuple(end.tolist())


def key_ranges(
    attn_mask: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    batch: int,
    query_length: int,
    key_length: int,
    *,
    q_offset: int = 0,
) -> KeyRanges | None:
    """The :class:`KeyRanges` equivalent to ``attn_mask`` and ``key_mask`` together, or None.

    None means "not a contiguous key padding mask" (attention then uses a dense mask). Inputs
    are already validated (:func:`check_attn_mask`, :func:`check_key_mask`).
    """
    rows = None  # (B|1, Lk) keys each example keeps
    causal = False
    if attn_mask is not None:
        if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[3] != key_length:
            return None  # per-head, 2-D (Lq, Lk) or key-broadcast masks are not key padding
        keep = _keep_of(attn_mask)  # (B|1, 1, Lq|1, Lk)
        if keep is None:
            return None
        keep = keep[:, 0]  # (B|1, Lq|1, Lk)
        last = keep[:, -1]  # (B|1, Lk): the last query row sees every key a causal mask allows
        if keep.shape[1] > 1 and not bool((keep == last[:, None]).all()):
            future = relative_positions(query_length, key_length, q_offset=q_offset, device=keep.device) > 0
            if not bool((keep == (last[:, None] & ~future)).all()):
                return None
            causal = True
        rows = last
    if key_mask is not None:
        rows = key_mask if rows is None else rows & key_mask
    if rows is None:
        return None
    runs = _runs(rows.expand(batch, key_length))
    if runs is None:
        return None
    starts, ends = runs
    if causal:  # keys past the last query's position were hidden by the causal part, not by padding
        horizon = q_offset + query_length
        ends = tuple(e if e < horizon else key_length for e in ends)
    return KeyRanges(starts, ends, causal)
