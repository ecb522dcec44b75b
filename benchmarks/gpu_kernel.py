"""The Triton kernel on a GPU against the floor (SDPA with no position term), relpos's other routes,
hand-written FlexAttention and the FlashBias fold of causal ALiBi (issue: relative positions at flash speed).

    PYTHONPATH=src:tests python benchmarks/gpu_kernel.py --out OUT_DIR [--lengths 4096,16384] [--sweep]

Every case times its variants interleaved, round by round, with CUDA events (median of ``--rounds``), and reads
the allocator's peak above what was allocated before the call. ``--sweep`` first times a few tile configurations
of the kernel at the first length and uses the fastest for the rest (printed and saved). Writes ``OUT_DIR/
gpu-kernel.json`` (rewritten atomically after every case) and ``gpu-kernel.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import relpos
from relpos._measure import kernel_events
from relpos.backends import _triton

DTYPE = torch.bfloat16
DEVICE = "cuda"  # the sweep's inputs: tests/tools/test_gpu_kernel_sweep.py runs the sweep on the CPU, under the interpreter


REPEAT = 1  # calls per timed sample (--repeat): more than one lets the CPU run ahead of the GPU, as in a model


def timed(fn, *, train: bool) -> tuple[float, float]:
    """(ms per call, peak MiB above the start); ``train`` runs backward on the output's sum."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEAT):
        out = fn()
        if train:
            out.backward(torch.ones_like(out))
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPEAT, (torch.cuda.max_memory_allocated() - base) / 2**20


def profile(fn, path: str, title: str, calls: int = 10) -> dict:
    """torch.profiler over ``calls`` calls: the table sorted by CUDA time (appended to ``path``), and the CPU time and
    the kernels' own time per call."""
    from torch.profiler import ProfilerActivity

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    with open(path, "a") as fh:
        fh.write(f"## {title}\n\n{events.table(sort_by='cuda_time_total', row_limit=25)}\n\n")
    kernel_us = sum(e.self_device_time_total for e in kernel_events(events)) / calls
    cpu_us = sum(e.self_cpu_time_total for e in events) / calls
    return {"kernel_us_per_call": kernel_us, "cpu_us_per_call": cpu_us}


def measure(variants: dict, *, train: bool, rounds: int) -> dict:
    results = {}
    for name, fn in list(variants.items()):  # warm up (compiles), drop what fails
        try:
            for _ in range(3):
                timed(fn, train=train)
        except Exception as error:  # noqa: BLE001 - a route that cannot run this case is reported, not fatal
            results[name] = {"ms": None, "peak_mib": None, "note": f"{type(error).__name__}: {str(error)[:160]}"}
            del variants[name]
    samples = {name: [] for name in variants}
    peaks = {}
    for _ in range(rounds):
        for name, fn in variants.items():
            ms, peak = timed(fn, train=train)
            samples[name].append(ms)
            peaks[name] = max(peaks.get(name, 0.0), peak)
    for name in variants:
        results[name] = {"ms": statistics.median(samples[name]), "peak_mib": peaks[name], "samples": samples[name]}
    return results


# ------------------------------------------------------------------------------------------ routes
_flex_compiled = None


def flex():
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def causal_block_mask(length):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: kv <= q, None, None, length, length, device="cuda")


def hand_flex_vector(q, k, v, vec, *, causal):
    """What a user writes: the per-offset vector gathered by kv - q in score_mod (bf16 vector, as the issue)."""
    last = q.shape[2] - 1
    mask = causal_block_mask(q.shape[2]) if causal else None
    return lambda: flex()(q, k, v, score_mod=lambda s, b, h, qi, ki: s + vec[h, ki - qi + last], block_mask=mask)


def hand_flex_alibi(q, k, v, slopes, *, causal):
    mask = causal_block_mask(q.shape[2]) if causal else None
    if causal:
        mod = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)  # noqa: E731
    else:
        mod = lambda s, b, h, qi, ki: s - slopes[h] * (ki - qi).abs()  # noqa: E731
    return lambda: flex()(q, k, v, score_mod=mod, block_mask=mask)


