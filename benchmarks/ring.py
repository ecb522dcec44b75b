"""Context-parallel (ring) attention on 2 CPU processes against one process computing the whole attention.

    python benchmarks/ring.py --lengths 16384 32768 --rounds 3 \
        --json docs/benchmarks/distributed/ring.json --markdown docs/benchmarks/distributed/ring.md

Two gloo processes with one thread each. In every round, in alternating order: rank 0 alone runs
``relpos.attention`` over the whole sequence (one thread; rank 1 waits at a barrier), then both ranks run
``relpos.distributed.ring_attention`` over their halves. Forward (no gradient) and a training step (forward +
backward into q, k, v and T5's bias table). Time: wall time between barriers, median over rounds, with nothing
else running in the processes. Memory: in a second pair of processes, one call of each variant with the resident
set sampled every millisecond by a thread, above what it was just before (the call's own allocations, the
gradients of q, k and v included; glibc set to return freed blocks at once), plus the inputs the process holds
(q, k, v). Neither the sampler nor that allocator setting is present in a timed call: on a 2-core machine the
sampler is a third busy thread while both ranks compute (but has a core to itself while one process runs alone),
and the setting costs the ring's per-block allocations page faults (:func:`measure`); both slowed the ring only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import relpos
import relpos.distributed as rd
from relpos._io import write_report

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The largest resident set seen while the block runs, sampled every millisecond by a thread."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _inputs(length: int, args, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(args.batch, args.heads, length, args.dim, generator=g) for _ in range(3)]


def _bias(args):
    torch.manual_seed(0)
    return relpos.T5RelativeBias(args.heads, 32, 128, bidirectional=not args.causal)


def _run(fn, q, k, v, bias, train: bool) -> None:
    if not train:
        with torch.no_grad():
            fn(q, k, v, bias)
        return
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    bias.zero_grad()
    fn(q, k, v, bias).sum().backward()


def _time(fn, q, k, v, bias, train: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    _run(fn, q, k, v, bias, train)
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds


def _peak(fn, q, k, v, bias, train: bool) -> int:
    dist.barrier()
    with PeakRSS() as mem:
        _run(fn, q, k, v, bias, train)
    dist.barrier()
    held = sum(t.numel() * t.element_size() for t in (q, k, v))  # the inputs (their gradients are allocated in the call)
    return mem.extra + held


def _call(measure, variant: str, rank: int, calls: dict, train: bool):
    """``measure`` of one variant on this rank: the one-process variant runs on rank 0 while rank 1 keeps step
    with its barriers (and returns None)."""
    fn, *inputs = calls[variant]
    if variant == "one process" and rank != 0:
        dist.barrier()
        dist.barrier()
        return None
    return measure(fn, *inputs, train)


def _worker(rank: int, world: int, directory: str, args, phase: str) -> None:
    """One phase on one rank: ``"time"`` (interleaved rounds) or ``"memory"`` (one call of each variant)."""
    dist.init_process_group("gloo", init_method=f"file://{directory}/store-{phase}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    layout = "zigzag" if args.causal else "contiguous"
    bias = _bias(args)
    one = lambda q, k, v, b: relpos.attention(q, k, v, bias=b, causal=args.causal, scale=1.0)  # noqa: E731
    variants = ("one process", "ring") + (("no ring",) if args.floor else ())
    sharded = lambda q, k, v, b: rd.ring_attention(q, k, v, bias=b, causal=args.causal, scale=1.0, layout=layout, timeout=3600)  # noqa: E731
    rows = []
    for length in args.lengths:
        full = _inputs(length, args)
        part = [rd.shard(t, 2, rank, world, layout).contiguous() for t in full]
        # the floor: each rank computes its own rows against every key, held locally (same work, no messages)
        alone = lambda q, k, v, b: relpos.attention(q, k, v, bias=b, scale=1.0, q_offset=rank * (length // world))  # noqa: E731
        calls = {"ring": (sharded, *part, bias), "no ring": (alone, part[0], full[1], full[2], bias), "one process": (one, *full, bias)}
        for train in (False, True):
            _run(sharded, *[t[:, :, :256] for t in part], bias, train)  # warm up both paths at a small size
            row = {"length": length, "train": train, "rank": rank}
            if phase == "memory":
                row["peaks"] = {variant: _call(_peak, variant, rank, calls, train) for variant in variants}
            else:
                row["samples"] = _timed(variants, rank, calls, train, args.rounds, f"L={length} {'training step' if train else 'forward'}")
            rows.append(row)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(f"{directory}/rows-{phase}.json", "w") as f:
            json.dump([row for ranks in gathered for row in ranks], f)
    rd.exit_process(0)  # a barrier, the group destroyed, no interpreter teardown: a gloo thread can abort it


def _timed(variants: tuple[str, ...], rank: int, calls: dict, train: bool, rounds: int, label: str) -> dict:
    samples = {variant: [] for variant in variants}
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            samples[variant].append(_call(_time, variant, rank, calls, train))
        if rank == 0:
            print(f"{label} round {r + 1}/{rounds}", flush=True)
    return samples


def _phase(phase: str, directory: str, args) -> list[dict]:
    mp.spawn(_worker, args=(2, directory, args, phase), nprocs=2, join=True)
    with open(f"{directory}/rows-{phase}.json") as f:
        return json.load(f)


def measure(args) -> list[dict]:
    """Every rank's rows: timing samples from processes with glibc's default allocator, peaks from fresh
    processes told to map every allocation above 128 KiB on its own and unmap it on free (so the resident set
    follows live memory instead of keeping freed heap pages). That setting is a measuring device: it costs the
    ring, which allocates per block, page faults the one process does not pay as often (0.55x against 0.50x
    of one process's forward at L = 16384 in a trial), so no timed call runs under it."""
    directory = tempfile.mkdtemp(prefix="relpos-bench-ring-")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    timed = _phase("time", directory, args)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by the workers' allocator at start
    peaks = {(r["length"], r["train"], r["rank"]): r["peaks"] for r in _phase("memory", directory, args)}
    return [{**r, "peaks": peaks[r["length"], r["train"], r["rank"]]} for r in timed]


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (length, mode): medians, the ring's slowest rank, ratios and memory."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        for train in (False, True):
            mine = [r for r in rows if r["length"] == length and r["train"] == train]
            one = next(r for r in mine if r["rank"] == 0)
            ring_by_round = list(zip(*[r["samples"]["ring"] for r in mine]))  # per round: every rank's seconds
            ring_time = statistics.median(max(ranks) for ranks in ring_by_round)
            ring_mem = max(r["peaks"]["ring"] for r in mine)
            one_time, one_mem = statistics.median(one["samples"]["one process"]), one["peaks"]["one process"]
            floor = list(zip(*[r["samples"].get("no ring", []) for r in mine]))
            floor_time = statistics.median(max(ranks) for ranks in floor) if floor else None
            out.append({
                "length": length, "mode": "training step" if train else "forward",
                "one_process_s": one_time, "ring_s": ring_time, "time_ratio": ring_time / one_time,
                "no_ring_s": floor_time, "no_ring_ratio": None if floor_time is None else floor_time / one_time,
                "one_process_peak_mib": one_mem / 2**20, "ring_rank_peak_mib": ring_mem / 2**20, "memory_ratio": ring_mem / one_mem,
            })
    return out


def markdown(summary: list[dict], args, machine: str) -> str:
    lines = [
        f"B = {args.batch}, H = {args.heads}, d = {args.dim}, fp32, T5 bias ({'causal, zigzag layout' if args.causal else 'bidirectional, contiguous layout'}), "
        f"2 gloo processes x 1 thread against 1 process x 1 thread; {args.rounds} rounds interleaved; {machine}.",
        "",
        "| L | mode | one process (s) | ring, 2 processes (s) | ring / one | one-process peak (MiB) | ring per-rank peak (MiB) | ring / one |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if args.floor:
        lines[2:4] = [
            "| L | mode | one process (s) | ring, 2 processes (s) | ring / one | no ring, 2 processes (s) | no ring / one |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {s['length']} | {s['mode']} | {s['one_process_s']:.2f} | {s['ring_s']:.2f} | {s['time_ratio']:.2f} | "
            f"{s['no_ring_s']:.2f} | {s['no_ring_ratio']:.2f} |"
            for s in summary
        ]
        return "\n".join(lines) + "\n"
    for s in summary:
        lines.append(
            f"| {s['length']} | {s['mode']} | {s['one_process_s']:.2f} | {s['ring_s']:.2f} | {s['time_ratio']:.2f} | "
            f"{s['one_process_peak_mib']:.0f} | {s['ring_rank_peak_mib']:.0f} | {s['memory_ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def page(payload: dict) -> str:
    """What ``--markdown`` writes, from what ``--json`` wrote: the command, then :func:`markdown` of :func:`summarize`
    of the raw samples (``tools/bench_tables.py`` renders the committed tables with it). A JSON whose rows predate
    the separate memory call (no ``peaks``) is rendered from the summary it holds, which that run's
    :func:`summarize` computed."""
    args = parser().parse_args(shlex.split(payload["command"])[2:])
    rows = payload["rows"]
    summary = summarize(rows) if all("peaks" in row for row in rows) else payload["summary"]
    return f"Command: `{payload['command']}`\n\n" + markdown(summary, args, payload["machine"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768], help="whole-sequence lengths")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per length and mode")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--causal", action="store_true", help="causal attention, zigzag layout")
    p.add_argument("--floor", action="store_true",
                   help="also time 'no ring': each process computes its rows against every key held locally (same work, no messages)")
    p.add_argument("--json", help="write the raw samples and the summary here")
    p.add_argument("--markdown", help="write the summary table here (into the page's region generated from --json)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.floor and args.causal:
        p.error("--floor times the bidirectional case only (its rows-against-every-key split is contiguous)")
    rows = measure(args)
    command = "python benchmarks/ring.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload = {"command": command, "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}",
               "summary": summarize(rows), "rows": rows}
    text = page(payload)
    print(text)
    write_report(payload, text, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
