"""``relpos bench``: attention with a T5 bias, relpos vs transformers vs SDPA with no bias.

Times (median over interleaved rounds) and peak extra resident memory of each variant, in one
process on one machine. transformers is imported only here (``pip install "relpos[dev]"``).

Modes:
* ``forward``: inference (``torch.no_grad``), bidirectional (encoder) attention.
* ``train``: forward + backward with a learnable bias table (gradients into q, k, v and the table).
* ``build``: building the bias for (L, L); ``decode``: one query against a cache of L keys.
* ``causal``: a decoder (causal) forward, and training with a learnable table.
* ``padded``: a batch of mixed lengths (``B`` examples filled to 100%, 87.5%, 62.5%, 50%, ...,
  right padding) with a key padding mask: forward, and training with a learnable table.
* ``dropout``: training with a learnable table and attention dropout 0.1.

Memory: on CPU the process's peak resident set (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) minus its resident set before the call; elsewhere it is reported as
``None``. On a CUDA device (``--device cuda``) the allocator's peak minus what was allocated before
the call, and every timed call is bracketed by ``torch.cuda.synchronize``. Inputs are allocated
before.
"""

from __future__ import annotations

import gc
import importlib.util
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import relpos

from .._cli import HelpFormatter
from .._io import write_report
from .._measure import add_device_arguments, device_arguments, fix_mmap_threshold, is_cuda, timed_rounds
from .._progress import Progress

__all__ = ["DESCRIPTION", "BenchConfig", "run_bench", "markdown_tables", "report_markdown", "fix_mmap_threshold", "add_device_arguments", "device_arguments"]

HEADS, HEAD_DIM, SCALE = 8, 64, 0.125
DESCRIPTION = (
    "Time attention with a T5 relative bias (8 heads of 64) through relpos against transformers' T5 attention "
    "and PyTorch's SDPA with no bias, at each sequence length, batch size and mode (forward, training, "
    "building the bias, decoding, causal, padded, dropout): the median over interleaved rounds and the peak "
    "extra memory, then the ratios against their goals. Prints markdown tables; writes files only with --json "
    "or --markdown. Needs transformers (pip install 'relpos[dev]')."
)


@dataclass
class BenchConfig:
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    batches: tuple[int, ...] = (1, 4)
    modes: tuple[str, ...] = ("build", "forward", "train", "decode", "causal", "padded", "dropout")
    rounds: int = 3
    memory_limit_gib: float = 14.0  # skip a variant whose (B, H, L, L) tensors would not fit
    flex: bool = True
    device: str = "cpu"
    dtype: str = "float32"

    def tensor(self, *shape: int, grad: bool = False) -> torch.Tensor:
        """Random inputs on the benchmark's device and dtype."""
        out = torch.randn(*shape, device=self.device, dtype=getattr(torch, self.dtype))
        return out.requires_grad_(grad)

    @property
    def cuda(self) -> bool:
        return is_cuda(self.device)


@dataclass
class Result:
    mode: str
    batch: int
    length: int
    variant: str
    ms: float | None
    peak_mib: float | None
    note: str = ""
    samples: list[float] = field(default_factory=list)


# --- variants ---------------------------------------------------------------------------------


def _hf(config: BenchConfig):
    try:
        from transformers import T5Config
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.t5.modeling_t5 import T5Attention, eager_attention_forward
    except ImportError as exc:  # pragma: no cover - exercised only without the dev extra
        raise SystemExit(f"relpos bench compares against transformers: pip install 'relpos[dev]' ({exc})")
    t5 = T5Config(d_model=HEADS * HEAD_DIM, d_kv=HEAD_DIM, num_heads=HEADS)
    hf = T5Attention(t5, has_relative_attention_bias=True, layer_idx=0).eval()
    return hf.to(config.device, getattr(torch, config.dtype)), eager_attention_forward, sdpa_attention_forward


