"""Tables of docs/benchmarks/gpu/kernel.md from the committed JSON of benchmarks/gpu_kernel.py (no hand-copied numbers).

    python tools/gpu_kernel_report.py docs/benchmarks/gpu/kernel.json   # prints them
    python tools/bench_tables.py                                         # writes them into docs/benchmarks/gpu/kernel-tables.md
"""

from __future__ import annotations

import json
import sys

TARGETS = {  # the targets: the position term's time over the floor's
    "t5_forward": 1.3, "t5_train": 1.5, "causal_t5_forward": 1.3, "causal_t5_train": 1.5,
    "alibi_forward": 1.15, "padded_forward": 1.3,
}
OLD_ROUTE = {  # what relpos's auto ran before the Triton kernel (docs/benchmarks/gpu/attention.md)
    "t5_forward": "relpos_sdpa", "t5_train": "relpos_flex", "causal_t5_forward": "relpos_sdpa",
    "causal_t5_train": "relpos_flex", "alibi_forward": "relpos_sdpa", "causal_alibi_forward": "relpos_sdpa",
    "padded_forward": "relpos_sdpa", "padded_train": "relpos_sdpa", "t5_dropout_train": "relpos_sdpa",
}


def _ms(result: dict | None) -> str:
    return "-" if not result or result.get("ms") is None else f"{result['ms']:.2f}"


def headline(payload: dict) -> str:
    lines = ["| case | L | floor ms | relpos triton ms | x floor | target | before (auto) ms | hand-written flex ms | FlashBias fold ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for length in payload["lengths"]:
        for case, res in payload["results"][str(length)].items():
            floor = next(iter(res.values()))
            ours = res.get("relpos_triton")
            ratio = ours["ms"] / floor["ms"] if ours and ours.get("ms") and floor.get("ms") else None
            target = TARGETS.get(case)
            verdict = "-" if target is None or ratio is None else f"{target} ({'met' if ratio <= target else 'missed'})"
            lines.append(
                f"| {case} | {length} | {_ms(floor)} | {_ms(ours)} | {'-' if ratio is None else f'{ratio:.2f}'} | {verdict} "
                f"| {_ms(res.get(OLD_ROUTE.get(case, '')))} | {_ms(res.get('hand_flex'))} | {_ms(res.get('flashbias_fold'))} |"
            )
    return "\n".join(lines)


def errors(payload: dict) -> str:
    rows = payload.get("route_errors", {})
    cases = sorted({key.split("/")[0] for key in rows})
    lines = ["| bias | relpos triton | relpos sdpa (the view in bf16) |", "|---|---|---|"]
    lines += [f"| {c} | {rows[c + '/triton']:.4f} | {rows[c + '/sdpa']:.4f} |" for c in cases]
    fold = payload.get("fold_accuracy", {})
    lines += ["", "| causal ALiBi | max error |", "|---|---|"] + [f"| {k} | {v:.4f} |" for k, v in fold.items()]
    return "\n".join(lines)


def sweep(payload: dict) -> str:
    s = payload.get("sweep") or {}
    lines = ["| kernel | (BM, BN, warps, stages): ms |", "|---|---|"]
    for kernel in ("fwd", "fwd_offsets", "dkdv", "dq", "dkdv_dropout"):
        if kernel not in s:
            continue
        cells = ", ".join(f"{cfg}: {'failed' if ms is None else f'{ms:.2f}'}" for cfg, ms in s[kernel].items())
        lines.append(f"| {kernel} | {cells} |")
    wrong = s.get("wrong") or {}
    if wrong:  # benchmarks/gpu_kernel.py's check against the shipped tiles: shown as failed above
        lines += ["", "Left out, their results differing from the shipped tiles' (relative): "
                  + "; ".join(f"{fields} {error:.3g}" for fields, error in wrong.items())]
    return "\n".join(lines)


def throughput(payload: dict) -> str:
    """``--throughput N``: every variant but FlexAttention again, N back-to-back calls per sample (the CPU runs ahead)."""
    t = payload.get("throughput")
    if not t:
        return "(not measured in this run)"
    lines = [f"{t['repeat']} calls per sample, L = {t['length']}; ms per call, x the case's floor:", ""]
    lines += [f"- {case}: {_cells(res)}" for case, res in t["results"].items()]
    return "\n".join(lines)


def _cells(res: dict) -> str:
    """Each variant's ms and its ratio to the first (the case's floor)."""
    floor = next(iter(res.values()))["ms"]
    return ", ".join(f"{name} {_ms(r)}" + (f" ({r['ms'] / floor:.2f}x)" if r.get("ms") and floor else "")
                     for name, r in res.items())


def profile(payload: dict) -> str:
    rows = payload.get("profile")
    if not rows:
        return "(not measured in this run)"
    if all("kernel_us_per_call" in r for r in rows.values()):
        lines = ["| case / variant | the kernels' time per call (us) |", "|---|---|"]
        lines += [f"| {key} | {r['kernel_us_per_call']:.0f} |" for key, r in rows.items()]
        return "\n".join(lines)
    lines = ["Runs before 2026-12-02 summed every profiler event's own CUDA time, which counts each kernel twice (as "
             "itself and under the operator that launched it) and adds the profiler's own buffer: about twice the "
             "kernels' time, read the ratios only; the kernels' own rows are in profile.txt.", "",
             "| case / variant | summed CUDA time per call (us, kernels counted twice) |", "|---|---|"]
    lines += [f"| {key} | {r['cuda_us_per_call']:.0f} |" for key, r in rows.items()]
    return "\n".join(lines)


def all_variants(payload: dict) -> str:
    lines = []
    for length in payload["lengths"]:
        lines += [f"- {case}, L = {length}: {_cells(res)}" for case, res in payload["results"][str(length)].items()]
    return "\n".join(lines)


def report(payload: dict) -> str:
    """The whole tables page: what ``tools/bench_tables.py`` writes into docs/benchmarks/gpu/kernel-tables.md."""
    return "\n".join([
        f"Measured: `{payload['command']}`\n\nMachine: {payload['machine']}.\n",
        "### Headline\n\n" + headline(payload) + "\n",
        "### Correctness of the forward routes (max |error| against fp32 attention with the dense bias, L = "
        f"{payload['lengths'][0]}, bf16 inputs)\n\n" + errors(payload) + "\n",
        "### Tile sweep (forward alone: no term (fwd) and T5 (fwd_offsets, or fwd where the run had one shape); dk/dv "
        "and dq as T5 training steps)\n\n" + (sweep(payload) if payload.get("sweep") else "(no sweep in this run)") + "\n",
        "### Every variant, one call per sample (ms, x the case's floor)\n\n" + all_variants(payload) + "\n",
        "### Back-to-back calls\n\n" + throughput(payload) + "\n",
        "### Profile of one call (torch.profiler, first length)\n\n" + profile(payload),
    ]) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        print(report(json.load(fh)), end="")


if __name__ == "__main__":
    main()
