"""Swin V2 (transformers, eager only) against the same model after relpos.hf.accelerate.

A Swin V2 tiny-like model (embed 96, depths 2-2-6-2, heads 3-6-12-24, patch 4) at 256x256, window 8
and 16, random weights. Modes: ``forward`` (``torch.no_grad``, eval) and ``train`` (forward,
backward of the mean squared output, SGD step; train mode). Variants run interleaved in each
round; times are medians, memory the peak the call adds (resident memory on the CPU, allocated
memory on CUDA: :mod:`relpos._measure`). ``floor``: relpos's model with Swin's relative position bias dropped
(the shift mask kept), attention without the position term: the fastest any position term could make the model
(timed, not compared). Before timing, the outputs and gradients of both variants
are compared (eval mode, same input, fp32 and fp64 on the run's device, whatever ``--dtype`` times).

    python benchmarks/swin.py --json docs/benchmarks/vision/swin.json --markdown docs/benchmarks/vision/swin.md
    python benchmarks/swin.py --device cuda --dtype bfloat16 --windows 8 --json OUT/swin.json --markdown OUT/swin.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import sys
from unittest import mock

import torch

from relpos._io import write_report
from relpos._progress import Progress
from relpos._measure import add_device_arguments, device_arguments, fix_mmap_threshold, is_cuda, timed_rounds
from relpos.hf import accelerate, recompute_activations
from relpos.hf import swin as relpos_swin

VARIANTS = ("hf_eager", "relpos")
RECOMPUTE = "relpos_recompute"  # training only: relpos.hf.recompute_activations (forward under no_grad is relpos)
FLOOR = "floor"  # relpos's model without the position term (relpos.hf.swin._position_bias: None)
TIMM = "timm"  # timm's SwinTransformerV2 of the same shape, where timm imports (its own weights: time and memory only)


def _timm_class(family: str):
    """timm's SwinTransformer(V2) class, or None where timm does not import (it needs torchvision)."""
    try:
        from timm.models.swin_transformer import SwinTransformer
        from timm.models.swin_transformer_v2 import SwinTransformerV2
    except Exception:  # noqa: BLE001 - ImportError, or torchvision's operator error beside a CPU torch
        return None
    return SwinTransformerV2 if family == "swinv2" else SwinTransformer


def _timm_model(window: int, image: int, family: str):
    """timm's Swin (V2) of the same shape (random weights), or None without timm."""
    cls = _timm_class(family)
    if cls is None:
        return None
    torch.manual_seed(0)
    return cls(img_size=image, patch_size=4, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24),
               window_size=window, num_classes=0)


def _model(window: int, image: int, family: str):
    from transformers import SwinConfig, SwinModel, Swinv2Config, Swinv2Model

    model_cls, config_cls = (Swinv2Model, Swinv2Config) if family == "swinv2" else (SwinModel, SwinConfig)
    config = config_cls(image_size=image, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                        window_size=window)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # position terms that matter (random weights), Swin V2's sigmoid not saturated
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name or "continuous_position_bias_mlp.0" in name:
                p.normal_(std=0.5)
            elif "continuous_position_bias_mlp.2" in name:
                p.normal_(std=0.05)
    return model


def _outputs_and_grads(model, pixels):
    model.eval()
    out = model(pixels).last_hidden_state
    return out.detach(), torch.autograd.grad(out.square().mean(), list(model.parameters()))


def _check_equal(models: dict, pixels: torch.Tensor) -> dict:
    """fp32 outputs; fp64 outputs and per-parameter gradients (fp32 gradients of this model are
    ill-conditioned: transformers' own fp32 gradients differ from its fp64 ones by several percent)."""
    a, b = VARIANTS
    out32 = {name: _outputs_and_grads(model, pixels)[0] for name, model in models.items()}
    wide = {name: _outputs_and_grads(copy.deepcopy(model).double(), pixels.double()) for name, model in models.items()}
    names = [name for name, _ in models[a].named_parameters()]
    errors = {n: float((x - y).norm() / y.norm().clamp_min(1e-300)) for n, x, y in zip(names, wide[a][1], wide[b][1])}
    worst = max(errors, key=errors.get)
    return {
        "max_abs_output_diff_fp32": float((out32[a] - out32[b]).abs().max()),
        "output_scale": float(out32[a].abs().max()),
        "max_abs_output_diff_fp64": float((wide[a][0] - wide[b][0]).abs().max()),
        "max_rel_grad_diff_fp64": errors[worst],
        "worst_parameter": worst,
    }


