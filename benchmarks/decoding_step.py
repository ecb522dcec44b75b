"""The host's share of a greedy decoding step: transformers against relpos.hf.accelerate at a size where the
arithmetic is negligible, so what is timed is the Python and the operator launches a GPU would wait on.

Each step of ``generate()`` runs every layer's attention once over the cache; on a GPU a small model's step
is bound by the CPU work before each kernel, not by the kernels. This measures that work on the CPU: the
time of one step (``generate`` of ``4 + steps`` tokens minus ``generate`` of 4, over ``steps``), the torch
operators it dispatches (each one a launch on a GPU), and how often it reads a value back to the host
(``_local_scalar_dense``: on a GPU, a wait for the GPU). Variants run interleaved, round by round; medians.

``--cache static`` decodes over transformers' static cache; ``--cache compiled-static`` also compiles the decoding
step, as ``generate()`` does on CUDA, here with inductor on the CPU (``relpos.hf.bench.cpu_compile_config``:
fullgraph, static shapes): each model compiles its two cache sizes while warming up, and the timed rounds run under
``fail_on_recompile``, so no timed step recompiles or falls back to eager. A compiled step runs inductor's code, not
torch operators one by one, so its operators and host reads are not counted ("-").

    python benchmarks/decoding_step.py                       # prints the table
    python benchmarks/decoding_step.py --json docs/benchmarks/gpu/decoding-step.json \\
        --markdown docs/benchmarks/gpu/decoding-step.md
    python benchmarks/decoding_step.py --cache compiled-static --json docs/benchmarks/gpu/decoding-step-compiled.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import platform
import shlex
import sys
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import relpos.hf
from relpos.hf.bench import cpu_compile_config, recompile_room
from relpos._io import write_report
from relpos._measure import checkout_commit


class _Operators(TorchDispatchMode):
    """Counts the torch operators dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _models(family: str) -> dict:
    """transformers' model (sdpa and eager attention) and the accelerated copy, tiny, random weights."""
    import transformers

    torch.manual_seed(0)
    if family == "t5":
        config = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(config).eval()
    else:
        config = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_head=4, n_layer=2, pad_token_id=0,
                                          eos_token_id=1, bos_token_id=2)
        model = transformers.BloomForCausalLM(config).eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    variants = {"transformers eager": eager, "relpos": relpos.hf.accelerate(copy.deepcopy(eager))}
    if family == "t5":  # transformers' Bloom has no sdpa attention
        model.set_attn_implementation("sdpa")
        variants = {"transformers sdpa": model, **variants}
    return variants


def _inputs(family: str, batch: int, length: int) -> dict:
    ids = torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch > 1 and family == "t5":  # one example a quarter padding: the encoder's on the right
        mask[1, length * 3 // 4:] = 0
    elif batch > 1:  # a decoder-only prompt's on the left
        mask[1, : length // 4] = 0
    return {"input_ids": ids, "attention_mask": mask}


CACHES = ("dynamic", "static", "compiled-static")


def _cache_options(cache: str) -> dict:
    """``generate``'s keyword arguments for one of :data:`CACHES`."""
    if cache == "dynamic":
        return {}
    if cache == "static":
        return {"cache_implementation": "static"}
    return {"cache_implementation": "static", "compile_config": cpu_compile_config()}


def _generate(model, inputs: dict, tokens: int, options: dict) -> None:
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **options)


def _counted(model, inputs: dict, steps: int, options: dict) -> tuple[float, float]:
    """(operators, host reads) per step."""
    counts = []
    for tokens in (4 + steps, 4):
        ops = _Operators()
        with ops:
            _generate(model, inputs, tokens, options)
        counts.append(ops.counts)
    long, short = counts
    operators = (sum(long.values()) - sum(short.values())) / steps
    reads = (long["aten._local_scalar_dense.default"] - short["aten._local_scalar_dense.default"]) / steps
    return operators, reads


def run(family: str, batch: int, length: int, steps: int, rounds: int, cache: str = "dynamic") -> list[dict]:
    variants = _models(family)
    inputs = _inputs(family, batch, length)
    options = _cache_options(cache)
    compiled = "compile_config" in options
    samples = {name: [] for name in variants}
    with recompile_room(len(variants)) if compiled else contextlib.nullcontext():  # the models share a code object
        for model in variants.values():
            for tokens in (4 + steps, 4) if compiled else (4,):  # warm up (a compiled step: both cache sizes)
                _generate(model, inputs, tokens, options)
        with torch.compiler.set_stance("fail_on_recompile") if compiled else contextlib.nullcontext():
            for _ in range(rounds):
                for name, model in variants.items():
                    start = time.perf_counter()
                    _generate(model, inputs, 4 + steps, options)
                    middle = time.perf_counter()
                    _generate(model, inputs, 4, options)
                    end = time.perf_counter()
                    samples[name].append(((middle - start) - (end - middle)) / steps * 1e3)
    rows = []
    for name, model in variants.items():
        operators, reads = (None, None) if compiled else _counted(model, inputs, steps, options)
        rows.append({"family": family, "variant": name, "B": batch, "L": length, "cache": cache,
                     "step_ms": statistics.median(samples[name]), "operators": operators, "host_reads": reads})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| family | B | prompt | variant | ms per step | x fastest transformers | operators per step | host reads per step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fastest = min(x["step_ms"] for x in rows if x["family"] == r["family"] and x["variant"].startswith("transformers"))
        counted = "| - | - |" if r["operators"] is None else f"| {r['operators']:.0f} | {r['host_reads']:.0f} |"
        lines.append(f"| {r['family']} | {r['B']} | {r['L']} | {r['variant']} | {r['step_ms']:.2f} | "
                     f"{fastest / r['step_ms']:.2f}x " + counted)
    return "\n".join(lines)


def page(payload: dict) -> str:
    """What ``--markdown`` writes (and ``tools/bench_tables.py`` renders from the committed JSON)."""
    return (f"relpos at {payload['commit']}; machine: {payload['machine']}, cpu, {payload['threads']} threads, torch "
            f"{payload['torch']}, transformers {payload['transformers']}; {payload['steps']} steps, {payload['rounds']} "
            f"rounds{_CACHE_NOTES[payload.get('cache', 'dynamic')]}\n\n{markdown(payload['rows'])}\n")


_CACHE_NOTES = {"dynamic": "", "static": "; static cache",
                "compiled-static": "; static cache, the decoding step compiled (inductor, fullgraph, static shapes)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="t5,bloom", help="comma-separated: t5, bloom")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=512, help="prompt length")
    parser.add_argument("--steps", type=int, default=64, help="decoding steps timed")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cache", default="dynamic", choices=CACHES,
                        help="the KV cache: dynamic (default), static, or static with the step compiled on the CPU")
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--markdown", help="also write the table here (into the page's generated region)")
    args = parser.parse_args()
    command = shlex.join(["python", "benchmarks/decoding_step.py", *sys.argv[1:]])
    families = args.families.split(",")
    unknown = sorted(set(families) - {"t5", "bloom"})
    if unknown:
        parser.error(f"--families: unknown {', '.join(unknown)}; choose among t5, bloom")
    import transformers

    rows = [row for family in families for row in run(family, args.batch, args.length, args.steps, args.rounds, args.cache)]
    payload = {"command": command, "commit": checkout_commit(Path(__file__).resolve().parents[1]), "machine": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "transformers": transformers.__version__, "steps": args.steps, "rounds": args.rounds, "cache": args.cache,
               "rows": rows}
    text = page(payload)
    print(text, end="")
    write_report(payload, text, args.json, args.markdown, indent=1)


if __name__ == "__main__":
    main()
