"""Rotary position embedding, RoPE (Su et al., RoFormer, 2021).

Queries and keys are rotated, pair of channels by pair of channels, by an angle proportional
to their position, so that ``q_i . k_j`` depends on ``j - i`` only. Two channel layouts:

* half-split (``interleaved=False``): channel ``c`` pairs with ``c + d/2``; GPT-NeoX and
  Llama, equal to transformers' ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``;
* interleaved (``interleaved=True``): channels ``(2c, 2c + 1)`` pair up; RoFormer, GPT-J.

Angles, cos and sin and the rotation itself are computed in float32 whatever the input dtype
(bf16 positions and angles lose whole radians at long lengths); the result is cast back.

Scaling for longer contexts (``scaling=`` a dict with transformers' rope-parameter names, so a
transformers config's ``rope_parameters`` work unchanged):

* ``linear`` (position interpolation, Chen et al. 2023): frequencies divided by ``factor``;
* ``dynamic`` (dynamic NTK): past ``original_max_position_embeddings`` positions the base grows
  with the length of the call, ``base * (factor * L / L0 - (factor - 1)) ** (d / (d - 2))``;
* ``yarn`` (Peng et al. 2023): per-frequency blend of interpolation and extrapolation between
  ``beta_fast`` and ``beta_slow`` rotations, and cos/sin scaled by ``attention_factor``
  (``0.1 ln(factor) + 1`` by default);
* ``llama3``: long wavelengths divided by ``factor``, short ones kept, a smooth blend between
  ``low_freq_factor`` and ``high_freq_factor``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .._checks import check_bool, check_device, check_int, check_positive_float, check_tensor

__all__ = ["ROPE_SCALINGS", "RotaryEmbedding", "apply_rotation"]

#: rope_type -> (required keys, optional keys) of a ``scaling`` dict (transformers' names)
ROPE_SCALINGS: dict[str, tuple[frozenset, frozenset]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "original_max_position_embeddings"}), frozenset()),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset({"beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}),
    ),
    "llama3": (frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}), frozenset()),
}


def _default_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    """``base ** (-2c / d)``: the same expression as transformers' default RoPE, for bit-equal angles."""
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (base**exponent)  # (d/2,)


def _check_scaling(scaling: Mapping[str, Any] | None, base: float) -> tuple[dict | None, float]:
    """Validated copy of ``scaling`` and the base it implies (``rope_theta`` may set it)."""
    if scaling is None:
        return None, base
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be None or a dict of rope parameters, got {type(scaling).__name__}")
    scaling = dict(scaling)
    theta = scaling.pop("rope_theta", None)
    if theta is not None:
        theta = check_positive_float("scaling['rope_theta']", theta)
        if base != 10000.0 and theta != base:
            raise ValueError(f"base={base} and scaling['rope_theta']={theta} disagree; give one of them")
        base = theta
    rope_type = scaling.pop("rope_type", None)
    if rope_type in (None, "default") and not scaling:
        return None, base
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(f"scaling['rope_type'] must be one of {sorted(ROPE_SCALINGS)}, got {rope_type!r}")
    required, optional = ROPE_SCALINGS[rope_type]
    missing, unknown = required - set(scaling), set(scaling) - required - optional
    if missing or unknown:
        raise ValueError(
            f"scaling for rope_type={rope_type!r} needs {sorted(required)} and accepts {sorted(optional) or 'nothing else'}; "
            f"missing {sorted(missing) or 'none'}, unknown {sorted(unknown) or 'none'}"
        )
    for key, value in scaling.items():
        if key == "truncate":
            scaling[key] = check_bool("scaling['truncate']", value)
        elif value is not None or key in required:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"scaling[{key!r}] must be a finite number > 0, got {value!r}")
    if scaling["factor"] < 1:
        raise ValueError(f"scaling['factor'] must be >= 1 (it stretches the context), got {scaling['factor']}")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("scaling['high_freq_factor'] must be greater than scaling['low_freq_factor']")
    return {"rope_type": rope_type, **scaling}, base