def _saved_by_stage(model, pixels) -> dict[str, float]:
    """MiB of activations autograd keeps for the backward after one training forward, by encoder stage
    (each storage counted once, parameters and buffers excluded)."""
    owned = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    stage = ["other"]
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: stage.__setitem__(0, f"stage {i}"))
             for i, layer in enumerate(model.encoder.layers)]
    hooks.append(model.encoder.register_forward_hook(lambda m, a, o: stage.__setitem__(0, "other")))
    seen: dict[int, tuple[str, int]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned and ptr not in seen:
            seen[ptr] = (stage[0], t.untyped_storage().nbytes())
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(pixels)
    for hook in hooks:
        hook.remove()
    by: dict[str, float] = {}
    for where, nbytes in seen.values():
        by[where] = by.get(where, 0.0) + nbytes / 2**20
    return by | {"total": sum(by.values())}


def _features(model, pixels):
    """transformers' ``last_hidden_state``; timm's ``forward_features`` (the same normed tokens, NHWC)."""
    return model.forward_features(pixels) if hasattr(model, "forward_features") else model(pixels).last_hidden_state


def _runner(mode: str, model, pixels):
    if mode == "forward":
        model.eval()

        def run():
            with torch.no_grad():
                _features(model, pixels)

        return run
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        _features(model, pixels).square().mean().backward()
        optimizer.step()

    return step


@contextlib.contextmanager
def no_position_term():
    """While it runs, relpos's Swin attention adds no relative position bias (the shift mask stays)."""
    with mock.patch.object(relpos_swin, "_position_bias", lambda module, kind: None):
        yield


def _floor_runner(run):
    def floor():
        with no_position_term():
            run()

    return floor


def run(args) -> dict:
    torch.set_num_threads(args.threads) if args.threads else None
    device, dtype = args.device, getattr(torch, args.dtype)
    rows = []
    plan = [(w, m) for w in args.windows for m in args.modes]
    extra = _timm_class(args.family) is not None  # timm's model is timed too
    progress = Progress(sum(args.rounds * (len(VARIANTS) + 1 + (mode == "train") + extra) for _, mode in plan))
    checks = {}
    for window in args.windows:
        base = _model(window, args.image, args.family).to(device)
        pixels = torch.randn(args.batch, 3, args.image, args.image, device=device)
        checks[window] = _check_equal({"hf_eager": base, "relpos": accelerate(copy.deepcopy(base))}, pixels)
        base, pixels = base.to(dtype), pixels.to(dtype)  # timed (and activations counted) at --dtype
        models = {"hf_eager": base, "relpos": accelerate(copy.deepcopy(base))}
        checks[window]["saved_mib"] = {name: _saved_by_stage(model, pixels) for name, model in models.items()}
        checks[window]["saved_mib"][RECOMPUTE] = _saved_by_stage(recompute_activations(accelerate(copy.deepcopy(base))), pixels)
        timm_model = _timm_model(window, args.image, args.family)
        timm_model = None if timm_model is None else timm_model.to(device, dtype)
        for mode in args.modes:
            variants = {name: _runner(mode, model, pixels) for name, model in models.items()}
            variants[FLOOR] = _floor_runner(_runner(mode, accelerate(copy.deepcopy(base)), pixels))
            if mode == "train":
                variants[RECOMPUTE] = _runner(mode, recompute_activations(accelerate(copy.deepcopy(base))), pixels)
            if timm_model is not None:
                variants[TIMM] = _runner(mode, timm_model, pixels)
            timed = timed_rounds(variants, args.rounds, progress, f"{mode} window={window}", cuda=is_cuda(device))
            for name, (ms, peak, samples) in timed.items():
                rows.append({"mode": mode, "window": window, "variant": name, "ms": ms, "peak_mib": peak,
                             "samples": samples})
    progress.close() if hasattr(progress, "close") else None
    return {"config": vars(args) | {"windows": list(args.windows), "modes": list(args.modes)}, "checks": checks,
            "results": rows, "machine": _machine(device),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "versions": _versions()}


def _machine(device: str) -> str:
    if is_cuda(device):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()} {platform.processor() or ''}".strip()


def _versions() -> dict:
    import transformers

    timm_version = None
    if _timm_class("swinv2") is not None:
        import timm

        timm_version = timm.__version__
    return {"torch": torch.__version__, "transformers": transformers.__version__, "timm": timm_version}


def _precision(cfg: dict) -> str:
    """``fp32`` on the CPU (the committed CPU runs predate --device and --dtype); else the dtype and the device."""
    dtype, device = cfg.get("dtype", "float32"), cfg.get("device", "cpu")
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    return short if device == "cpu" else f"{short} on {device}"


