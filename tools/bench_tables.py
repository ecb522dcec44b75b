"""Every benchmark table under docs/benchmarks/ rendered from its committed JSON, so prose and numbers cannot drift.

    python tools/bench_tables.py            # rewrite each page's generated regions from the JSON beside it
    python tools/bench_tables.py --check    # exit 1 listing each region whose committed text differs

A page holds one or more regions, each opened by ``<!-- generated from NAME.json by tools/bench_tables.py: do not
edit -->`` and closed by ``<!-- end generated -->`` (``relpos._io.generated_begin``); the prose around them is the
page's own. Each region is rendered by the function of the script that produced the JSON (the same function its
``--markdown`` writes with, so re-running a table's command rewrites the same region): ``relpos.hf.bench`` for the
model tables, ``relpos.tools.bench`` (``relpos bench``) for the attention tables, and ``benchmarks/ring.py``,
``swin.py``, ``sam.py``, ``encoding_timings.py``, ``eager_paths.py``, ``bias_build.py``, ``decoding_step.py``,
``triton_host.py``,
``tools/gpu_kernel_report.py`` and ``tools/kernel_anatomy.py``.
The headline tables (``HEADLINES``: docs/benchmarks/index.md and each area's index.md) take each number from
one table's JSON too. ``--check`` also fails on a region no spec renders and on a JSON under docs/benchmarks/ that
no table is rendered from (``NOT_RENDERED`` lists the exceptions and why).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
sys.path.insert(0, str(ROOT / "src"))

from relpos._io import generated_begin, generated_region, replace_generated  # noqa: E402


@functools.cache
def script(path: str):
    """A benchmark script (or tool) of this checkout as a module, by path: benchmarks/ and tools/ stay off
    sys.path (a script named like a standard module would shadow it, as benchmarks/encodings.py once did)."""
    spec = importlib.util.spec_from_file_location("bench_tables_" + Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def load(source: str | Path, docs: Path = DOCS) -> Any:
    """A table's JSON (a ``.jsonl`` file: the list of its lines)."""
    text = (docs / source).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()] if str(source).endswith(".jsonl") else json.loads(text)


# --- renderers: the JSON -> the region's text, each the producing script's own function -------------------------


def model_tables(report: dict) -> str:  # benchmarks/t5_model.py (relpos.hf.bench)
    from relpos.hf.bench import report_markdown

    return report_markdown(report)


def attention_tables(report: dict) -> str:  # relpos bench (benchmarks/attention.py)
    from relpos.tools.bench import report_markdown

    return report_markdown(report)


def ring_table(payload: dict) -> str:
    return script("benchmarks/ring.py").page(payload)


def swin_tables(report: dict) -> str:
    return script("benchmarks/swin.py").markdown(report)


def sam_table(mode: str) -> Callable[[dict], str]:
    return lambda payload: script("benchmarks/sam.py").page(payload, mode)


def encodings_table(run: dict) -> str:
    return script("benchmarks/encoding_timings.py").markdown(run)


def eager_paths_table(records: list[dict]) -> str:
    return script("benchmarks/eager_paths.py").markdown(records)


def bias_build_table(payload: dict) -> str:
    return script("benchmarks/bias_build.py").page(payload)


def gpu_kernel_tables(payload: dict) -> str:
    return script("tools/gpu_kernel_report.py").report(payload)


def kernel_anatomy_table(payload: dict) -> str:
    return script("tools/kernel_anatomy.py").page(payload)


def decoding_step_table(payload: dict) -> str:
    return script("benchmarks/decoding_step.py").page(payload)


def triton_host_table(payload: dict) -> str:
    return script("benchmarks/triton_host.py").page(payload)


@dataclass(frozen=True)
class Table:
    """A region of ``page`` (under docs/benchmarks/) rendered from ``source`` (under docs/benchmarks/)."""

    page: str
    source: str
    render: Callable[[Any], str]
    part: str | None = None

    @property
    def begin(self) -> str:
        return generated_begin(self.source, self.part)

    def text(self, docs: Path = DOCS) -> str:
        return self.render(load(self.source, docs)).rstrip("\n") + "\n"


def _same_name(area: str, names: list[str], render) -> list[Table]:
    return [Table(f"{area}/{n}.md", f"{area}/{n}.json", render) for n in names]


