"""Cost of building a T5 bias: transformers' compute_bias vs relpos (dense, per-offset, cached).

Answers the T5 bias explainer's pitfall 1 ("cache the bias"): does a cache still pay once the bias is
built per offset? Variants are interleaved and repeated; medians are reported.

    python benchmarks/bias_build.py            # prints a markdown table
    python benchmarks/bias_build.py --json docs/benchmarks/attention/bias-build.json \
        --markdown docs/benchmarks/attention/bias-build.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import relpos
from relpos._io import write_report


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(lengths, heads: int, repeats: int, rounds: int) -> list[dict]:
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(d_model=heads * 64, d_kv=64, num_heads=heads)
    hf = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    ours = relpos.RelativePositionalBias(heads)
    ours.relative_attention_bias.load_state_dict(hf.relative_attention_bias.state_dict())
    rows = []
    for length in lengths:
        cache = {length: ours.offsets(length, length)}
        variants = {
            "hf_compute_bias": lambda: hf.compute_bias(length, length),
            "relpos_dense": lambda: ours(length, length),
            "relpos_offsets": lambda: ours.offsets(length, length),
            "relpos_offsets_cached": lambda: cache[length],
            "hf_decode_row": lambda: hf.compute_bias(1, length, past_seen_tokens=length - 1),
            "relpos_decode_row": lambda: ours.offsets(1, length, q_offset=length - 1),
        }
        samples = {name: [] for name in variants}
        with torch.no_grad():
            for _ in range(rounds):  # interleave: this VM has slow phases lasting seconds
                for name, fn in variants.items():
                    samples[name].append(_median_ms(fn, 1 if name == "hf_compute_bias" and length >= 4096 else repeats))
        row = {"L": length, **{name: statistics.median(v) for name, v in samples.items()}}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| L | transformers compute_bias (ms) | relpos dense (ms) | relpos per-offset (ms) | cached per-offset (ms) "
        "| compute_bias / per-offset | transformers decode row (ms) | relpos decode row (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['L']} | {r['hf_compute_bias']:.2f} | {r['relpos_dense']:.2f} | {r['relpos_offsets']:.3f} "
            f"| {r['relpos_offsets_cached']:.4f} | {r['hf_compute_bias'] / r['relpos_offsets']:.0f}x "
            f"| {r['hf_decode_row']:.3f} | {r['relpos_decode_row']:.3f} |"
        )
    return "\n".join(lines)


def page(payload: dict) -> str:
    """What ``--markdown`` writes (and ``tools/bench_tables.py`` renders from the committed JSON)."""
    return (f"machine: {payload['machine']}, {payload['threads']} threads, torch {payload['torch']}, H={payload['heads']}, fp32"
            "\n\n" + markdown(payload["rows"]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--markdown", help="also write the table here (into the page's generated region)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = run([int(x) for x in args.lengths.split(",")], args.heads, args.repeats, args.rounds)
    payload = {"machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "heads": args.heads, "rows": rows}
    text = page(payload)
    print(text, end="")
    write_report(payload, text, args.json, args.markdown, indent=2)


if __name__ == "__main__":
    main()