def flashbias_fold(q, k, v, slopes, scale):
    """Causal ALiBi as extra head columns: softmax(q.k s + m (j - i)) = softmax(q.k s + m j) (the row term
    cancels). m j / s is split into three bf16 parts (hi + mid + lo) so the fold keeps fp32-level accuracy;
    q gets three ones. Head dims padded to 72 (a multiple of 8) for SDPA's flash/cuDNN kernels."""
    batch, heads, length, dim = q.shape
    j = torch.arange(length, device=q.device, dtype=torch.float32)
    target = slopes.float()[:, None] * j[None, :] / scale  # (H, L)
    hi = target.to(DTYPE)
    mid = (target - hi.float()).to(DTYPE)
    lo = (target - hi.float() - mid.float()).to(DTYPE)
    extra_k = torch.stack([hi, mid, lo], -1)[None].expand(batch, -1, -1, -1)  # (B, H, L, 3)
    pad = 72 - dim - 3

    def run():
        ones = q.new_ones(batch, heads, length, 3)
        q2 = F.pad(torch.cat([q, ones], -1), (0, pad))  # (B, H, L, 72)
        k2 = F.pad(torch.cat([k, extra_k], -1), (0, pad))
        v2 = F.pad(v, (0, 72 - dim))
        return F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, scale=scale)[..., :dim]

    return run


def fold_accuracy(heads, length, dim) -> dict:
    """Max error of causal ALiBi in bf16 against fp32 attention with the exact dense bias (same bf16 inputs)."""
    q, k, v = make_inputs(1, heads, length, dim, grad=False)
    bias = relpos.ALiBi(heads).cuda()
    scale = dim**-0.5
    with torch.no_grad():
        i = torch.arange(length, device="cuda")
        dense = bias.slopes[:, None, None] * (i[None, :] - i[:, None]).clamp(max=0).float()  # (H, L, L)
        dense = dense.masked_fill(i[None, :] > i[:, None], float("-inf"))
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense[None], scale=scale)
        errors = {
            "relpos_triton": relpos.attention(q, k, v, bias=bias, causal=True, backend="triton"),
            "flashbias_fold": flashbias_fold(q, k, v, bias.slopes, scale)(),
            "sdpa_bf16_dense_bias": F.scaled_dot_product_attention(q, k, v, attn_mask=dense[None].to(DTYPE), scale=scale),
        }
    return {name: float((out.float() - want).abs().max()) for name, out in errors.items()}