TABLES: list[Table] = [
    *_same_name("attention", ["forward", "train", "real", "causal"], attention_tables),
    Table("attention/bias-build.md", "attention/bias-build.json", bias_build_table),
    *_same_name("gpu", ["attention"], attention_tables),
    *_same_name("gpu", ["t5", "bloom", "mpt"], model_tables),
    Table("gpu/kernel-tables.md", "gpu/kernel.json", gpu_kernel_tables),
    Table("gpu/kernel-sweep-tables.md", "gpu/kernel-sweep.json", gpu_kernel_tables),
    Table("gpu/kernel-anatomy.md", "gpu/kernel-anatomy.json", kernel_anatomy_table),
    *[Table("gpu/kernel-anatomy-decomposed.md", f"gpu/kernel-anatomy-decomposed{run}.json", kernel_anatomy_table)
      for run in ("", "-before")],
    *[Table("gpu/kernel-anatomy-compare.md", f"gpu/kernel-anatomy{run}.json", kernel_anatomy_table)
      for run in ("-before-ramp", "-before-branch", "-triton3.9", "-backward-tiles", "-tiles")],
    *[Table("gpu/decoding-step.md", f"gpu/decoding-step{run}.json", decoding_step_table) for run in ("", "-before", "-static", "-compiled")],
    *[Table("gpu/triton-host.md", f"gpu/triton-host{run}.json", triton_host_table) for run in ("", "-before")],
    *_same_name("t5-family", [
        "t5", "t5-target", "t5-layer", "umt5-target", "switch_transformers", "switch_transformers-grid",
        "longt5-quiet", "longt5-tglobal-quiet", "longt5-grid-forward", "longt5-grid-generate", "longt5-grid-train",
        "pix2struct-quiet", "pix2struct-grid-forward", "pix2struct-grid-generate", "pix2struct-grid-train",
        "pop2piano-quiet", "pop2piano-grid-forward", "pop2piano-grid-generate", "pop2piano-grid-train",
        "udop-quiet", "udop-grid-forward", "udop-grid-generate", "udop-grid-train-B1", "udop-grid-train-B4",
        "udop-grid-train-dense", "t5-static", "t5-static-compiled"], model_tables),
    *_same_name("alibi-families", [
        "bloom", "bloom-quiet", "bloom-grid", "mpt", "mpt-quiet", "mpt-quiet-forward", "mpt-grid-forward",
        "mpt-grid-generate", "mpt-grid-train", "falcon", "falcon-grid-forward", "falcon-grid-generate",
        "falcon-grid-generate-short", "falcon-grid-train", "bloom-static", "bloom-static-compiled"], model_tables),
    *_same_name("vision", ["swin", "swin-w8-train-quiet", "swin-train-floor"], swin_tables),
    *[Table("vision/sam.md", "vision/sam.json", sam_table(mode), part=mode) for mode in ("forward", "train", "encoder", "window")],
    Table("encodings/timings.md", "encodings/timings.json", encodings_table),
    Table("encodings/index.md", "encodings/eager-paths.jsonl", eager_paths_table),
    *_same_name("distributed", ["ring", "ring-floor"], ring_table),
    # docs/distributed.md shows both ring tables in its own text: the same regions, from the same JSON
    Table("../distributed.md", "distributed/ring.json", ring_table),
    Table("../distributed.md", "distributed/ring-floor.json", ring_table),
]

#: JSON under docs/benchmarks/ that no table is rendered from, and why.
NOT_RENDERED: dict[str, str] = {}


# --- each table's command, from its JSON ---------------------------------------------------------------------------


def _paths(table: Table) -> str:
    return f"--json docs/benchmarks/{table.source} --markdown docs/benchmarks/{table.page}"


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def model_command(report: dict, table: Table) -> str:
    """The ``benchmarks/t5_model.py`` command that runs the report's configuration (one thread: ``OMP_NUM_THREADS=1``)."""
    c, machine = report["config"], report["machine"]
    words = [*(["OMP_NUM_THREADS=1"] if machine["cpus"] == 1 else []), "python benchmarks/t5_model.py",
             *([f"--family {c['family']}"] if "family" in c else []),
             f"--lengths {_csv(c['lengths'])} --batches {_csv(c['batches'])} --modes {_csv(c['modes'])} --rounds {c['rounds']}",
             f"--d-model {c['d_model']} --heads {c['heads']} --layers {c['layers']}",
             *([f"--device {c['device']} --dtype {c['dtype']}"] if c.get("device", "cpu") != "cpu" else []),
             *(["--compile-cpu"] if c.get("compile_cpu") else []),
             *([f"--new-tokens {c['new_tokens']}"] if c.get("new_tokens", 32) != 32 else []),
             *([f"--memory-limit-gib {c['memory_limit_gib']:g}"] if c["memory_limit_gib"] != 14 else []), _paths(table)]
    return " ".join(words)


def attention_command(report: dict, table: Table) -> str:
    """The ``relpos bench`` command that runs the report's configuration."""
    c = report["config"]
    words = ["relpos bench", f"--lengths {_csv(c['lengths'])} --batches {_csv(c['batches'])} --modes {_csv(c['modes'])}",
             f"--rounds {c['rounds']}", *(["--no-flex"] if not c["flex"] else []),
             *([f"--device {c['device']} --dtype {c['dtype']}"] if c.get("device", "cpu") != "cpu" else []),
             *([f"--memory-limit-gib {c['memory_limit_gib']:g}"] if c["memory_limit_gib"] != 14 else []), _paths(table)]
    return " ".join(words)


DEFAULTS = {"device": "cpu", "dtype": "float32"}  # benchmarks' --device / --dtype: a command names them only when set