def _variants(mode: str, batch: int, length: int, hf, hf_eager, hf_sdpa, ours, config: BenchConfig) -> dict[str, Callable]:
    """name -> zero-argument callable running one iteration (inputs captured)."""
    grad = mode == "train"
    q, k, v = (config.tensor(batch, HEADS, length, HEAD_DIM, grad=grad) for _ in range(3))  # (B, H, L, d)
    table_params = [hf.relative_attention_bias.weight, ours.relative_attention_bias.weight]
    for p in table_params:
        p.requires_grad_(grad)

    def reset_grads():
        for t in (q, k, v, *table_params):
            t.grad = None

    def step(fn):
        def run():
            if grad:
                reset_grads()
                fn().sum().backward()
            else:
                with torch.no_grad():
                    fn()

        return run

    def hf_run(kernel):
        return lambda: kernel(hf, q, k, v, None, scaling=SCALE, position_bias=hf.compute_bias(length, length))[0]

    out = {
        "sdpa_no_bias": step(lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE)),
        "hf_eager": step(hf_run(hf_eager)),
        "hf_sdpa": step(hf_run(hf_sdpa)),
        "relpos_sdpa": step(lambda: relpos.attention(q, k, v, bias=ours, scale=SCALE, backend="sdpa")),
    }
    if grad and not config.cuda:  # the fused backend is CPU's
        out["relpos_fused"] = step(lambda: relpos.attention(q, k, v, bias=ours, scale=SCALE, backend="fused"))
    if grad:
        out["relpos_auto"] = step(lambda: relpos.attention(q, k, v, bias=ours, scale=SCALE))

        def frozen():
            with torch.no_grad():
                offsets = ours.offsets(length, length)
            return relpos.attention(q, k, v, bias=offsets, scale=SCALE, backend="sdpa")

        out["sdpa_frozen_bias"] = step(frozen)
    elif config.flex:
        out["relpos_flex"] = step(lambda: relpos.attention(q, k, v, bias=ours, scale=SCALE, backend="flex"))
    if config.cuda:
        out.update({name: step(fn) for name, fn in _gpu_variants(q, k, v, ours, length, config).items()})
    return out


def _gpu_variants(q, k, v, ours, length: int, config: BenchConfig) -> dict[str, Callable]:
    """On CUDA: relpos's Triton kernel, and the ten-line FlexAttention a user would write instead (the per-offset
    vector gathered by ``kv - q`` in ``score_mod``, compiled once per shape; with ``config.flex``)."""
    out = {}
    if importlib.util.find_spec("triton") is not None:
        out["relpos_triton"] = lambda: relpos.attention(q, k, v, bias=ours, scale=SCALE, backend="triton")
    if config.flex:
        from ..backends._flex import _compiled_flex  # one compiled flex_attention per process, the backend's

        flex = _compiled_flex()
        last = length - 1

        def hand_flex():
            vec = ours.offsets(length, length).values  # (H, 2L - 1), the table's gradient through it
            return flex(q, k, v, score_mod=lambda s, b, h, qi, ki: s + vec[h, ki - qi + last], scale=SCALE)

        out["hand_flex"] = hand_flex
    return out


def _fits(variant: str, mode: str, batch: int, length: int, limit_gib: float) -> bool:
    dense = batch * HEADS * length * length * 4 / 2**30  # one fp32 (B, H, L, L) tensor (the bias is fp32 in any dtype)
    copies = {"hf_eager": 3, "hf_sdpa": 2, "relpos_sdpa": 0}.get(variant, 0)
    if mode == "train" and variant in ("hf_eager", "hf_sdpa", "relpos_sdpa"):
        copies = 5  # the math path keeps scores, weights and their gradients
    if variant == "sdpa_math_dropout":
        copies = 4  # SDPA's math kernel with dropout: scores, weights, dropout mask and gradients
    return copies * dense <= limit_gib