def route_errors(batch, heads, length, dim) -> dict:
    """Max |error| of each forward route against fp32 attention with the exact dense bias, example 0 (bf16 inputs)."""
    q, k, v = make_inputs(1, heads, length, dim, grad=False)
    out = {}
    with torch.no_grad():
        for name, bias, causal in (("t5", t5(heads), False), ("causal_t5", t5(heads, bidirectional=False), True),
                                   ("alibi", relpos.ALiBi(heads, mode="symmetric").cuda(), False),
                                   ("causal_alibi", relpos.ALiBi(heads).cuda(), True)):
            dense = bias.offsets(length, length).dense().float()  # (1, H, L, L)
            if causal:
                dense = dense.masked_fill(torch.ones(length, length, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
            want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense)
            for backend in ("triton", "sdpa"):
                got = relpos.attention(q, k, v, bias=bias, causal=causal, backend=backend)
                out[f"{name}/{backend}"] = float((got.float() - want).abs().max())
            del dense, want
    return out


def relpos_route(q, k, v, bias, backend, **kw):
    return lambda: relpos.attention(q, k, v, bias=bias, backend=backend, **kw)


# ------------------------------------------------------------------------------------------- cases
def make_inputs(batch, heads, length, dim, *, grad):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    return [torch.randn(batch, heads, length, dim, device=DEVICE, dtype=DTYPE, generator=g).requires_grad_(grad)
            for _ in range(3)]


def t5(heads, *, bidirectional=True, grad=False):
    bias = relpos.T5RelativeBias(heads, bidirectional=bidirectional).to(DEVICE)
    with torch.no_grad():
        bias.relative_attention_bias.weight.normal_(0, 1.0)
    return bias.requires_grad_(grad)


def cases(batch, heads, length, dim):
    """name -> (train, builder of the variants). The floor comes first in each."""
    scale = dim**-0.5

    def t5_forward():
        q, k, v = make_inputs(batch, heads, length, dim, grad=False)
        bias = t5(heads)
        vec = bias.offsets(length, length).values.detach().to(DTYPE)
        return {
            "sdpa_no_bias": lambda: F.scaled_dot_product_attention(q, k, v),
            "triton_no_bias": relpos_route(q, k, v, None, "triton"),
            "relpos_triton": relpos_route(q, k, v, bias, "triton"),
            "relpos_sdpa": relpos_route(q, k, v, bias, "sdpa"),
            "hand_flex": hand_flex_vector(q, k, v, vec, causal=False),
        }

    def t5_anatomy():  # where a T5 term's forward cost comes from, against no term
        q, k, v = make_inputs(batch, heads, length, dim, grad=False)
        offsets = t5(heads).offsets(length, length)  # flat beyond max_distance: most tiles add one scalar
        every_tile_gathers = dataclasses.replace(offsets, flat=None)
        constant = dataclasses.replace(offsets, values=torch.zeros_like(offsets.values), flat=(0, 0))
        return {
            "sdpa_no_bias": lambda: F.scaled_dot_product_attention(q, k, v),
            "triton_no_bias": relpos_route(q, k, v, None, "triton"),
            "t5": relpos_route(q, k, v, offsets, "triton"),
            "t5_every_tile_gathers": relpos_route(q, k, v, every_tile_gathers, "triton"),
            "flat_both_sides": relpos_route(q, k, v, constant, "triton"),
        }

    def t5_train():
        q, k, v = make_inputs(batch, heads, length, dim, grad=True)
        bias = t5(heads, grad=True)
        vec = bias.offsets(length, length).values.detach().to(DTYPE).requires_grad_()
        return {
            "sdpa_no_bias": lambda: F.scaled_dot_product_attention(q, k, v),
            "relpos_triton": relpos_route(q, k, v, bias, "triton"),
            "relpos_flex": relpos_route(q, k, v, bias, "flex"),
            "hand_flex": hand_flex_vector(q, k, v, vec, causal=False),
        }

    def causal_t5_forward():
        q, k, v = make_inputs(batch, heads, length, dim, grad=False)
        bias = t5(heads, bidirectional=False)
        vec = bias.offsets(length, length).values.detach().to(DTYPE)
        return {
            "sdpa_causal_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "relpos_triton": relpos_route(q, k, v, bias, "triton", causal=True),
            "relpos_sdpa": relpos_route(q, k, v, bias, "sdpa", causal=True),
            "hand_flex": hand_flex_vector(q, k, v, vec, causal=True),
        }

    def causal_t5_train():
        q, k, v = make_inputs(batch, heads, length, dim, grad=True)
        bias = t5(heads, bidirectional=False, grad=True)
        vec = bias.offsets(length, length).values.detach().to(DTYPE).requires_grad_()
        return {
            "sdpa_causal_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "relpos_triton": relpos_route(q, k, v, bias, "triton", causal=True),
            "relpos_flex": relpos_route(q, k, v, bias, "flex", causal=True),
            "hand_flex": hand_flex_vector(q, k, v, vec, causal=True),
        }

    def alibi_forward():
        q, k, v = make_inputs(batch, heads, length, dim, grad=False)
        bias = relpos.ALiBi(heads, mode="symmetric").cuda()
        return {
            "sdpa_no_bias": lambda: F.scaled_dot_product_attention(q, k, v),
            "triton_no_bias": relpos_route(q, k, v, None, "triton"),
            "relpos_triton": relpos_route(q, k, v, bias, "triton"),
            "relpos_sdpa": relpos_route(q, k, v, bias, "sdpa"),
            "hand_flex": hand_flex_alibi(q, k, v, bias.slopes, causal=False),
        }

    def causal_alibi_forward():
        q, k, v = make_inputs(batch, heads, length, dim, grad=False)
        bias = relpos.ALiBi(heads).cuda()
        return {
            "sdpa_causal_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "relpos_triton": relpos_route(q, k, v, bias, "triton", causal=True),
            "relpos_sdpa": relpos_route(q, k, v, bias, "sdpa", causal=True),
            "hand_flex": hand_flex_alibi(q, k, v, bias.slopes, causal=True),
            "flashbias_fold": flashbias_fold(q, k, v, bias.slopes, scale),
        }

    def causal_alibi_train():
        q, k, v = make_inputs(batch, heads, length, dim, grad=True)
        bias = relpos.ALiBi(heads).cuda()
        return {
            "sdpa_causal_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "relpos_triton": relpos_route(q, k, v, bias, "triton", causal=True),
            "hand_flex": hand_flex_alibi(q, k, v, bias.slopes, causal=True),
            "flashbias_fold": flashbias_fold(q, k, v, bias.slopes, scale),
        }

    def t5_dropout_train():  # T5's training default: attention dropout 0.1
        q, k, v = make_inputs(batch, heads, length, dim, grad=True)
        bias = t5(heads, grad=True)
        return {
            "sdpa_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1),
            "relpos_triton": relpos_route(q, k, v, bias, "triton", dropout_p=0.1),
            "relpos_sdpa": relpos_route(q, k, v, bias, "sdpa", dropout_p=0.1),
        }

    def padded(grad):
        def build():
            q, k, v = make_inputs(batch, heads, length, dim, grad=grad)
            keep = torch.ones(batch, length, dtype=torch.bool, device="cuda")
            keep[0, int(0.6 * length):] = False  # one example 60% real
            bias = t5(heads, grad=grad)
            return {
                "sdpa_bool_mask_no_bias": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None]),
                "relpos_triton": relpos_route(q, k, v, bias, "triton", key_mask=keep),
                "relpos_sdpa": relpos_route(q, k, v, bias, "sdpa", key_mask=keep),
            }
        return build

    return {
        "t5_forward": (False, t5_forward),
        "t5_anatomy": (False, t5_anatomy),
        "t5_train": (True, t5_train),
        "causal_t5_forward": (False, causal_t5_forward),
        "causal_t5_train": (True, causal_t5_train),
        "alibi_forward": (False, alibi_forward),
        "causal_alibi_forward": (False, causal_alibi_forward),
        "causal_alibi_train": (True, causal_alibi_train),
        "t5_dropout_train": (True, t5_dropout_train),
        "padded_forward": (False, padded(False)),
        "padded_train": (True, padded(True)),
    }