def _yarn(base: float, dim: int, s: dict, device=None) -> tuple[torch.Tensor, float]:
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = float(get_mscale(factor, s["mscale"]) / get_mscale(factor, s["mscale_all_dim"]))
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations):  # the channel whose wavelength makes `rotations` turns over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)  # (d/2,)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1: keep the frequency (high frequencies), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _llama3(base: float, dim: int, s: dict, device=None) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim, device)
    factor, original = s["factor"], s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / s["low_freq_factor"], original / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """``x * cos + turn(x) * sin`` in fp32 (fp64 for fp64 input), cast back: each channel pair rotated
    (and scaled, if ``cos``/``sin`` carry a scale) by its ``(L, d)`` table entries."""
    xf = x if x.dtype == torch.float64 else x.float()
    if interleaved:
        pairs = xf.unflatten(-1, (-1, 2))  # (..., L, d/2, 2)
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (-x1, x0) per pair
    else:
        half = xf.shape[-1] // 2
        turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)  # (-x2, x1)
    return (xf * cos + turned * sin).to(x.dtype)  # (..., L, d)


class RotaryEmbedding(nn.Module):
    """``forward(q, k, *, q_offset=0)`` returns ``(q_rot, k_rot)``.

    Args:
        head_dim: rotated width ``d`` (even).
        base: ``theta``: frequencies ``base ** (-2c / d)``, c = 0 .. d/2 - 1.
        interleaved: channel layout (see the module docstring).
        inv_freq: explicit angular frequencies (radians per position), ``d/2`` of them,
            instead of ``base`` (for scaled variants or worked examples).
        scaling: ``None`` or a dict of transformers' rope parameters: ``rope_type`` in
            ``linear``, ``dynamic``, ``yarn``, ``llama3`` with ``factor``,
            ``original_max_position_embeddings``, ``low_freq_factor``, ``high_freq_factor``
            (llama3), ``beta_fast``, ``beta_slow``, ``attention_factor``, ``mscale``,
            ``mscale_all_dim``, ``truncate`` (yarn); ``rope_theta`` sets ``base``. For ``dynamic``,
            ``original_max_position_embeddings`` is the length trained on (transformers reads
            ``config.max_position_embeddings`` there). Dynamic frequencies follow each call's
            positions (``start + L``), which equals transformers' cached update whenever positions
            only grow, as in decoding.

    q is ``(..., Lq, d)`` at positions ``q_offset .. q_offset + Lq - 1``; k is ``(..., Lk, d)``
    at ``0 .. Lk - 1``. With ``d = 2`` and one frequency ``pi/6`` a position ``p`` is rotated by
    ``30 p`` degrees:

    >>> import math
    >>> rope = RotaryEmbedding(2, inv_freq=[math.pi / 6])
    >>> q, k = rope(torch.tensor([[0., 1.]]), torch.tensor([[0., 1.], [0., 1.]]), q_offset=1)
    >>> q                         # position 1: [0, 1] rotated by 30 degrees
    tensor([[-0.5000,  0.8660]])
    """

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        interleaved: bool = False,
        *,
        inv_freq: Sequence[float] | torch.Tensor | None = None,
        scaling: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        device = check_device("device", device)
        self.head_dim = check_int("head_dim", head_dim, minimum=2)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (channels rotate in pairs), got {head_dim}")
        self.scaling, base = _check_scaling(scaling, check_positive_float("base", base))
        self.base = base
        self.interleaved = check_bool("interleaved", interleaved)
        if inv_freq is not None and self.scaling is not None:
            raise ValueError("give inv_freq or scaling, not both (inv_freq fixes the frequencies)")
        if inv_freq is not None:
            inv_freq = torch.as_tensor(inv_freq, dtype=torch.float32).flatten()
            if inv_freq.numel() != self.head_dim // 2:
                raise ValueError(f"inv_freq must have head_dim/2={self.head_dim // 2} entries, got {inv_freq.numel()}")
        self._explicit_inv_freq = inv_freq
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self._init_buffers(device)

    def _init_buffers(self, device: torch.device | str | None = None) -> None:
        self.attention_factor = 1.0  # cos and sin are scaled by it (YaRN)
        rope_type = None if self.scaling is None else self.scaling["rope_type"]
        if self._explicit_inv_freq is not None:
            self.inv_freq = self._explicit_inv_freq.to(device)
        elif rope_type == "yarn":
            self.inv_freq, self.attention_factor = _yarn(self.base, self.head_dim, self.scaling, device)
        elif rope_type == "llama3":
            self.inv_freq = _llama3(self.base, self.head_dim, self.scaling, device)
        else:  # default, dynamic (within the original length) and linear
            self.inv_freq = _default_inv_freq(self.base, self.head_dim, device)
            if rope_type == "linear":
                self.inv_freq = self.inv_freq / self.scaling["factor"]

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, base={self.base}, interleaved={self.interleaved}{scaling}"

    def frequencies(self, length: int) -> torch.Tensor:
        """(d/2,) angular frequencies for a call whose positions end before ``length`` (dynamic NTK grows them)."""
        if self.scaling is None or self.scaling["rope_type"] != "dynamic":
            return self.inv_freq
        original, factor = self.scaling["original_max_position_embeddings"], self.scaling["factor"]
        length = max(length, original)
        dim = self.head_dim
        base = self.base * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))
        return _default_inv_freq(base, dim, self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, *, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(L, d)`` cos and sin for integer positions ``(L,)``, in this module's layout (YaRN-scaled).

        ``length``: the length of the sequence the positions belong to, for dynamic NTK scaling (default: the
        last position + 1; a shard of a longer sequence passes the whole length).
        """
        inv_freq = self.inv_freq
        if self.scaling is not None and self.scaling["rope_type"] == "dynamic":  # the only length-dependent one
            if length is None:
                length = int(positions.max()) + 1 if positions.numel() else 0
            inv_freq = self.frequencies(length)
        angles = positions.float()[:, None] * inv_freq.float()[None, :]  # (L, d/2)
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)  # (L, d): c0 c0 c1 c1 ...
        else:
            angles = torch.cat((angles, angles), dim=-1)  # (L, d): c0 c1 ... c0 c1 ...
        if self.attention_factor != 1.0:
            return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return angles.cos(), angles.sin()

    def rotate(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rotate ``x (..., L, d)`` as positions ``start .. start + L - 1`` (new keys of a KV cache)."""
        start = check_int("start", start, minimum=0)
        check_tensor("x", x, shape="(..., L, d)")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating tensor, got {x.dtype}: rotating integers would truncate the result")
        if self.inv_freq.device != x.device:
            raise ValueError(f"x is on {x.device} but this RotaryEmbedding is on {self.inv_freq.device}; move it with .to(x.device)")
        return self.rotate_positions(x, torch.arange(start, start + x.shape[-2], device=x.device))

    def rotate_positions(self, x: torch.Tensor, positions: torch.Tensor, *, length: int | None = None) -> torch.Tensor:
        """Rotate ``x (..., L, d)`` as the integer ``positions (L,)`` of a sequence of ``length`` (see :meth:`cos_sin`)."""
        cos, sin = self.cos_sin(positions, length=length)  # (L, d) each
        return apply_rotation(x, cos, sin, interleaved=self.interleaved)  # (..., L, d)

    def forward(self, q: torch.Tensor, k: torch.Tensor, *, q_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        q_offset = check_int("q_offset", q_offset, minimum=0)
        for name, t in (("q", q), ("k", k)):
            check_tensor(name, t, shape="(..., L, head_dim)")
            if t.dim() < 2 or t.shape[-1] != self.head_dim:
                raise ValueError(f"{name} must be (..., L, head_dim={self.head_dim}), got {tuple(t.shape)}")
        return self.rotate(q, q_offset), self.rotate(k, 0)