def swin_command(report: dict, table: Table) -> str:
    c = report["config"]
    return (f"python benchmarks/swin.py --family {c['family']} --windows {' '.join(map(str, c['windows']))} "
            f"--modes {' '.join(c['modes'])} --rounds {c['rounds']} --batch {c['batch']} --threads {c['threads']} "
            + "".join(f"--{key} {c[key]} " for key in ("device", "dtype") if c.get(key, DEFAULTS[key]) != DEFAULTS[key])
            + _paths(table))


def bias_build_command(payload: dict, table: Table) -> str:
    return f"python benchmarks/bias_build.py --lengths {_csv(r['L'] for r in payload['rows'])} --heads {payload['heads']} {_paths(table)}"


def recorded_command(payload: Any, table: Table) -> str:
    """The command the run recorded in its JSON (ring, encodings; SAM per mode)."""
    return payload["modes"][table.part]["command"] if table.part is not None else payload["command"]


def gpu_kernel_command(payload: dict, table: Table) -> str:
    """The recorded command, writing into a folder OUT, and the copy of its JSON that the table is rendered from."""
    words = payload["command"].split()
    if "--out" in words:
        words[words.index("--out") + 1] = "OUT"
    return " ".join(words) + f" && cp OUT/gpu-kernel.json docs/benchmarks/{table.source} && python tools/bench_tables.py"


def eager_paths_command(records: list[dict], table: Table) -> str:
    return ("for i in 1 2; do PYTHONPATH=/path/to/old/src python benchmarks/eager_paths.py --label old; "
            f"PYTHONPATH=src python benchmarks/eager_paths.py --label new; done >> docs/benchmarks/{table.source}")


def command(table: Table, docs: Path = DOCS) -> str:
    """The command that writes ``table`` (its JSON and its region), derived from the JSON."""
    how = {model_tables: model_command, attention_tables: attention_command, swin_tables: swin_command,
           bias_build_table: bias_build_command, eager_paths_table: eager_paths_command,
           gpu_kernel_tables: gpu_kernel_command}.get(table.render, recorded_command)
    return how(load(table.source, docs), table)


# --- the headline tables: each number from one table's JSON ------------------------------------------------------


def _results(report: dict) -> dict:
    """(mode, batch, length, variant) -> row, for the reports of relpos bench and relpos.hf.bench."""
    return {(r["mode"], r["batch"], r["length"], r["variant"]): r for r in report["results"] if "batch" in r}


def ratio(report: dict, point: tuple, over: str, under: str, key: str = "ms") -> float:
    """``over``'s ``key`` / ``under``'s at ``point`` = (mode, batch, length)."""
    rows = _results(report)
    return rows[(*point, over)][key] / rows[(*point, under)][key]


def fastest_hf(report: dict, point: tuple) -> str:
    """transformers' fastest variant's time over relpos's at ``point``, as the model tables state it."""
    rows = _results(report)
    best = min((rows[(*point, v)] for v in ("hf_eager", "hf_sdpa") if rows.get((*point, v)) and rows[(*point, v)]["ms"]),
               key=lambda r: r["ms"])
    return f"{best['ms'] / rows[(*point, 'relpos')]['ms']:.2f}x ({best['variant'][3:]})"


def x(value: float) -> str:
    return f"{value:.2f}x"


@dataclass(frozen=True)
class Claim:
    """One row of a headline table: ``what`` was measured and the text ``measure`` reads from the JSON of the table
    at ``table`` (a page under docs/benchmarks/; ``part`` picks one of its regions)."""

    what: str
    table: str
    measure: Callable[[Any], str]
    part: str | None = None

    def spec(self) -> Table:
        return next(t for t in TABLES if t.page == self.table and t.part == self.part)


def _link(table: str, page: str) -> str:
    """The link from ``page`` to ``table`` (both relative to docs/benchmarks/; ``page`` may lie outside it)."""
    here = os.path.normpath(os.path.join("docs/benchmarks", os.path.dirname(page)))
    return os.path.relpath(os.path.join("docs/benchmarks", table), here)


