"""The CPU time of one Triton-route attention call before its kernels start, measured without a GPU.

A GPU waits for the CPU work before each kernel: relpos's Python (validation, the route, the values), the torch
operators it dispatches (each a launch on a GPU) and Triton's launcher (binding and specializing the kernel's
arguments, finding the compiled kernel). On a GPU that work is hidden only when the CPU runs ahead of long
kernels; a single call, a small model or a decoding step waits for it (docs/benchmarks/gpu/kernel.md). Here the
kernels are compiled for an H100 (sm_90) with the stand-in driver of ``tools/kernel_anatomy.py`` and every launch
stops before the driver (Triton's ``warmup``), so the time is everything a call costs the CPU except the driver's
own launch. Cases run interleaved, round by round; per case the median over rounds of the CPU time of the calling
thread (``time.thread_time``: other processes on a shared machine do not count) per call.

    python benchmarks/triton_host.py                               # prints the table
    python benchmarks/triton_host.py --json docs/benchmarks/gpu/triton-host.json
"""

from __future__ import annotations

import argparse
import collections
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import kernel_anatomy  # noqa: E402

import relpos  # noqa: E402
from relpos._io import write_report  # noqa: E402
from relpos._measure import checkout_commit  # noqa: E402
from relpos.backends import dispatch  # noqa: E402

B, H, L, D = 4, 16, 1024, 64  # sizes change the kernels' time, not the CPU's before them


class _Operators(TorchDispatchMode):
    """Counts the torch operators dispatched inside it (views included: they cost the CPU too)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


CASES = ("no term, forward", "T5 values (a later layer), forward", "T5 table (the first layer), forward", "ALiBi, forward",
         "T5 values, key mask (a later layer), forward", "T5 table, training step")


def _cases() -> dict:
    """name -> a call (what a model's attention layer runs), all on the ``triton`` route."""
    q, k, v = (torch.zeros(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))  # (B, H, L, d)
    table = relpos.RelativePositionalBias(H)
    frozen = relpos.RelativePositionalBias(H).requires_grad_(False)
    values = frozen.offsets(L, L)  # a later layer: the first one's per-offset values, shared
    alibi = relpos.ALiBi(H, mode="symmetric")
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, L * 3 // 5:] = False  # one example 60% real
    trainable = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.zeros_like(q)

    def call(*qkv, **kwargs):
        return relpos.attention(*qkv, backend="triton", **kwargs)

    def train():
        call(*trainable, bias=table).backward(grad)
        for t in (*trainable, table.relative_attention_bias.weight):
            t.grad = None

    def inference(**kwargs):
        def run():
            with torch.no_grad():
                call(q, k, v, **kwargs)
        return run

    calls = (inference(), inference(bias=values), inference(bias=frozen), inference(bias=alibi),
             inference(bias=values, key_mask=keep), train)
    return dict(zip(CASES, calls))


def run(rounds: int, calls: int, only: list[str] | None = None) -> list[dict]:
    dispatch._IMPLEMENTATIONS["triton"] = dispatch._Implementation(lambda call: None, dispatch._triton)  # CPU tensors
    dispatch._DEVICE_KEY_MASKS = ("cuda", "cpu")  # a key mask read on the device, as on a GPU
    samples = collections.defaultdict(list)
    counts = {}
    with kernel_anatomy.compiling_for(90) as launches:
        cases = {name: fn for name, fn in _cases().items() if only is None or name in only}
        for fn in cases.values():
            fn()  # compiles
        for name, fn in cases.items():
            before, ops = len(launches), _Operators()
            with ops:
                fn()
            counts[name] = (ops.count, len(launches) - before)
        for _ in range(rounds):
            for name, fn in cases.items():
                start = time.thread_time()
                for _ in range(calls):
                    fn()
                samples[name].append((time.thread_time() - start) / calls * 1e6)
    return [{"case": name, "host_us": statistics.median(samples[name]), "operators": counts[name][0],
             "launches": counts[name][1]} for name in samples]


def markdown(rows: list[dict]) -> str:
    lines = ["| call (B = 4, H = 16, L = 1024, d = 64, bf16) | CPU us per call | torch operators | Triton launches |",
             "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['host_us']:.0f} | {r['operators']} | {r['launches']} |" for r in rows]
    return "\n".join(lines)


def page(payload: dict) -> str:
    """What ``tools/bench_tables.py`` renders from the committed JSON."""
    return (f"relpos at {payload['commit']}; machine: {payload['machine']}, torch {payload['torch']}, Triton "
            f"{payload['triton']}; {payload['rounds']} rounds of {payload['calls']} calls\n\n{markdown(payload['rows'])}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50, help="calls per case and round")
    parser.add_argument("--cases", nargs="*", default=None, metavar="CASE", help="case names to run (default: all)")
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--markdown", help="also write the table here")
    args = parser.parse_args()
    unknown = sorted(set(args.cases or ()) - set(CASES))
    if unknown:
        parser.error(f"--cases: no case named {', '.join(map(repr, unknown))}; the cases are {'; '.join(CASES)}")
    import triton

    rows = run(args.rounds, args.calls, args.cases)
    payload = {"command": shlex.join(["python", "benchmarks/triton_host.py", *sys.argv[1:]]),
               "commit": checkout_commit(ROOT), "machine": platform.platform(), "torch": torch.__version__,
               "triton": triton.__version__, "rounds": args.rounds, "calls": args.calls, "rows": rows}
    text = page(payload)
    print(text, end="")
    write_report(payload, text, args.json, args.markdown, indent=1)


if __name__ == "__main__":
    main()
