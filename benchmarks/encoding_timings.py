"""The new encodings against SDPA with no bias (and xPos against RoPE): docs/benchmarks/encodings/timings.md.

Causal self-attention, B=1, H=8, d=64, fp32, CPU. For each length, every variant's forward
(``torch.no_grad``) and training step (forward + backward into q, k, v and the encoding's own
parameters or gates) is timed in interleaved rounds (one call of each variant per round, the
median over rounds), so a slow phase of a shared machine hits every variant alike. Peak extra
memory is measured in a fresh process per variant (``--memory``): the growth of the peak RSS
over the process's size before the call.

    python benchmarks/encoding_timings.py --lengths 2048,4096 --rounds 5 --memory \
        --json docs/benchmarks/encodings/timings.json --markdown docs/benchmarks/encodings/timings.md

``--markdown`` into a page holding a region generated from the ``--json`` file replaces that region and keeps
the prose around it (``tools/bench_tables.py`` renders the same region from the committed JSON).
The ``(denormals kept)`` variants turn relpos's flushing off (``relpos.backends._denormals.ENABLED = False``)
around each call: what denormal floats would cost Sandwich and the forgetting gates.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import relpos
from relpos._io import write_report
from relpos.backends import _denormals

HEADS, DIM = 8, 64

# name: (what it is compared with, the target ratio or None)
VARIANTS: dict[str, tuple[str, float | None]] = {
    "sdpa (no bias)": ("sdpa (no bias)", None),
    "kerple": ("sdpa (no bias)", 1.2),
    "sandwich": ("sdpa (no bias)", 1.2),
    "sandwich (denormals kept)": ("sdpa (no bias)", None),
    "fire (i <= L)": ("sdpa (no bias)", 1.2),
    "fire (L = 512 < i)": ("sdpa (no bias)", None),
    "forgetting": ("sdpa (no bias)", 1.2),
    "forgetting (denormals kept)": ("sdpa (no bias)", None),
    "rope": ("sdpa (no bias)", None),
    "xpos": ("rope", 1.1),
    "cope": ("sdpa (no bias)", None),
}


def _inputs(length: int, train: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, length, DIM, generator=g).requires_grad_(train) for _ in range(3))
    return q, k, v


def _denormals_kept(call):
    """``call`` with relpos's flushing of denormal floats turned off (``relpos.backends._denormals.ENABLED``)."""
    def kept():
        _denormals.ENABLED = False
        try:
            call()
        finally:
            _denormals.ENABLED = True
    return kept


def make(name: str, length: int, train: bool):
    """A closure running one call of ``name`` (and its backward when ``train``)."""
    torch.manual_seed(0)
    q, k, v = _inputs(length, train)
    if name == "sdpa (no bias)":
        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    elif name in ("kerple", "sandwich", "sandwich (denormals kept)", "fire (i <= L)", "fire (L = 512 < i)"):
        bias = {
            "kerple": lambda: relpos.KerpleBias(HEADS, "log"),
            "sandwich": lambda: relpos.SandwichBias(HEADS, HEADS * DIM),
            "sandwich (denormals kept)": lambda: relpos.SandwichBias(HEADS, HEADS * DIM),
            "fire (i <= L)": lambda: relpos.FIREBias(HEADS, init_L=float(length)),
            "fire (L = 512 < i)": lambda: relpos.FIREBias(HEADS),
        }[name]()
        run = lambda: relpos.attention(q, k, v, bias=bias, causal=True)  # noqa: E731
    elif name.startswith("forgetting"):
        logits = torch.randn(1, HEADS, length).add_(3.0).requires_grad_(train)  # gates near 0.95: a real decay
        gated = lambda: relpos.gated_attention(q, k, v, F.logsigmoid(logits).cumsum(-1), causal=True)  # noqa: E731
        run = gated
    elif name in ("rope", "xpos"):
        rotary = relpos.RotaryEmbedding(DIM, interleaved=True) if name == "rope" else relpos.XPos(DIM)

        def run():
            qr, kr = rotary(q, k)
            return F.scaled_dot_product_attention(qr, kr, v, is_causal=True)
    elif name == "cope":
        cope = relpos.CoPE(DIM, 64, init_std=0.02)
        run = lambda: cope.attention(q, k, v, causal=True)  # noqa: E731
    else:
        raise ValueError(f"unknown variant {name!r}")
    if not train:
        def call():
            with torch.no_grad():
                run()
    else:
        call = lambda: run().sum().backward()  # noqa: E731
    return _denormals_kept(call) if name.endswith("(denormals kept)") else call


def timings(lengths, rounds: int, names) -> dict:
    results = {}
    for length in lengths:
        for train in (False, True):
            calls = {n: make(n, length, train) for n in names}
            for call in calls.values():  # warm-up
                call()
            seen = {n: [] for n in names}
            for _ in range(rounds):
                for n, call in calls.items():
                    start = time.perf_counter()
                    call()
                    seen[n].append(time.perf_counter() - start)
            mode = "train" if train else "forward"
            for n in names:
                results[f"{n}|{length}|{mode}"] = statistics.median(seen[n]) * 1000
            print(f"L={length} {mode}: " + ", ".join(f"{n} {results[f'{n}|{length}|{mode}']:.0f} ms" for n in names), flush=True)
    return results


