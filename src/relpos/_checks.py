"""Argument validation shared by every public entry point.

Each helper raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind,
wrong value) with a message that names the argument, the value received and the rule.
Validation happens once, at the public boundary; internal code trusts its inputs.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable

import torch

__all__ = ["check_int", "check_bool", "check_choice", "check_positive_float", "check_probability", "check_scale", "check_device", "check_tensor",
           "check_dtype", "check_real", "check_per_head", "check_shape", "check_grid", "check_bias_heads"]


def check_int(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int:
    """Return ``value`` as a Python int, or raise naming ``name``.

    bool is rejected (``True`` is an int in Python, but never a meaningful length).
    """
    if type(value) is int and (minimum is None or value >= minimum):  # the common case, without the ABC check
        return value  # (a decoding step validates a dozen ints; numbers.Integral costs microseconds each)
    if isinstance(value, torch.SymInt):  # a symbolic size under torch.compile: keep it symbolic
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        rule = "positive" if minimum == 1 else ("non-negative" if minimum == 0 else f">= {minimum}")
        msg = f"{name} must be {rule}, got {value}"
        raise ValueError(msg + (f"; {hint}" if hint else ""))
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
    value = float(value)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_probability(name: str, value: Any) -> float:
    """A dropout probability: a real number in [0, 1)."""
    if type(value) is float and 0.0 <= value < 1.0:  # the common case, without the ABC check (as check_int)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in [0, 1), got {value!r} of type {type(value).__name__}")
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the probability of dropping an attention weight), got {value}")
    return value


def check_scale(name: str, value: Any) -> float | None:
    """``None`` (the default scale) or a finite real number."""
    if value is None:
        return None
    if type(value) is float and value - value == 0.0:  # finite (inf - inf and NaN - NaN are NaN), no ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {value!r} of type {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_device(name: str, value: Any) -> torch.device | None:
    """``None``, a ``torch.device`` or a string torch can parse (``"cpu"``, ``"cuda:0"``)."""
    if value is None or isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be None, a torch.device or a device string like 'cpu', got {value!r} of type {type(value).__name__}")
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name} must name a device torch knows ('cpu', 'cuda', 'cuda:0', ...), got {value!r}") from None


def check_tensor(name: str, value: Any, *, shape: str = "") -> torch.Tensor:
    """A ``torch.Tensor`` (not a list, not a NumPy array: no silent copies or dtype guesses)."""
    if not isinstance(value, torch.Tensor):
        hint = " (convert it with torch.as_tensor first)" if hasattr(value, "__len__") else ""
        raise TypeError(f"{name} must be a torch.Tensor{' ' + shape if shape else ''}, got {type(value).__name__}{hint}")
    return value


def check_dtype(name: str, value: Any) -> torch.dtype | None:
    """``None`` or a ``torch.dtype`` (not a string: ``torch.float32``, not ``"float32"``)."""
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be None or a torch.dtype such as torch.float32, got {value!r} of type {type(value).__name__}")
    return value


def check_real(name: str, value: Any, *, rule: str = "") -> float:
    """A real number that is not NaN (infinities allowed: a mask value may be -inf)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}")
    value = float(value)
    if value != value:
        raise ValueError(f"{name} must be a number, got NaN" + (f"; {rule}" if rule else ""))
    return value


def check_per_head(name: str, value: Any, num_heads: int, *, maximum: float | None = None) -> list[float]:
    """One finite number > 0 (and <= ``maximum``) per head: a number (shared) or a sequence of ``num_heads``."""
    values = [value] * num_heads if isinstance(value, numbers.Real) and not isinstance(value, bool) else value
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values):
        raise TypeError(f"{name} must be a number or a sequence of {num_heads} numbers (one per head), got {value!r}")
    if len(values) != num_heads:
        raise ValueError(f"{name} must have num_heads={num_heads} entries (one per head), got {len(values)}")
    bound = "" if maximum is None else f" and <= {maximum}"
    for v in values:
        if not (v > 0 and v == v and v != float("inf")) or (maximum is not None and v > maximum):
            raise ValueError(f"{name} must be finite and > 0{bound} for every head, got {list(values)}")
    return [float(v) for v in values]


def check_shape(name: str, value: Any, shape: tuple, *, meaning: str) -> torch.Tensor:
    """A floating tensor of exactly ``shape`` (``None`` entries match any size); ``meaning`` names the dims."""
    value = check_tensor(name, value, shape=meaning)
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor {meaning}, got {value.dtype}")
    if value.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, value.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {meaning} = {want}, got {tuple(value.shape)}")
    return value


def check_grid(name: str, value: Any) -> tuple[int, int]:
    """A patch grid: a positive int ``S`` (square) or ``(height, width)``, as ``(height, width)``."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be (height, width), got {value!r}")
        return check_int(f"{name}[0]", value[0], minimum=1), check_int(f"{name}[1]", value[1], minimum=1)
    size = check_int(name, value, minimum=1)
    return size, size


#: more heads than this reads as a sequence length: models use at most a few dozen heads
_MOST_HEADS = 64
_LAYOUT_HINT = "; tensors are (B, H, L, d): a (B, L, H, d) tensor needs .transpose(1, 2)"


def check_bias_heads(
    name: str, bias_heads: int, heads: int, *, query_length: int | None = None, owner: str = "the query"
) -> None:
    """Refuse a bias whose head count is neither 1 (shared by every head) nor ``heads`` (``owner``'s).

    Given the query's ``query_length`` (its dim 2), the message adds the layout hint when the query looks
    transposed, (B, L, H, d) where (B, H, L, d) belongs: its dim 2 equals the bias's head count, or its
    head count is above its length and above what models use.

    >>> check_bias_heads("bias", 1, 12)  # one head, shared: fine
    >>> check_bias_heads("bias", 8, 128, query_length=8)
    Traceback (most recent call last):
    ValueError: bias has num_heads=8 but the query has 128 heads; a bias has 1 head (shared) or one per head; tensors are (B, H, L, d): a (B, L, H, d) tensor needs .transpose(1, 2), or else build bias with num_heads=128 or 1
    """
    if bias_heads in (1, heads):
        return
    transposed = query_length is not None and (
        query_length == bias_heads or (heads > _MOST_HEADS and heads > query_length)
    )
    fix = f"build {name} with num_heads={heads} or 1"
    raise ValueError(
        f"{name} has num_heads={bias_heads} but {owner} has {heads} heads; a bias has 1 head (shared) or one per head"
        + (f"{_LAYOUT_HINT}, or else {fix}" if transposed else f": {fix}")
    )