# ------------------------------------------------------------------------------------------- sweep
SWEEP_FWD = [(64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3)]
SWEEP_FWD_OFFSETS = [((64, 32, 4, 3), 1), ((64, 64, 4, 3), 2), ((128, 64, 8, 3), 2), ((64, 64, 4, 3), 1),
                     ((128, 64, 8, 3), 1), ((64, 64, 4, 2), 4), ((64, 64, 4, 2), 2),
                     ((64, 64, 4, 3), 2, True), ((64, 64, 4, 2), 4, True), ((64, 64, 4, 2), 2, True)]
# (tile, gather_split[, split_flat]): gathering blocks in halves or quarters keep 64-wide flat blocks; with 2 stages
# and the forward's 128-register cap (GPU_BLOCKS' fwd_registers) the kernel fits 4 blocks on an H100's SM with flat
# tiles of about the no-term tile's instructions; split_flat runs the flat blocks in a launch of their own
# (compiled, not timed: docs/benchmarks/gpu/kernel-anatomy.md)
SWEEP_DKDV = [(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3)]
# (32 x 128 with 8 warps: 215 registers and no spill, against 255 and a few spilled bytes with 4; compiled, not timed)
SWEEP_DQ = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)]
# dk/dv with dropout 0.1 (T5's training default): 32 x 128 with 8 warps holds the mask in 233 registers with no spill,
# where 4 warps spill 152 bytes and touch them 8-22 times per loop (compiled, not timed: kernel-anatomy.md)
SWEEP_DKDV_DROPOUT = [(32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3)]


def offsets_fields(option: tuple) -> dict:
    """A ``SWEEP_FWD_OFFSETS`` entry as ``_Blocks`` fields: (tile, gather_split[, split_flat])."""
    return {"fwd_offsets": option[0], "gather_split": option[1], "split_flat": option[2] if len(option) > 2 else False}


def _fastest(times: dict, options: list):
    return min((o for o in options if times[str(o)] is not None), key=lambda o: times[str(o)])


#: The largest difference a tile shape may make, relative to the largest value of each result (output, gradients),
#: against the kernel's shipped tiles on the same bf16 inputs: only the order of fp32 sums and one bf16 rounding of
#: the output change with the tiles; a tile that skips or repeats a block is off by the order of the values.
SWEEP_TOLERANCE = 0.02


def results(run, leaves: list) -> list:
    """What a tile shape must not change: the call's output and, for a training step, the gradients of ``leaves``.
    The generators are reseeded first, so a call with dropout draws the same seed, hence the same mask (drawn per
    score, not per tile: tests/backends/test_triton.py)."""
    for leaf in leaves:
        leaf.grad = None
    torch.manual_seed(0)
    out = run()
    if not leaves:
        return [out.float()]
    out.backward(torch.ones_like(out))
    return [out.detach().float()] + [leaf.grad.float() for leaf in leaves]