def headline(claims: list[Claim], page: str, docs: Path = DOCS) -> str:
    """The table of ``claims`` as it appears on ``page`` (links relative to it); the README's omits the commands
    (its table links to each table, which gives its command)."""
    readme = page == README
    lines = ["| what | measured | table |" if readme else "| what | measured | table, and the command that writes it |",
             "|---|---|---|"]
    for c in claims:
        spec = c.spec()
        link = _link(c.table, page)
        cell = f"[{c.table[:-3]}]({link})" if readme else f"[{link[:-3]}]({link}): `{command(spec, docs)}`"
        lines.append(f"| {c.what} | {c.measure(load(spec.source, docs))} | {cell} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Headline(Table):
    """The headline region of ``page``: the rows ``HEADLINES[page]``, each from its own table's JSON."""

    def text(self, docs: Path = DOCS) -> str:
        return headline(HEADLINES[self.page], self.page, docs)


@dataclass(frozen=True)
class Listing(Table):
    """An area page's list of the area's tables (``DESCRIPTIONS``), each with the command that writes it."""

    def text(self, docs: Path = DOCS) -> str:
        area = os.path.dirname(self.page)
        lines = ["| table | what it measures | command |", "|---|---|---|"]
        for t in TABLES:
            if os.path.dirname(t.page) == area and t.page != self.page and t.part in (None, "forward"):
                name = os.path.basename(t.page)
                lines.append(f"| [{name[:-3]}]({name}) | {DESCRIPTIONS[t.page]} | `{command(t, docs)}` |")
        return "\n".join(lines) + "\n"


AREAS = ("attention", "gpu", "t5-family", "alibi-families", "vision", "encodings", "distributed")

#: One line per table page, for its area's listing.
DESCRIPTIONS: dict[str, str] = {
    "attention/forward.md": "run A: forward, building the bias, decoding (and a first training table), L 512 to 8192",
    "attention/train.md": "run B: a training step with a learnable table, L 512 to 8192",
    "attention/real.md": "causal, padded and dropout inputs, L 1024 and 4096",
    "attention/causal.md": "a second run of the causal rows, 5 rounds",
    "attention/bias-build.md": "building the T5 bias: transformers' `compute_bias` against relpos per offset",
    "gpu/attention.md": "`relpos bench` on an H200, bf16: the routes `auto` took before the Triton kernel",
    "gpu/t5.md": "a 2-layer T5 model on an H100, bf16, against transformers, compiled static-cache generation included",
    "gpu/kernel-tables.md": "the Triton kernel on an H100 against no position term, the earlier routes, FlexAttention and the "
                            "FlashBias fold (forwards, with the current tiles)",
    "gpu/kernel-sweep-tables.md": "the Triton kernel on an H100: the tile sweep and every case, training, dropout and padding "
                                  "included (one tile shape for every forward)",
    "gpu/kernel-anatomy.md": "what the Triton kernel compiles to for an H100, without a GPU: registers, shared memory, "
                             "blocks per SM and each loop's instructions, per variant and tile shape",
    "gpu/kernel-anatomy-compare.md": "the same, for the kernel the GPU last timed, the backward before its branches, "
    "with Triton 3.9 (CI's) and dk/dv with 8 warps",
    "gpu/kernel-anatomy-decomposed.md": "SAM's decomposed-positions Triton kernels compiled for an H100, without a GPU, "
                                        "now and before their loop order, base-2 logits and dq stages changed",
    "gpu/decoding-step.md": "the host's share of a T5 and a Bloom decoding step (time, operators, reads back), "
                            "relpos against transformers, measured on the CPU",
    "gpu/triton-host.md": "the CPU time of one Triton-route attention call before its kernels start (relpos's Python, "
                          "its operators, Triton's launcher), measured without a GPU",
    "gpu/bloom.md": "a 2-layer Bloom model on an H100, bf16, against transformers (forward only: training crashed, a kernel bug fixed since)",
    "gpu/mpt.md": "a 2-layer MPT model on an H100, bf16, against transformers (forward only: training crashed, a kernel bug fixed since)",
    "t5-family/t5.md": "T5: the grid, L 512 to 4096, B 1 and 4",
    "t5-family/t5-target.md": "T5: the target point, L 2048, B 2",
    "t5-family/t5-static.md": "T5: greedy generation with the dynamic and the static cache (uncompiled, CPU), L 512 and 1024",
    "t5-family/t5-static-compiled.md": "T5: greedy generation, the static cache's decoding step compiled (inductor, CPU), "
                                       "L 512 and 1024",
    "t5-family/t5-layer.md": "T5: one layer, L 4096, B 2",
    "t5-family/umt5-target.md": "UMT5: the target point, L 2048, B 2",
    "t5-family/switch_transformers.md": "SwitchTransformers: the target point, quiet machine",
    "t5-family/switch_transformers-grid.md": "SwitchTransformers: the grid, a loaded run",
    "t5-family/longt5-quiet.md": "LongT5 local encoder, L 8192, quiet machine",
    "t5-family/longt5-tglobal-quiet.md": "LongT5 transient-global encoder, L 8192, quiet machine",
    "t5-family/longt5-grid-forward.md": "LongT5 grid, forward",
    "t5-family/longt5-grid-generate.md": "LongT5 grid, generation",
    "t5-family/longt5-grid-train.md": "LongT5 grid, training step",
    "t5-family/pix2struct-quiet.md": "Pix2Struct text decoder, L 2048, quiet machine",
    "t5-family/pix2struct-grid-forward.md": "Pix2Struct grid, forward",
    "t5-family/pix2struct-grid-generate.md": "Pix2Struct grid, generation",
    "t5-family/pix2struct-grid-train.md": "Pix2Struct grid, training step",
    "t5-family/pop2piano-quiet.md": "Pop2Piano encoder, L 2048, quiet machine",
    "t5-family/pop2piano-grid-forward.md": "Pop2Piano grid, forward",
    "t5-family/pop2piano-grid-generate.md": "Pop2Piano grid, generation",
    "t5-family/pop2piano-grid-train.md": "Pop2Piano grid, training step",
    "t5-family/udop-quiet.md": "UDOP encoder, L 2048, quiet machine",
    "t5-family/udop-grid-forward.md": "UDOP grid, forward",
    "t5-family/udop-grid-generate.md": "UDOP grid, generation",
    "t5-family/udop-grid-train-B1.md": "UDOP grid, training step, B 1 (per-tile layout bias, before the dense path)",
    "t5-family/udop-grid-train-B4.md": "UDOP grid, training step, B 4 (per-tile layout bias, before the dense path)",
    "t5-family/udop-grid-train-dense.md": "UDOP training step, B 4, after the change to a dense layout bias in training",
    "alibi-families/bloom.md": "Bloom: the target point, one thread, loaded machine",
    "alibi-families/bloom-quiet.md": "Bloom: the target point, quiet machine, 2 threads",
    "alibi-families/bloom-grid.md": "Bloom: the grid, a loaded run",
    "alibi-families/bloom-static.md": "Bloom: greedy generation with the dynamic and the static cache (uncompiled, CPU), L 512 and 1024",
    "alibi-families/bloom-static-compiled.md": "Bloom: greedy generation, the static cache's decoding step compiled "
                                               "(inductor, CPU), L 512 and 1024",
    "alibi-families/mpt.md": "MPT: the target point, one thread, loaded machine",
    "alibi-families/mpt-quiet.md": "MPT: the target point, quiet machine, 2 rounds",
    "alibi-families/mpt-quiet-forward.md": "MPT: the target point's forward, quiet machine, 7 rounds",
    "alibi-families/mpt-grid-forward.md": "MPT grid, forward",
    "alibi-families/mpt-grid-generate.md": "MPT grid, generation",
    "alibi-families/mpt-grid-train.md": "MPT grid, training step",
    "alibi-families/falcon.md": "Falcon (`alibi=True`): the target point, one thread, loaded machine",
    "alibi-families/falcon-grid-forward.md": "Falcon grid, forward",
    "alibi-families/falcon-grid-generate.md": "Falcon grid, generation",
    "alibi-families/falcon-grid-generate-short.md": "Falcon generation, L 512 and 1024, 3 rounds",
    "alibi-families/falcon-grid-train.md": "Falcon grid, training step",
    "vision/swin.md": "Swin V2 against transformers and timm, windows 8 and 16, forward and training",
    "vision/swin-w8-train-quiet.md": "Swin V2 training, window 8, 9 rounds on a quiet machine",
    "vision/swin-train-floor.md": "Swin V2 training against its floor (no position bias): the ceiling of any position term",
    "vision/sam.md": "SAM ViT-B: a global layer (forward, training), a windowed layer and the image encoder",
    "encodings/timings.md": "Kerple, Sandwich, FIRE, forgetting gates and xPos against SDPA with no bias (and RoPE)",
    "distributed/ring.md": "ring attention on 2 CPU processes against one process, L 16384 and 32768",
    "distributed/ring-floor.md": "the same two processes with no ring: the machine's cost apart from the ring's",
}

_L4096 = 4096


def _two(report: dict, mode: str, length: int, over: str, under: str, key: str = "ms") -> str:
    return " / ".join(x(ratio(report, (mode, b, length), over, under, key)) for b in (1, 4))


def _peak(report: dict, point: tuple, variant: str) -> float:
    return _results(report)[(*point, variant)]["peak_mib"]


def _models(report: dict, point: tuple, modes=("forward", "train", "generate")) -> str:
    return " / ".join(fastest_hf(report, (mode, *point)) for mode in modes)


def _ring(payload: dict, length: int, mode: str) -> str:
    s = next(s for s in payload["summary"] if s["length"] == length and s["mode"] == mode)
    return f"time {x(s['time_ratio'])}, per-rank peak memory {x(s['memory_ratio'])}"


def _swin(report: dict, mode: str, ours: str = "relpos") -> str:
    by = {(r["mode"], r["window"], r["variant"]): r for r in report["results"]}
    return " / ".join(x(by[(mode, w, "hf_eager")]["ms"] / by[(mode, w, ours)]["ms"]) for w in report["config"]["windows"])


def _sam(payload: dict, mode: str = "forward") -> str:
    r = payload["modes"][mode]["results"]
    return (f"{x(r['hf_sdpa']['ms'] / r['relpos_tiles']['ms'])} faster, "
            f"{x(r['relpos_tiles']['peak_mib'] / r['hf_sdpa']['peak_mib'])} the memory")


def _kernel(payload: dict, case: str, length: int = 16384, over: str = "relpos_triton", under: str | None = None) -> str:
    res = payload["results"][str(length)][case]
    return x(res[over]["ms"] / (res[under] if under else next(iter(res.values())))["ms"])


def _encodings(run: dict, length: int = _L4096) -> str:
    t = run["timings_ms"]
    base = t[f"sdpa (no bias)|{length}|forward"]
    ratios = [t[f"{n}|{length}|forward"] / base for n in ("kerple", "sandwich", "fire (i <= L)", "forgetting")]
    xpos = t[f"xpos|{length}|forward"] / t[f"rope|{length}|forward"]
    return f"{x(min(ratios))} to {x(max(ratios))} the time; xPos {x(xpos)} RoPE's"


_ATTENTION = [
    Claim("CPU attention with a T5 bias against SDPA with no position term (forward, L = 4096, B = 1 / 4)",
          "attention/forward.md", lambda r: _two(r, "forward", _L4096, "relpos_sdpa", "sdpa_no_bias") + " the time"),
    Claim("transformers' eager T5 attention against relpos (forward, L = 4096, B = 1 / 4)",
          "attention/forward.md", lambda r: _two(r, "forward", _L4096, "hf_eager", "relpos_sdpa") + " relpos's time; "
          f"peak memory (B = 4) {_peak(r, ('forward', 4, _L4096), 'relpos_sdpa'):.0f} against "
          f"{_peak(r, ('forward', 4, _L4096), 'hf_eager'):.0f} MiB"),
    Claim("CPU training step with a learnable T5 table against a frozen bias (L = 4096, B = 1 / 4)",
          "attention/train.md", lambda r: _two(r, "train", _L4096, "relpos_auto", "sdpa_frozen_bias") + " the time"),
    Claim("CPU causal forward with a T5 bias against SDPA `is_causal` with no bias (L = 4096, B = 1 / 4)",
          "attention/real.md", lambda r: _two(r, "causal_forward", _L4096, "relpos_auto", "sdpa_causal_no_bias") + " the time"),
]

_T5 = [
    Claim("T5 model against transformers' fastest attention (L = 2048, B = 2; forward / training / generation)",
          "t5-family/t5-target.md", lambda r: _models(r, (2, 2048)) + " faster"),
]

_ALIBI = [
    Claim("Bloom against transformers (L = 2048, B = 2; forward / training / generation)",
          "alibi-families/bloom-quiet.md", lambda r: _models(r, (2, 2048)) + " faster"),
    Claim("MPT forward against transformers (L = 2048, B = 2, 7 rounds)",
          "alibi-families/mpt-quiet-forward.md", lambda r: _models(r, (2, 2048), ("forward",)) + " faster"),
]

_VISION = [
    Claim("Swin V2 forward against transformers' eager Swinv2 (window 8 / 16)", "vision/swin.md",
          lambda r: _swin(r, "forward") + " faster"),
    Claim("SAM ViT-B global attention layer against transformers' sdpa (forward, 1024 x 1024)", "vision/sam.md",
          _sam, part="forward"),
]

_GPU = [
    Claim("GPU (H100, bf16): a T5 bias in relpos's Triton kernel against attention with no position term "
          "(forward, L = 16384)", "gpu/kernel-tables.md", lambda p: f"{_kernel(p, 't5_forward')} the time"),
    Claim("GPU (H100, bf16): a T5 table's training step in relpos's Triton kernel against attention with no position "
          "term (L = 16384)", "gpu/kernel-sweep-tables.md", lambda p: f"{_kernel(p, 't5_train')} the time"),
    Claim("GPU (H200, bf16): transformers' T5 attention (sdpa) against relpos (forward, L = 16384, B = 1)", "gpu/attention.md",
          lambda r: f"{x(ratio(r, ('forward', 1, 16384), 'hf_sdpa', 'relpos_sdpa'))} relpos's time; peak memory "
          f"{_peak(r, ('forward', 1, 16384), 'relpos_sdpa'):.0f} against {_peak(r, ('forward', 1, 16384), 'hf_sdpa'):.0f} MiB"),
]

_DISTRIBUTED = [
    Claim("Context parallel: ring attention on 2 CPU processes against 1 (training step, L = 32768)",
          "distributed/ring.md", lambda p: _ring(p, 32768, "training step")),
]

_ENCODINGS = [
    Claim("Kerple, Sandwich, FIRE and forgetting gates against SDPA with no bias (causal forward, L = 4096)",
          "encodings/timings.md", _encodings),
]

def _ms_mib(report: dict, point: tuple, variant: str) -> str:
    r = _results(report)[(*point, variant)]
    return f"{r['ms']:.0f} ms / {r['peak_mib']:.0f} MiB"


_ATTENTION_MORE = [
    Claim("building the bias: transformers' `compute_bias` against relpos per offset (L = 4096)", "attention/forward.md",
          lambda r: x(ratio(r, ("build", 1, _L4096), "hf_compute_bias", "relpos_offsets")) + " relpos's time"),
    Claim("a decoding step at a 4096-key cache: recomputing the full bias against relpos's whole step",
          "attention/forward.md", lambda r: x(ratio(r, ("decode", 1, _L4096), "recompute_full_bias", "relpos_decode_step"))),
    Claim("transformers' eager T5 against relpos, training a learnable table (L = 4096, B = 1 / 4)", "attention/train.md",
          lambda r: _two(r, "train", _L4096, "hf_eager", "relpos_auto") + " relpos's time"),
    Claim("padded forward against SDPA with the same padding and no bias (L = 4096, B = 4)", "attention/real.md",
          lambda r: x(ratio(r, ("padded_forward", 4, _L4096), "relpos_auto", "sdpa_padded_no_bias")) + " the time"),
    Claim("training with attention dropout 0.1 against without (L = 4096, B = 4; time, peak memory)", "attention/real.md",
          lambda r: x(ratio(r, ("dropout_train", 4, _L4096), "relpos_auto", "relpos_auto_no_dropout")) + "; "
          f"{_peak(r, ('dropout_train', 4, _L4096), 'relpos_auto'):.0f} against "
          f"{_peak(r, ('dropout_train', 4, _L4096), 'relpos_auto_no_dropout'):.0f} MiB (SDPA's math kernel with dropout: "
          f"{_peak(r, ('dropout_train', 4, _L4096), 'sdpa_math_dropout'):.0f} MiB)"),
    Claim("a second run of the causal rows, 5 rounds (L = 4096, B = 1 / 4)", "attention/causal.md",
          lambda r: _two(r, "causal_forward", _L4096, "relpos_auto", "sdpa_causal_no_bias") + " the time of `is_causal`"),
]

_GPU_MORE = [
    Claim("GPU (H100): the Triton kernel against the route `auto` took before (T5 forward, L = 16384)",
          "gpu/kernel-tables.md", lambda p: _kernel(p, "t5_forward", over="relpos_sdpa", under="relpos_triton") + " faster"),
    Claim("GPU (H200): transformers' T5 attention (sdpa) against relpos, training a learnable table (L = 16384, B = 1)",
          "gpu/attention.md", lambda r: x(ratio(r, ("train", 1, 16384), "hf_sdpa", "relpos_auto")) + " relpos's time; peak memory "
          f"{_peak(r, ('train', 1, 16384), 'relpos_auto'):.0f} against {_peak(r, ('train', 1, 16384), 'hf_sdpa'):.0f} MiB"),
    Claim("GPU (H200): causal forward before the kernel against `is_causal` with no bias (L = 16384, B = 1 / 4)",
          "gpu/attention.md", lambda r: _two(r, "causal_forward", 16384, "relpos_auto", "sdpa_causal_no_bias") + " the time"),
    Claim("GPU (H100): a T5 model against transformers' fastest (L = 4096, B = 2; forward / training / generation)",
          "gpu/t5.md", lambda r: _models(r, (2, 4096)) + " faster"),
]

_T5_MORE = [
    Claim("UMT5 against transformers' fastest (L = 2048, B = 2; forward / training / generation)",
          "t5-family/umt5-target.md", lambda r: _models(r, (2, 2048)) + " faster"),
    Claim("SwitchTransformers against transformers (L = 2048, B = 2; forward / training)",
          "t5-family/switch_transformers.md", lambda r: _models(r, (2, 2048), ("forward", "train")) + " faster"),
    Claim("LongT5 local encoder (L = 8192, B = 1)", "t5-family/longt5-quiet.md",
          lambda r: _models(r, (1, 8192), ("forward",)) + " faster"),
    Claim("LongT5 transient-global encoder (L = 8192, B = 1)", "t5-family/longt5-tglobal-quiet.md",
          lambda r: _models(r, (1, 8192), ("forward",)) + " faster"),
    Claim("UDOP encoder (L = 2048, B = 2)", "t5-family/udop-quiet.md", lambda r: _models(r, (2, 2048), ("forward",)) + " faster"),
    Claim("Pix2Struct text decoder (L = 2048, B = 2)", "t5-family/pix2struct-quiet.md",
          lambda r: _models(r, (2, 2048), ("forward",)) + " faster"),
    Claim("Pop2Piano encoder (L = 2048, B = 2)", "t5-family/pop2piano-quiet.md",
          lambda r: _models(r, (2, 2048), ("forward",)) + " faster"),
]

_ALIBI_MORE = [
    Claim("MPT against transformers (L = 2048, B = 2, 2 rounds; forward / training / generation)",
          "alibi-families/mpt-quiet.md", lambda r: _models(r, (2, 2048)) + " faster"),
    Claim("Falcon (`alibi=True`) against transformers (L = 2048, B = 2, one thread, loaded; forward / training / generation)",
          "alibi-families/falcon.md", lambda r: _models(r, (2, 2048)) + " faster"),
]

_VISION_MORE = [
    Claim("Swin V2 training step against transformers' eager Swinv2 (window 8 / 16)", "vision/swin.md",
          lambda r: _swin(r, "train") + " faster"),
    Claim("Swin V2 training step with no position term at all (the floor) against transformers' eager (window 8 / 16): "
          "the ceiling of any position term", "vision/swin-train-floor.md",
          lambda r: _swin(r, "train", "floor") + " faster"),
    Claim("SAM ViT-B global layer, training step against transformers' sdpa", "vision/sam.md",
          lambda p: _sam(p, "train"), part="train"),
    Claim("SAM ViT-B image encoder against transformers' sdpa (forward, 1024 x 1024, one round)", "vision/sam.md",
          lambda p: (f"{x(p['modes']['encoder']['results']['hf_sdpa']['ms'] / p['modes']['encoder']['results']['relpos']['ms'])} "
                     f"faster, {x(p['modes']['encoder']['results']['relpos']['peak_mib'] / p['modes']['encoder']['results']['hf_sdpa']['peak_mib'])} the memory"),
          part="encoder"),
]

_DISTRIBUTED_MORE = [
    Claim("ring attention on 2 CPU processes against 1 (forward, L = 16384 / 32768)", "distributed/ring.md",
          lambda p: _ring(p, 16384, "forward") + " / " + _ring(p, 32768, "forward")),
    Claim("the same two processes with no ring: each rank's rows against every key held locally (forward / training step, L = 16384)",
          "distributed/ring-floor.md", lambda p: " / ".join(
              f"{x(s['no_ring_ratio'])} of one process's time (ring: {x(s['time_ratio'])})" for s in p["summary"] if s["length"] == 16384)),
]


def _encoding_train(run: dict, length: int = _L4096) -> str:
    t = run["timings_ms"]
    base = t[f"sdpa (no bias)|{length}|train"]
    ratios = [t[f"{n}|{length}|train"] / base for n in ("kerple", "sandwich", "fire (i <= L)", "forgetting")]
    return f"{x(min(ratios))} to {x(max(ratios))} the time"


def _eager(records: list[dict], encoding: str) -> str:
    def faster(key: str) -> str:
        old, new = (statistics.median(r[encoding][key] for r in records if r["label"] == label) for label in ("old", "new"))
        return x(old / new)

    return f"evaluation {faster('eval_ms')}, training step {faster('step_ms')} faster"


_ENCODINGS_MORE = [
    Claim("the same encodings, a training step against SDPA with no bias (L = 4096)", "encodings/timings.md", _encoding_train),
    Claim("Shaw's relative vectors in the experiment's model, after the eager-path changes against before", "encodings/index.md",
          lambda records: _eager(records, "shaw")),
]

README = "../../README.md"  # the repository's README, relative to docs/benchmarks/

HEADLINES: dict[str, list[Claim]] = {
    README: [_ATTENTION[0], _ATTENTION[1], *_T5, _ALIBI[0], _VISION[1], _GPU[0], *_DISTRIBUTED],
    "index.md": [*_ATTENTION, *_T5, *_ALIBI, *_VISION, *_GPU, *_DISTRIBUTED, *_ENCODINGS],
    "attention/index.md": [*_ATTENTION, *_ATTENTION_MORE],
    "gpu/index.md": [*_GPU, *_GPU_MORE],
    "t5-family/index.md": [*_T5, *_T5_MORE],
    "alibi-families/index.md": [*_ALIBI, *_ALIBI_MORE],
    "vision/index.md": [*_VISION, *_VISION_MORE],
    "distributed/index.md": [*_DISTRIBUTED, *_DISTRIBUTED_MORE],
    "encodings/index.md": [*_ENCODINGS, *_ENCODINGS_MORE],
}


def headline_tables() -> list[Table]:
    return [*(Headline(page, "each table's JSON", headline, part="headline") for page in HEADLINES),
            *(Listing(f"{area}/index.md", "each table's JSON", headline, part="tables") for area in AREAS)]


# --- check / write ----------------------------------------------------------------------------------------------


def all_tables() -> list[Table]:
    return TABLES + headline_tables()


def problems(docs: Path = DOCS, write: bool = False) -> list[str]:
    """What differs between the pages and their JSON (with ``write``: fix what can be fixed, report the rest)."""
    found, pages = [], {}
    for table in all_tables():
        path = docs / table.page
        page = pages.setdefault(table.page, path.read_text() if path.exists() else None)
        if page is None:
            found.append(f"{table.page}: missing (its region is rendered from {table.source})")
            continue
        try:
            text = table.text(docs)
        except Exception as error:  # noqa: BLE001 - report every table, not the first failure
            found.append(f"{table.page} ({table.source}): cannot render: {type(error).__name__}: {error}")
            continue
        old = generated_region(page, table.begin)
        if old is None:
            found.append(f"{table.page}: no region opened by {table.begin!r}")
        elif old != text:
            if write:
                pages[table.page] = replace_generated(page, table.begin, text)
            else:
                found.append(f"{table.page}: the region generated from {table.source}{f' ({table.part})' if table.part else ''} "
                             "differs from what the JSON gives (run python tools/bench_tables.py)")
    if write:
        for name, page in pages.items():
            if page is not None and page != (docs / name).read_text():
                (docs / name).write_text(page)
    begins = {(t.page, t.begin) for t in all_tables()}
    for path in sorted(docs.rglob("*.md")):
        name = path.relative_to(docs).as_posix()
        for line in path.read_text().splitlines():
            if line.startswith("<!-- generated from ") and (name, line) not in begins:
                found.append(f"{name}: a region no spec renders: {line}")
    sources = {t.source for t in TABLES}
    for path in sorted([*docs.rglob("*.json"), *docs.rglob("*.jsonl")]):
        name = path.relative_to(docs).as_posix()
        if name not in sources and name not in NOT_RENDERED:
            found.append(f"{name}: no table is rendered from it (add it to TABLES or NOT_RENDERED)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 listing each table that differs")
    parser.add_argument("--docs", type=Path, default=DOCS, help=argparse.SUPPRESS)  # the tests check a copy
    args = parser.parse_args(argv)
    found = problems(args.docs, write=not args.check)
    for line in found:
        print(line)
    if args.check and not found:
        print(f"{len(all_tables())} generated regions match their JSON")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
