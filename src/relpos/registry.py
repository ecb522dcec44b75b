"""One record per position encoding: what the CLI, the plots, the explore page, the experiment's
model and the docs' table read.

Adding an encoding is one module plus one :class:`Encoding` here: its name, label, paper, kind,
a builder from ``(num_heads, head_dim, causal, options)`` and the options it takes. Everything
else (``relpos plot bias --kind``, ``/api/bias``, ``relpos extrapolate --encodings``, the table in
docs/encodings/index.md) lists and builds encodings from :data:`ENCODINGS`.

>>> get("kerple").create(2, 8).materialize(2, 2)[0, 0]
tensor([[ 0.0000, -0.6931],
        [-0.6931,  0.0000]], grad_fn=<SelectBackward0>)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from torch import nn

from .encodings.absolute import LearnedAbsolutePositionEmbedding, SinusoidalPositionEmbedding
from .encodings.alibi import ALiBi
from .core.offsets import relative_positions
from .encodings.buckets import relative_position_bucket
from .encodings.clipped import ClippedRelativeBias
from .encodings.cope import CoPE
from .encodings.fire import FIREBias
from .encodings.forgetting import ForgettingGate
from .encodings.kerple import KerpleBias
from .encodings.log_decay import LogDecayBias
from .encodings.rotary import RotaryEmbedding
from .encodings.sandwich import SandwichBias
from .encodings.shaw import ShawRelativePosition
from .encodings.t5 import RelativePositionalBias
from .encodings.window_bias import RelativePositionBias
from .encodings.xpos import XPos

__all__ = ["Encoding", "Option", "ENCODINGS", "get", "names", "markdown_table"]

Kind = Literal["additive bias", "rotary", "qk-vectors", "gate", "absolute", "none"]
Scope = Literal["shared", "layer", "input", "none"]


@dataclass(frozen=True)
class Option:
    """One keyword an encoding's builder takes.

    ``config_field``: the experiment's ``LMConfig`` field that sets it when named differently
    (``None``: the same name, if the config has it). ``page``: taken by ``/api/bias`` and
    ``relpos plot bias``. ``shown``: the value a one-head picture uses instead of ``default``.
    """

    name: str
    default: Any
    help: str
    type: type = float
    config_field: str | None = None
    page: bool = False
    shown: Any = None


Builder = Callable[[int, int, bool, Mapping[str, Any]], "nn.Module | None"]


@dataclass(frozen=True)
class Encoding:
    """A position encoding: what it is, where it comes from, how to build it.

    ``scope``: how a model holds it (``shared`` by every layer, one per ``layer``, added to the
    ``input`` embeddings, or ``none``). ``plot``: drawable as a bias matrix of positions alone.
    ``sequence``: usable in a 1-D sequence model (the experiment). ``default_run``: trained by the
    experiment's default run. ``details``: the explore page's per-cell readout of a built module.
    """

    name: str
    label: str
    paper: str
    kind: Kind
    build: Builder
    options: tuple[Option, ...] = ()
    scope: Scope = "shared"
    summary: str = ""
    formula: str = ""
    paths: str = ""
    plot: bool = False
    sequence: bool = True
    default_run: bool = False
    details: Callable[[nn.Module, int, bool], dict] | None = field(default=None, repr=False)

    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def resolve_options(self, options: Mapping[str, Any], *, picture: bool = False) -> dict[str, Any]:
        """The options with defaults filled in (``picture``: the one-head picture's defaults); unknown names refused."""
        unknown = sorted(set(options) - set(self.option_names()))
        if unknown:
            takes = ", ".join(self.option_names()) or "no options"
            raise TypeError(f"encoding {self.name!r} takes {takes}; got unknown option(s) {', '.join(unknown)}")
        filled = {o.name: (o.shown if picture and o.shown is not None else o.default) for o in self.options}
        return {**filled, **options}

    def create(self, num_heads: int, head_dim: int, *, causal: bool = False, picture: bool = False, **options):
        """The module (``None`` for NoPE) for ``num_heads`` heads of width ``head_dim``."""
        return self.build(num_heads, head_dim, causal, self.resolve_options(options, picture=picture))


def _t5_details(module, length: int, causal: bool) -> dict:
    buckets = relative_position_bucket(relative_positions(length, length), bidirectional=not causal,
                                       num_buckets=module.num_buckets, max_distance=module.max_distance)
    return {"buckets": buckets.tolist(), "table": module.relative_attention_bias.weight[:, 0].tolist()}


def _clipped(h, d, causal, o):
    module = ClippedRelativeBias(h, o["max_distance"])
    if o["init_std"]:
        nn.init.normal_(module.relative_bias, std=o["init_std"])
    return module


def _alibi(h, d, causal, o):
    return ALiBi(h, mode="causal" if causal else "symmetric", slopes=None if o["slope"] is None else [o["slope"]] * h)


def _params(module, length: int, causal: bool) -> dict:
    """The module's own scalar parameters (Kerple's r1, r2; FIRE's c, L_multiplier), head 0's value."""
    return {name: p.detach().flatten()[0].item() for name, p in module.named_parameters() if "." not in name}


_INIT = Option("init_std", 0.02, "std of the learned table's initialisation (plots: 1.0)", float, shown=1.0)
_KERPLE_OPTIONS = (Option("r1", 1.0, "initial r1 (every head)", float, page=True),
                   Option("r2", 1.0, "initial r2 (every head)", float, page=True))
_PER_OFFSET = "per offset: zero-copy SDPA view, fused CPU training, tiles, flex"

_ALL = (
    Encoding("none", "NoPE", "Kazemnejad et al. 2023", "none", lambda h, d, c, o: None, scope="none",
             summary="No position encoding: causal masking alone orders the tokens.", paths="plain SDPA", default_run=True),
    Encoding("learned", "learned absolute", "Vaswani et al. 2017; GPT-2", "absolute",
             lambda h, d, c, o: LearnedAbsolutePositionEmbedding(o["max_length"], o["dim"] or h * d),
             (Option("max_length", 512, "positions in the table", int, config_field="train_len"),
              Option("dim", None, "model width (default heads x head_dim)", int)),
             scope="input", summary="A learned vector per absolute position, added to the input.", paths="input only",
             default_run=True),
    Encoding("sinusoidal", "sinusoidal", "Vaswani et al. 2017", "absolute",
             lambda h, d, c, o: SinusoidalPositionEmbedding(o["dim"] or h * d),
             (Option("dim", None, "model width (default heads x head_dim)", int),), scope="input",
             summary="Fixed sinusoids of the absolute position, added to the input.", paths="input only", default_run=True),
    Encoding("t5", "T5 buckets", "Raffel et al. 2020", "additive bias",
             lambda h, d, c, o: RelativePositionalBias(h, o["num_buckets"], o["max_distance"], bidirectional=not c,
                                                       strategy=o["strategy"], init_std=o["init_std"]),
             (Option("num_buckets", 32, "buckets", int, page=True), Option("max_distance", 128, "distances past it share a bucket", int, page=True),
              Option("strategy", "log", "bucketing of far distances", str), _INIT),
             summary="One learned number per bucket (here at its seeded random initialisation): the colours repeat "
                     "along each diagonal, one per bucket.",
             formula="table[bucket(j \u2212 i)]", paths=_PER_OFFSET, plot=True, default_run=True, details=_t5_details),
    Encoding("clipped", "clipped bias", "Shaw et al. 2018 (scalar form)", "additive bias", _clipped,
             (Option("max_distance", 8, "offsets past it share the end values", int, config_field="clip_distance", page=True),
              Option("init_std", 0.0, "std of the table's initialisation (0: zeros; plots: 1.0)", float, shown=1.0)),
             summary="One learned number per offset in [\u2212R, R]; farther offsets share the end values.",
             formula="table[clip(j \u2212 i, \u2212R, R)]", paths=_PER_OFFSET, plot=True, default_run=True,
             details=lambda m, n, c: {"max_distance": m.max_distance, "table": m.relative_bias[0].tolist()}),
    Encoding("alibi", "ALiBi", "Press et al. 2022", "additive bias", _alibi,
             (Option("slope", None, "one slope for every head (default: the paper's per-head slopes)", float, shown=0.25),),
             summary="A fixed linear penalty on distance, \u2212m\u00b7|j \u2212 i|, steeper for heads with larger "
                     "slopes (head 0 shown).",
             formula="\u2212m\u00b7|j \u2212 i|", paths=_PER_OFFSET, plot=True, default_run=True,
             details=lambda m, n, c: {"slope": float(m.slopes[0])}),
    Encoding("rope", "RoPE", "Su et al. 2021", "rotary", lambda h, d, c, o: RotaryEmbedding(d, o["base"]),
             (Option("base", 10000.0, "rotary base theta", float),),
             summary="Queries and keys rotated by angles proportional to their positions.", paths="any (q, k rotated first)",
             default_run=True),
    Encoding("log_decay", "log-decay (fixed)", "the worked example", "additive bias",
             lambda h, d, c, o: LogDecayBias(o["scale"], num_heads=1),
             (Option("scale", 0.3, "penalty scale s", float, config_field="log_decay_scale", page=True),),
             summary="A fixed penalty that grows with the log of the distance.", formula="\u2212s\u00b7log(1 + |j \u2212 i|)",
             paths=_PER_OFFSET, plot=True, default_run=True, details=lambda m, n, c: {"scale": m.scale}),
    Encoding("shaw", "Shaw keys/values", "Shaw et al. 2018", "qk-vectors",
             lambda h, d, c, o: ShawRelativePosition(d, o["max_distance"]),
             (Option("max_distance", 8, "offsets past it share the end vectors", int, config_field="clip_distance"),),
             scope="layer", summary="Learned relative vectors added to keys and values, per layer.",
             paths="eager (relative keys and values)", default_run=True),
    Encoding("kerple", "Kerple (log)", "Chi et al. 2022", "additive bias",
             lambda h, d, c, o: KerpleBias(h, "log", r1=o["r1"], r2=o["r2"]), _KERPLE_OPTIONS,
             summary="A learned logarithmic kernel of the distance, \u2212r1\u00b7log(1 + r2\u00b7|j \u2212 i|), per head.",
             formula="\u2212r1\u00b7log(1 + r2\u00b7|j \u2212 i|)", paths=_PER_OFFSET, plot=True, details=_params),
    Encoding("kerple_power", "Kerple (power)", "Chi et al. 2022", "additive bias",
             lambda h, d, c, o: KerpleBias(h, "power", r1=o["r1"], r2=o["r2"]), _KERPLE_OPTIONS,
             summary="A learned power kernel of the distance, \u2212r1\u00b7|j \u2212 i|^r2 (0 < r2 \u2264 2), per head.",
             formula="\u2212r1\u00b7|j \u2212 i|^r2", paths=_PER_OFFSET, plot=True, details=_params),
    Encoding("sandwich", "Sandwich", "Chi et al. 2023", "additive bias",
             lambda h, d, c, o: SandwichBias(h, o["dim"] or h * d),
             (Option("dim", None, "sinusoid width d' (default heads x head_dim)", int, page=True),),
             summary="The inner product of two sinusoidal position embeddings, 0 on the diagonal, as a fixed bias.",
             formula="(\u03a3_k cos((j \u2212 i)\u00b710000^(\u22122k/d')) \u2212 d'/2) / (8h'/H)", paths=_PER_OFFSET, plot=True,
             details=lambda m, n, c: {"dim": m.dim}),
    Encoding("fire", "FIRE", "Li et al. 2024", "additive bias",
             lambda h, d, c, o: FIREBias(h, mlp_width=o["mlp_width"], init_c=o["init_c"], init_L=o["init_L"]),
             (Option("init_L", 512.0, "threshold L's initial value", float, page=True),
              Option("mlp_width", 32, "hidden width of the MLP", int), Option("init_c", 0.1, "initial c", float)),
             summary="A learned MLP of the log distance normalized by the query's position (the MLP at its seeded initialisation).",
             formula="f(\u03c8(i \u2212 j) / \u03c8(max(L, i)))",
             paths="per offset while every query is within L (as Kerple); past L the exact dense bias (eager, sdpa)",
             plot=True, details=_params),
    Encoding("xpos", "xPos", "Sun et al. 2023", "rotary", lambda h, d, c, o: XPos(d, scale_base=o["scale_base"]),
             (Option("scale_base", 512.0, "gamma", float),),
             summary="RoPE with an exponential decay of the score with distance.", paths="any (q, k rotated and scaled first)"),
    Encoding("forgetting", "forgetting gate (FoX)", "Lin et al. 2025", "gate",
             lambda h, d, c, o: ForgettingGate(o["dim"] or h * d, h),
             (Option("dim", None, "input width (default heads x head_dim)", int),), scope="layer",
             summary="Data-dependent decay: c_i \u2212 c_j from cumulative log forget gates of the input.",
             paths="-c_j folded into q.k: one SDPA call (any backend), no (B, H, L, L)"),
    Encoding("cope", "CoPE", "Golovneva et al. 2024", "qk-vectors",
             lambda h, d, c, o: CoPE(d, o["max_positions"]),
             (Option("max_positions", 64, "counted positions (npos_max)", int, config_field="train_len"),), scope="layer",
             summary="Positions counted by query-dependent gates, interpolated position vectors.", paths="eager only"),
    Encoding("window2d", "Swin 2D window", "Liu et al. 2021", "additive bias",
             lambda h, d, c, o: RelativePositionBias(h, (o["window_size"], o["window_size"]), init_std=o["init_std"]),
             (Option("window_size", 7, "window side", int), _INIT),
             summary="Swin: one learned number per 2D offset (dh, dw) inside the window; a cell's index is its "
                     "offset's slot in the table.",
             paths="dense (H, N, N) table per window", plot=True, sequence=False,
             details=lambda m, n, c: {"index": m.relative_position_index.tolist(),
                                      "table": m.relative_position_bias_table[:, 0].tolist()}),
)

#: every encoding by name, in the order lists and tables show them
ENCODINGS: dict[str, Encoding] = {e.name: e for e in _ALL}


def names(*, plot: bool | None = None, sequence: bool | None = None, default_run: bool | None = None) -> tuple[str, ...]:
    """The encodings' names, optionally only those with the given flags."""
    wanted = {"plot": plot, "sequence": sequence, "default_run": default_run}
    return tuple(n for n, e in ENCODINGS.items() if all(v is None or getattr(e, k) == v for k, v in wanted.items()))


def get(name: str) -> Encoding:
    if name not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}; got {name!r}")
    return ENCODINGS[name]


def markdown_table() -> str:
    """The table of docs/encodings/index.md: name, encoding, paper, kind, attention paths."""
    rows = ["| name | encoding | paper | kind | attention paths |", "|---|---|---|---|---|"]
    rows += [f"| `{e.name}` | {e.label} | {e.paper} | {e.kind} | {e.paths} |" for e in ENCODINGS.values()]
    return "\n".join(rows)