def disagreement(got: list, want: list) -> float:
    """The largest |got - want| of any result, relative to that result's largest |want|."""
    return max(float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6) for a, b in zip(got, want))


def sweep(batch, heads, length, dim, rounds) -> dict:
    """Time tile configurations: the forward with no term, the forward with T5's per-offset values (tile and
    gather split), the T5 training step's two backward kernels (dk/dv also with dropout 0.1); keep the fastest of
    each (``_triton.GPU_BLOCKS[64]``). A candidate is timed only if its output and gradients equal those of the
    shipped tiles (``SWEEP_TOLERANCE``): a fast wrong shape is reported under ``"wrong"`` and never chosen."""
    q, k, v = make_inputs(batch, heads, length, dim, grad=True)
    bias = t5(heads, grad=True)
    shipped = _triton.GPU_BLOCKS[64]
    best = dataclasses.asdict(shipped)
    report = {"wrong": {}}  # a candidate whose results differ from the shipped tiles': never timed, never chosen
    references = {}

    def timed_with(fields: dict, term, train: bool, **kw):
        leaves = [q, k, v, *term.parameters()] if train else []
        with torch.enable_grad() if train else torch.no_grad():
            run = relpos_route(*(t if train else t.detach() for t in (q, k, v)), term, "triton", **kw)
            key = (term is None, train, tuple(sorted(kw.items())))
            if key not in references:
                _triton.GPU_BLOCKS[64] = shipped
                references[key] = results(run, leaves)
            _triton.GPU_BLOCKS[64] = _triton._Blocks(**dict(best, **fields))
            error = disagreement(results(run, leaves), references[key])
            if error > SWEEP_TOLERANCE:
                report["wrong"][str(fields)] = error
                print(f"sweep: {fields} differs from the shipped tiles by {error:.3g} (relative): left out", flush=True)
                return None
            return measure({"x": run}, train=train, rounds=rounds)["x"]["ms"]

    report["fwd"] = {str(c): timed_with({"fwd": c}, None, False) for c in SWEEP_FWD}
    best["fwd"] = _fastest(report["fwd"], SWEEP_FWD)
    report["fwd_offsets"] = {str(o): timed_with(offsets_fields(o), bias, False) for o in SWEEP_FWD_OFFSETS}
    best.update(offsets_fields(_fastest(report["fwd_offsets"], SWEEP_FWD_OFFSETS)))
    for kernel, configs in (("dkdv", SWEEP_DKDV), ("dq", SWEEP_DQ)):
        report[kernel] = {str(c): timed_with({kernel: c}, bias, True) for c in configs}
        best[kernel] = _fastest(report[kernel], configs)
    report["dkdv_dropout"] = {str(c): timed_with({"dkdv_dropout": c}, bias, True, dropout_p=0.1) for c in SWEEP_DKDV_DROPOUT}
    best["dkdv_dropout"] = _fastest(report["dkdv_dropout"], SWEEP_DKDV_DROPOUT)
    _triton.GPU_BLOCKS[64] = _triton._Blocks(**best)
    report["chosen"] = best
    print("sweep:", json.dumps(report), flush=True)
    return report


def write_json(path, payload):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1)
    os.replace(tmp, path)