STAGES = ("stage 0", "stage 1", "stage 2", "stage 3", "other")


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"Swin V2 tiny-like ({cfg['family']}, embed 96, depths 2-2-6-2, heads 3-6-12-24), {cfg['image']}x{cfg['image']}, "
        f"batch {cfg['batch']}, {_precision(cfg)}, {cfg['rounds']} interleaved rounds (median), "
        + ", ".join(f"{k} {v}" for k, v in report.get("versions", {"torch": report["torch"]}).items() if v)
        + f", {report['threads']} threads.",
        "",
        "| mode | window | variant | transformers eager ms | timm ms | relpos ms | vs transformers | vs timm | "
        "transformers peak MiB | timm peak MiB | relpos peak MiB | memory / transformers' | memory / timm's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["mode"], r["window"], r["variant"]): r for r in report["results"]}

    def ratio(a, b, fmt):
        return "n/a" if a is None or b is None or not b else format(a / b, fmt)

    for mode in cfg["modes"]:
        for window in cfg["windows"]:
            hf, tm = by[(mode, window, "hf_eager")], by.get((mode, window, TIMM), {})
            for variant in ("relpos", RECOMPUTE):
                ours = by.get((mode, window, variant))
                if ours is None:
                    continue
                cells = [mode, window, variant, f"{hf['ms']:.0f}", f"{tm['ms']:.0f}" if tm else "n/a", f"{ours['ms']:.0f}",
                         ratio(hf["ms"], ours["ms"], ".2f") + "x", (ratio(tm["ms"], ours["ms"], ".2f") + "x") if tm else "n/a",
                         f"{hf['peak_mib']:.0f}", f"{tm['peak_mib']:.0f}" if tm else "n/a", f"{ours['peak_mib']:.0f}",
                         ratio(ours["peak_mib"], hf["peak_mib"], ".2f"), ratio(ours["peak_mib"], tm.get("peak_mib"), ".2f")]
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += _floor_table(report, by)
    lines += ["", "Equality before timing (eval mode, same input):", ""]
    for window, c in report["checks"].items():
        lines.append(f"- window {window}: max |output difference| {c['max_abs_output_diff_fp32']:.1e} in fp32 "
                     f"(outputs up to {c['output_scale']:.1f}), {c['max_abs_output_diff_fp64']:.1e} in fp64; gradients (fp64) "
                     f"of every parameter within {c['max_rel_grad_diff_fp64']:.1e} relative (||a - b|| / ||b||; "
                     f"largest: {c['worst_parameter']})")
    lines += ["", "Activations kept for the backward after one training forward (MiB, by encoder stage; "
              "parameter gradients not included):", "",
              "| window | variant | " + " | ".join(STAGES) + " | total | of transformers' |",
              "|---|---|" + "---|" * (len(STAGES) + 2)]
    for window, c in report["checks"].items():
        saved = c["saved_mib"]
        for variant, by_stage in saved.items():
            cells = " | ".join(f"{by_stage.get(k, 0.0):.1f}" for k in STAGES)
            lines.append(f"| {window} | {variant} | {cells} | {by_stage['total']:.1f} | "
                         f"{by_stage['total'] / saved['hf_eager']['total']:.2f} |")
    return "\n".join(lines) + "\n"


def _floor_table(report: dict, by: dict) -> list[str]:
    """Against attention without the position term (runs that timed the floor): how much of relpos's time the
    position term costs, and the most any position term could gain over transformers."""
    cfg = report["config"]
    keys = [(m, w) for m in cfg["modes"] for w in cfg["windows"] if (m, w, FLOOR) in by]
    if not keys:
        return []
    lines = ["", "Against the floor (relpos's model with the relative position bias dropped, the shift mask kept):", "",
             "| mode | window | floor ms | relpos ms | relpos / floor | transformers eager / floor: the ceiling |",
             "|---|---|---|---|---|---|"]
    for mode, window in keys:
        floor, ours, hf = (by[(mode, window, v)]["ms"] for v in (FLOOR, "relpos", "hf_eager"))
        lines.append(f"| {mode} | {window} | {floor:.0f} | {ours:.0f} | {ours / floor:.2f}x | {hf / floor:.2f}x |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("swinv2", "swin"), default="swinv2")
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--modes", nargs="+", choices=("forward", "train"), default=["forward", "train"])
    parser.add_argument("--image", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_device_arguments(parser)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    fix_mmap_threshold()  # each call's peak resident memory is its own (docs/benchmarks/vision/swin.md)
    args = build_parser().parse_args(argv)
    args.device, args.dtype = (device_arguments(args)[k] for k in ("device", "dtype"))
    report = run(args)
    text = markdown(report)
    print(text)
    write_report(report, text, args.json, args.markdown)  # the page's generated region, the prose around it kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