def memory_of(name: str, length: int, train: bool) -> float:
    """Peak extra MiB of one call of ``name``, in a fresh process."""
    code = (  # this file is loaded by path: its name would clash with the standard library's `encodings`
        "import gc, importlib.util as u; "
        f"s = u.spec_from_file_location('bench_encodings', {__file__!r}); b = u.module_from_spec(s); s.loader.exec_module(b); "
        f"call = b.make({name!r}, {length}, {train}); call(); gc.collect(); "  # a first call: lazy buffers and caches
        # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS, so the imports'
        # own high-water mark (larger than one call at these sizes) does not hide the call's
        "open('/proc/self/clear_refs', 'w').write('5'); "
        "kb = lambda key: int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]); "
        "before = kb('VmRSS:'); call(); print((kb('VmHWM:') - before) / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def markdown(run: dict) -> str:
    """The table of one run (the dict ``--json`` writes), as ``--markdown`` writes it and ``tools/bench_tables.py``
    renders it from the committed JSON."""
    results, memory, m = run["timings_ms"], run["peak_extra_mib"], run["machine"]
    lines = [
        f"## {run['title']}",
        "",
        f"Command: `{run['command']}`",
        "",
        f"Machine: {m['machine']}, {m['cpus']} CPUs, torch threads: {m['threads']}, torch {m['torch']}; load average "
        f"{m['load']:.1f} at the start, {m['time']} (the variants are interleaved, one call of each per round, so a slow "
        "phase hits all of them; ratios are the figures to read).",
        "",
        "Causal self-attention, B = 1, H = 8, d = 64, fp32. Forward: under `torch.no_grad`; train: forward + backward "
        "into q, k, v and the encoding's parameters (gates for the forgetting gate). Median ms over the rounds; the "
        "ratio is to the variant named under 'vs' at the same length and mode. Peak extra MiB: the growth of the "
        "peak RSS during one call after a first one, in a fresh process (Linux: the peak is reset before the call; one (1, 8, L, L) fp32 tensor is 128 MiB at L = 2048 and "
        "512 MiB at L = 4096).",
        "",
        "| variant | L | vs | forward ms | ratio | target | train ms | ratio | forward peak MiB | train peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for length in run["lengths"]:
        for name, (base, target) in VARIANTS.items():
            key = f"{name}|{length}"
            if f"{key}|forward" not in results:
                continue
            fwd, trn = results[f"{key}|forward"], results[f"{key}|train"]
            rf, rt = fwd / results[f"{base}|{length}|forward"], trn / results[f"{base}|{length}|train"]
            met = "" if target is None else (f"<= {target}x: {'met' if rf <= target else 'missed'}")
            mem = [memory.get(f"{key}|{m}") for m in ("forward", "train")]
            mem = ["" if m is None else f"{m:.0f}" for m in mem]
            lines.append(f"| {name} | {length} | {base} | {fwd:.0f} | {rf:.2f} | {met} | {trn:.0f} | {rt:.2f} | {mem[0]} | {mem[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 on a machine shared with other jobs: a 2-thread op waits at each "
                             "barrier for a thread the scheduler has parked)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--skip", default="", help="variant|length pairs to leave out, e.g. 'cope|4096'")
    parser.add_argument("--memory", action="store_true", help="also measure peak extra memory (a process per variant)")
    parser.add_argument("--json", help="write the run (timings, memory, machine, command) here")
    parser.add_argument("--markdown", help="write the table here: into the page's region generated from --json, "
                        "the prose around it kept")
    parser.add_argument("--title", default="Timings and memory", help="the table's heading")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    names = [n for n in args.variants.split(",") if n]
    skip = set(filter(None, args.skip.split(",")))
    load = os.getloadavg()[0]
    results = {}
    for length in lengths:
        chosen = [n for n in names if f"{n}|{length}" not in skip]
        results.update(timings([length], args.rounds, chosen))
    memory = {}
    if args.memory:
        for length in lengths:
            for n in names:
                if f"{n}|{length}" in skip:
                    continue
                for train in (False, True):
                    memory[f"{n}|{length}|{'train' if train else 'forward'}"] = memory_of(n, length, train)
                print(f"memory L={length} {n}: {memory[f'{n}|{length}|forward']:.0f} / {memory[f'{n}|{length}|train']:.0f} MiB", flush=True)
    env = " ".join(f"{k}={os.environ[k]}" for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ)
    words = [f"'{w}'" if " " in w or "|" in w else w for w in (argv if argv is not None else sys.argv[1:])]
    command = f"{env} PYTHONPATH=src python benchmarks/encoding_timings.py ".lstrip() + " ".join(words)
    run = {
        "title": args.title, "command": command, "lengths": lengths, "timings_ms": results, "peak_extra_mib": memory,
        "machine": {"machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "load": load, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    }
    write_report(run, markdown(run), args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