def run_bench(config: BenchConfig) -> dict:
    fixed = fix_mmap_threshold() if not config.cuda else None
    torch.manual_seed(0)
    hf, hf_eager, hf_sdpa = _hf(config)
    ours = relpos.RelativePositionalBias(HEADS, device=config.device, dtype=getattr(torch, config.dtype))
    ours.relative_attention_bias.load_state_dict(hf.relative_attention_bias.state_dict())
    plan = [(m, b, n) for m in _expand(config.modes) for b in config.batches for n in config.lengths]
    counts = {"build": 2, "decode": 3, "forward": 5, "train": 7, **{m: len(v) for m, v in REAL_VARIANTS.items()}}
    progress = Progress(sum(counts[m] * config.rounds for m, b, n in plan if m not in ("build", "decode") or b == 1))
    results: list[Result] = []
    for mode, batch, length in plan:
        label = f"{mode} B={batch} L={length}"
        if mode in ("build", "decode"):
            if batch != 1:
                continue
            variants = _micro_variants(mode, length, hf, ours, config)
        elif mode in REAL_VARIANTS:
            variants = _real_variants(mode, batch, length, hf, hf_sdpa, ours, config)
        else:
            variants = _variants(mode, batch, length, hf, hf_eager, hf_sdpa, ours, config)
        if mode not in ("build", "decode"):
            progress.total += (len(variants) - counts[mode]) * config.rounds  # the GPU's extra variants
        skipped = {n for n in variants if not _fits(n, mode, batch, length, config.memory_limit_gib)}
        for name in skipped:
            results.append(Result(mode, batch, length, name, None, None, f"skipped: over {config.memory_limit_gib} GiB"))
            del variants[name]
            progress.total -= config.rounds
        for name, (ms, peak, samples) in timed_rounds(variants, config.rounds, progress, label, config.cuda).items():
            results.append(Result(mode, batch, length, name, ms, peak, "", samples))
        del variants
        gc.collect()
    progress.close()
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "device": torch.cuda.get_device_name(config.device) if config.cuda else "cpu",
            "cpus": torch.get_num_threads(),
            "mmap_threshold_fixed": fixed,
            "torch": torch.__version__,
            "relpos": relpos.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "config": asdict(config),
        "results": [asdict(r) for r in results],
    }


REAL_VARIANTS = {  # the rows of the real-inputs modes, in table order
    "causal_forward": ("sdpa_causal_no_bias", "hf_sdpa", "relpos_auto"),
    "causal_train": ("sdpa_causal_no_bias", "sdpa_causal_frozen_bias", "relpos_auto"),
    "padded_forward": ("sdpa_padded_no_bias", "hf_sdpa", "relpos_auto"),
    "padded_train": ("sdpa_padded_no_bias", "sdpa_padded_frozen_bias", "relpos_auto"),
    "dropout_train": ("sdpa_frozen_bias", "relpos_auto_no_dropout", "relpos_auto", "sdpa_math_dropout"),
}
MODES = ("build", "forward", "train", "decode", "causal", "padded", "dropout")


def _expand(modes: tuple[str, ...]) -> list[str]:
    """``causal`` -> causal_forward, causal_train (and likewise ``padded``); ``dropout`` -> dropout_train."""
    out = []
    for mode in modes:
        out += [m for m in REAL_VARIANTS if m.startswith(mode + "_")] or [mode]
    return out


def padded_lengths(batch: int, length: int) -> list[int]:
    """Mixed real lengths of a padded batch: 100%, 87.5%, 62.5%, 50% of L, repeating."""
    fill = (1.0, 0.875, 0.625, 0.5)
    return [max(1, int(length * fill[b % 4])) for b in range(batch)]