def markdown(payload) -> str:
    lines = [f"machine: {payload['machine']}", ""]
    for length in payload["lengths"]:
        for case, res in payload["results"].get(str(length), {}).items():
            names = list(res)
            floor = res[names[0]]["ms"]
            lines += [f"### {case}, L = {length}", "", "| variant | ms | x floor | peak MiB | note |", "|---|---|---|---|---|"]
            for name in names:
                r = res[name]
                ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
                ratio = "-" if r["ms"] is None or not floor else f"{r['ms'] / floor:.2f}"
                peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
                lines.append(f"| {name} | {ms} | {ratio} | {peak} | {r.get('note', '')} |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-length", type=int, default=0, help="length of the tile sweep (default: the first)")
    parser.add_argument("--throughput", type=int, default=0, help="after the cases, time each case's variants but "
                        "FlexAttention again at the first length with N back-to-back calls per sample")
    parser.add_argument("--repeat", type=int, default=1, help="calls per timed sample (CPU runs ahead of the GPU)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of the T5 and causal ALiBi "
                        "forwards (triton, sdpa, the floor) at the first length: where a call's time goes")
    parser.add_argument("--cases", default="", help="comma-separated subset of the cases (default: all)")
    parser.add_argument("--flex-lengths", default="4096", help="lengths at which the FlexAttention variants run "
                        "(each compiles for 10-20 s per shape)")
    args = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 1024  # every flex variant compiles per shape and score_mod
    os.makedirs(args.out, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    flex_lengths = {int(x) for x in args.flex_lengths.split(",") if x}
    props = torch.cuda.get_device_properties(0)
    import triton

    payload = {
        "command": "PYTHONPATH=src:tests python benchmarks/gpu_kernel.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {props.name}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
                   f"B={args.batch}, H={args.heads}, d={args.dim}, CUDA events, median of {args.rounds} interleaved rounds",
        "lengths": lengths, "results": {}, "sweep": None,
    }
    path = os.path.join(args.out, "gpu-kernel.json")
    if args.sweep:
        payload["sweep"] = sweep(args.batch, args.heads, args.sweep_length or lengths[0], args.dim,
                                 max(3, args.rounds // 2))
        write_json(path, payload)
    try:
        payload["fold_accuracy"] = fold_accuracy(args.heads, lengths[0], args.dim)
        print("fold accuracy (max error vs fp32):", payload["fold_accuracy"], flush=True)
    except Exception as error:  # noqa: BLE001
        print("fold accuracy failed:", error, flush=True)
    try:
        payload["route_errors"] = route_errors(args.batch, args.heads, lengths[0], args.dim)
        print("route errors (max vs fp32 dense):", payload["route_errors"], flush=True)
    except Exception as error:  # noqa: BLE001
        print("route errors failed:", error, flush=True)
    global REPEAT
    REPEAT = args.repeat
    if args.profile:
        payload["profile"] = {}
        with torch.no_grad():
            built = cases(args.batch, args.heads, lengths[0], args.dim)
            for case in ("t5_forward", "causal_alibi_forward"):
                for name, fn in built[case][1]().items():
                    if "flex" in name or "fold" in name:
                        continue
                    key = f"{case}/{name}"
                    payload["profile"][key] = profile(fn, os.path.join(args.out, "profile.txt"), key)
                    print("profile", key, payload["profile"][key], flush=True)
        write_json(path, payload)
    wanted = set(filter(None, args.cases.split(",")))
    for length in lengths:
        for case, (train, build) in cases(args.batch, args.heads, length, args.dim).items():
            if wanted and case not in wanted:
                continue
            t0 = time.time()
            torch.cuda.empty_cache()
            ctx = torch.enable_grad() if train else torch.no_grad()
            try:
                with ctx:
                    variants = build()
                    if length not in flex_lengths:
                        variants = {n: f for n, f in variants.items() if "flex" not in n}
                    res = measure(variants, train=train, rounds=args.rounds)
            except Exception as error:  # noqa: BLE001 - report and go on to the next case
                print(f"L={length} {case}: {type(error).__name__}: {error}", flush=True)
                continue
            payload["results"].setdefault(str(length), {})[case] = res
            write_json(path, payload)
            floor = next(iter(res.values()))["ms"]
            summary = ", ".join(f"{n} {r['ms']:.3f}" if r["ms"] else f"{n} failed" for n, r in res.items())
            print(f"L={length} {case} ({time.time() - t0:.0f} s): {summary} | floor {floor}", flush=True)
    if args.throughput:
        REPEAT = args.throughput
        payload["throughput"] = {"repeat": REPEAT, "length": lengths[0], "results": {}}
        for case, (train, build) in cases(args.batch, args.heads, lengths[0], args.dim).items():
            if wanted and case not in wanted:
                continue
            try:
                with torch.enable_grad() if train else torch.no_grad():
                    # the hand-written FlexAttention too where --flex-lengths has this length: the competitor
                    variants = {n: f for n, f in build().items()
                                if "flex" not in n or (n == "hand_flex" and lengths[0] in flex_lengths)}
                    res = measure(variants, train=train, rounds=args.rounds)
            except Exception as error:  # noqa: BLE001
                print(f"throughput {case}: {type(error).__name__}: {error}", flush=True)
                continue
            payload["throughput"]["results"][case] = res
            write_json(path, payload)
            print(f"throughput x{REPEAT} L={lengths[0]} {case}: "
                  + ", ".join(f"{n} {r['ms']:.3f}" if r["ms"] else f"{n} failed" for n, r in res.items()), flush=True)
    with open(os.path.join(args.out, "gpu-kernel.md"), "w") as fh:
        fh.write(markdown(payload))


if __name__ == "__main__":
    main()