def _real_variants(mode: str, batch: int, length: int, hf, hf_sdpa, ours, config: BenchConfig) -> dict[str, Callable]:
    """Padding, causal and dropout: each variant computes the same attention (tests check the relpos ones)."""
    grad = mode.endswith("_train")
    causal = mode.startswith("causal")
    q, k, v = (config.tensor(batch, HEADS, length, HEAD_DIM, grad=grad) for _ in range(3))  # (B, H, L, d)
    table = ours.relative_attention_bias.weight
    table.requires_grad_(grad)
    keep = None
    if mode.startswith("padded"):
        j = torch.arange(length, device=config.device)
        keep = torch.stack([j < n for n in padded_lengths(batch, length)])  # (B, L) right padding
    sdpa_mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, L) bool

    def step(fn):
        def run():
            if grad:
                for t in (q, k, v, table):
                    t.grad = None
                fn().sum().backward()
            else:
                with torch.no_grad():
                    fn()

        return run

    def frozen(**kw):
        def fn():
            with torch.no_grad():
                offsets = ours.offsets(length, length)
            return relpos.attention(q, k, v, bias=offsets, scale=SCALE, backend="sdpa", **kw)

        return fn

    def hf_run():
        position_bias = hf.compute_bias(length, length)  # (1, H, L, L)
        if causal:
            future = torch.ones(length, length, dtype=torch.bool, device=config.device).triu(1)  # (L, L)
            position_bias = position_bias.masked_fill(future, float("-inf"))
        if keep is not None:
            position_bias = position_bias.masked_fill(~sdpa_mask, torch.finfo(position_bias.dtype).min)  # (B, H, L, L)
        return hf_sdpa(hf, q, k, v, None, scaling=SCALE, position_bias=position_bias)[0]

    kw = {"causal": causal, "key_mask": keep}
    all_variants = {
        "sdpa_causal_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE),
        "sdpa_padded_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=SCALE),
        "hf_sdpa": hf_run,
        "relpos_auto": lambda: relpos.attention(
            q, k, v, bias=ours, scale=SCALE, dropout_p=0.1 if mode == "dropout_train" else 0.0, **kw
        ),
        "relpos_auto_no_dropout": lambda: relpos.attention(q, k, v, bias=ours, scale=SCALE, **kw),
        "sdpa_causal_frozen_bias": frozen(**kw),
        "sdpa_padded_frozen_bias": frozen(**kw),
        "sdpa_frozen_bias": frozen(**kw),
        "sdpa_math_dropout": lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, scale=SCALE),
    }
    return {name: step(all_variants[name]) for name in REAL_VARIANTS[mode]}


def _micro_variants(mode: str, length: int, hf, ours, config: BenchConfig) -> dict[str, Callable]:
    def no_grad(fn):
        """Sub-millisecond calls: time enough of them (about 20 ms) per sample, report one call."""
        with torch.no_grad():
            start = time.perf_counter()
            fn()
            once = time.perf_counter() - start
        repeats = max(1, min(200, int(0.02 / max(once, 1e-6))))

        def run():
            with torch.no_grad():
                for _ in range(repeats):
                    fn()

        run.repeats = repeats
        return run

    if mode == "build":
        return {
            "hf_compute_bias": no_grad(lambda: hf.compute_bias(length, length)),
            "relpos_offsets": no_grad(lambda: ours.offsets(length, length)),
        }
    q = config.tensor(1, HEADS, 1, HEAD_DIM)  # (1, H, 1, d)
    k, v = (config.tensor(1, HEADS, length, HEAD_DIM) for _ in range(2))  # (1, H, L, d)
    return {  # one decoding step with `length` keys in the cache
        "recompute_full_bias": no_grad(lambda: hf.compute_bias(length, length)[:, :, -1:]),
        "relpos_bias_row": no_grad(lambda: ours.offsets(1, length, q_offset=length - 1)),
        "relpos_decode_step": no_grad(
            lambda: relpos.attention(q, k, v, bias=ours, causal=True, q_offset=length - 1, scale=SCALE)
        ),
    }


# --- reporting --------------------------------------------------------------------------------


def _lookup(results: list[dict]) -> dict:
    return {(r["mode"], r["batch"], r["length"], r["variant"]): r for r in results}


def markdown_tables(report: dict) -> str:
    results = report["results"]
    table = _lookup(results)
    lines = []
    for mode in ("forward", "train", "build", "decode", *REAL_VARIANTS):
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        lines += [f"### {mode}", "", "| B | L | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
        for batch, length in dict.fromkeys((r["batch"], r["length"]) for r in rows):
            cells = []
            for name in variants:
                r = table.get((mode, batch, length, name))
                if r is None or r["ms"] is None:
                    cells.append("skipped" if r is not None else "")
                    continue
                mem = "" if r["peak_mib"] is None or mode in ("build", "decode") else f" / {r['peak_mib']:.0f} MiB"
                cells.append((f"{r['ms']:.3f} ms" if r["ms"] < 1 else f"{r['ms']:.1f} ms") + mem)
            lines.append(f"| {batch} | {length} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def ratio_summary(report: dict, length: int = 4096) -> list[tuple[str, str, str]]:
    """(claim, measured, target) rows for the issue's targets, from one report."""
    t = _lookup(report["results"])

    def get(mode, batch, variant, key="ms"):
        r = t.get((mode, batch, length, variant))
        return None if r is None else r[key]

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    def fmt(x, suffix="x"):
        return "n/a" if x is None else f"{x:.2f}{suffix}"

    rows = [
        ("build T5 bias: compute_bias / relpos per-offset", fmt(ratio(get("build", 1, "hf_compute_bias"), get("build", 1, "relpos_offsets"))), ">= 1000x"),
    ]
    for b in (1, 4):
        rows += [
            (f"forward B={b}: relpos_sdpa / sdpa_no_bias", fmt(ratio(get("forward", b, "relpos_sdpa"), get("forward", b, "sdpa_no_bias"))), "<= 1.15x"),
            (f"forward B={b}: hf_eager / relpos_sdpa", fmt(ratio(get("forward", b, "hf_eager"), get("forward", b, "relpos_sdpa"))), ">= 6x"),
            (f"train B={b}: hf_eager / relpos_auto", fmt(ratio(get("train", b, "hf_eager"), get("train", b, "relpos_auto"))), ">= 2.5x"),
            (f"train B={b}: relpos_auto / sdpa_frozen_bias", fmt(ratio(get("train", b, "relpos_auto"), get("train", b, "sdpa_frozen_bias"))), "<= 1.5x"),
        ]
    rows += [
        ("peak memory forward B=4: relpos_sdpa / hf_eager", fmt(ratio(get("forward", 4, "relpos_sdpa", "peak_mib"), get("forward", 4, "hf_eager", "peak_mib"))), "<= 0.25x"),
        ("peak memory train B=4: relpos_auto / hf_eager", fmt(ratio(get("train", 4, "relpos_auto", "peak_mib"), get("train", 4, "hf_eager", "peak_mib"))), "<= 0.25x"),
        ("decode: recompute full bias / relpos whole decode step", fmt(ratio(get("decode", 1, "recompute_full_bias"), get("decode", 1, "relpos_decode_step"))), ">= 10x"),
        ("decode: recompute full bias / relpos bias row", fmt(ratio(get("decode", 1, "recompute_full_bias"), get("decode", 1, "relpos_bias_row"))), ">= 10x"),
    ]
    for b in (1, 4):
        rows += [
            (f"causal forward B={b}: relpos_auto / sdpa_causal_no_bias", fmt(ratio(get("causal_forward", b, "relpos_auto"), get("causal_forward", b, "sdpa_causal_no_bias"))), "<= 1.15x"),
            (f"causal train B={b}: relpos_auto / sdpa_causal_frozen_bias", fmt(ratio(get("causal_train", b, "relpos_auto"), get("causal_train", b, "sdpa_causal_frozen_bias"))), "<= 1.5x"),
        ]
    rows += [
        ("padded forward B=4: relpos_auto / sdpa_padded_no_bias", fmt(ratio(get("padded_forward", 4, "relpos_auto"), get("padded_forward", 4, "sdpa_padded_no_bias"))), "<= 1.15x"),
        ("padded train B=4: relpos_auto / sdpa_padded_frozen_bias", fmt(ratio(get("padded_train", 4, "relpos_auto"), get("padded_train", 4, "sdpa_padded_frozen_bias"))), "<= 1.5x"),
        ("peak extra memory, padded forward B=4: relpos_auto", fmt(get("padded_forward", 4, "relpos_auto", "peak_mib"), " MiB"), "< 512 MiB"),
        ("peak extra memory, padded train B=4: relpos_auto", fmt(get("padded_train", 4, "relpos_auto", "peak_mib"), " MiB"), "< 512 MiB"),
        ("peak extra memory, causal forward B=4: relpos_auto", fmt(get("causal_forward", 4, "relpos_auto", "peak_mib"), " MiB"), "< 512 MiB"),
        ("dropout 0.1 train B=4: time relpos_auto / relpos_auto_no_dropout", fmt(ratio(get("dropout_train", 4, "relpos_auto"), get("dropout_train", 4, "relpos_auto_no_dropout"))), "stated"),
        ("dropout 0.1 train B=4: peak extra memory relpos_auto / relpos_auto_no_dropout", f"{fmt(get('dropout_train', 4, 'relpos_auto', 'peak_mib'), ' MiB')} / {fmt(get('dropout_train', 4, 'relpos_auto_no_dropout', 'peak_mib'), ' MiB')}", "alike"),
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="relpos bench", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser) -> None:
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192", help="comma-separated sequence lengths L")
    parser.add_argument("--batches", default="1,4", help="comma-separated batch sizes B")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, among {', '.join(MODES)}"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds per variant (the median is reported)")
    parser.add_argument("--no-flex", action="store_true", help="skip the compiled flex backend (compiles per shape)")
    add_device_arguments(parser)
    parser.add_argument("--json", help="write the full report (every sample) to this file (default: none, not written)")
    parser.add_argument("--markdown", help="write the tables to this file (default: none, printed only)")


MAX_BENCH_LENGTH, MAX_BENCH_BATCH, MAX_BENCH_ROUNDS = 32768, 64, 100  # transformers' eager T5 at L=32768 is 4 GiB per head


def _sizes(option: str, text: str, largest: int) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1 or max(values) > largest:
        raise ValueError(f"{option} must be integers from 1 to {largest}, got {text!r}")
    return values


def run_from_args(args) -> int:
    if not 1 <= args.rounds <= MAX_BENCH_ROUNDS:
        raise ValueError(f"--rounds must be from 1 to {MAX_BENCH_ROUNDS}, got {args.rounds}")
    config = BenchConfig(
        lengths=_sizes("--lengths", args.lengths, MAX_BENCH_LENGTH),
        batches=_sizes("--batches", args.batches, MAX_BENCH_BATCH),
        modes=tuple(args.modes.split(",")),
        rounds=args.rounds,
        flex=not args.no_flex,
        **device_arguments(args),
    )
    unknown = set(config.modes) - set(MODES)
    if unknown:
        raise ValueError(f"--modes must be among {', '.join(MODES)}; got {sorted(unknown)}")
    report = run_bench(config)
    text = report_markdown(report)
    print(text)
    write_report(report, text, args.json, args.markdown)
    return 0


def report_markdown(report: dict) -> str:
    """What ``--markdown`` writes: the machine, :func:`markdown_tables` and the targets table (:func:`ratio_summary`
    at L = 4096, or the longest length run). ``tools/bench_tables.py`` renders the committed tables with it; a
    report from before ``device`` and ``dtype`` were recorded is rendered without them."""
    machine, config = report["machine"], report["config"]
    length = 4096 if 4096 in config["lengths"] else max(config["lengths"])
    summary = [f"| target, measured at L={length} | measured | goal (set for L=4096) |", "|---|---|---|"]
    summary += [f"| {a} | {b} | {c} |" for a, b, c in ratio_summary(report, length)]
    if length != 4096:
        summary += ["", f"Measured at L={length}, not 4096: at short lengths fixed per-call costs dominate, so these "
                        "ratios do not say whether the L=4096 goals are met (run with --lengths 4096 for that)."]
    where = ", ".join([machine["processor"], *([machine["device"]] if "device" in machine else []), f"{machine['cpus']} threads",
                       *([config["dtype"]] if "dtype" in config else []), f"torch {machine['torch']}", f"transformers {machine['transformers']}"])
    return f"machine: {where}\n\n" + markdown_tables(report) + "\n" + "\n".join(summary) + "\n"
