"""One SAM ViT-B global attention layer (and the ViT-B image encoder) at 1024 x 1024: relpos vs transformers.

    python benchmarks/sam.py --mode forward --rounds 3
    python benchmarks/sam.py --mode train --rounds 3
    python benchmarks/sam.py --mode window --rounds 5     # one windowed layer: 25 windows of 14 x 14
    python benchmarks/sam.py --mode encoder --rounds 2
    python benchmarks/sam.py --mode encoder --rounds 5 --device cuda --dtype bfloat16 --json OUT/sam.json --markdown OUT/sam.md

``--json docs/benchmarks/vision/sam.json --markdown docs/benchmarks/vision/sam.md`` keeps each mode's run in the
JSON (the other modes' runs stay) and writes its table into the page's region generated for that mode.

Variants, interleaved round by round (this kind of shared VM has slow phases lasting seconds):
* ``hf_sdpa`` / ``hf_eager``: transformers' ``SamVisionSdpaAttention`` / ``SamVisionAttention``;
* ``relpos_tiles`` / ``relpos_fold``: the same layer accelerated (``relpos.hf.accelerate``'s forward),
  with ``impl="tiles"`` (the CPU default; CPU only) or ``impl="fold"`` (``auto`` on CUDA);
* ``relpos_triton`` (CUDA only): the same with ``impl="triton"``, the positions inside a flash kernel's tiles
  (in ``encoder`` mode: the accelerated model with every layer's ``auto`` sent to it);
* ``no_bias_floor``: the same layer with ``use_rel_pos=False`` (SDPA with no bias): the floor.

Layer: 64 x 64 tokens, 12 heads, head dim 64, B = 1, random weights and std-1 tables. ``train`` is
forward + backward of the layer (gradients into its input, weights and both tables). Time: median
of the rounds; memory: peak extra memory of one call (resident on the CPU, allocated on CUDA:
``relpos._measure.measure``). ``--device`` and ``--dtype`` move every variant's weights and inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys

import torch

import relpos.encodings.decomposed as decomposed
from relpos._io import write_report
from relpos._measure import add_device_arguments, device_arguments, is_cuda, measure
from relpos.encodings.decomposed import decomposed_attention, decomposed_terms


def _layer(attn: str, use_rel_pos: bool = True, window_size: int = 0, **factory):
    from transformers import SamVisionConfig
    from transformers.models.sam import modeling_sam

    config = SamVisionConfig(use_rel_pos=use_rel_pos)  # ViT-B: hidden 768, 12 heads, 1024 px, patch 16
    cls = modeling_sam.SamVisionSdpaAttention if attn == "sdpa" else modeling_sam.SamVisionAttention
    torch.manual_seed(0)
    layer = cls(config, window_size=window_size)
    if use_rel_pos:
        with torch.no_grad():
            layer.rel_pos_h.normal_()
            layer.rel_pos_w.normal_()
    return layer.to(**factory)


def _relpos_layer(layer, impl: str):
    """The accelerated layer's computation with a chosen ``impl`` (relpos.hf.sam's forward, impl fixed)."""

    def run(hidden):
        batch, height, width, _ = hidden.shape
        heads = layer.num_attention_heads
        qkv = layer.qkv(hidden).reshape(batch, height * width, 3, heads, -1).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        query, key, value = qkv.unbind(0)
        rel_h, rel_w = decomposed_terms(query, layer.rel_pos_h, layer.rel_pos_w, (height, width))
        out = decomposed_attention(query, key, value, rel_h, rel_w, scale=layer.scale, impl=impl)  # (B, H, N, d)
        return layer.proj(out.permute(0, 2, 1, 3).reshape(batch, height, width, -1)), None

    return run


def _layer_variants(mode: str, **factory) -> dict:
    window = 14 if mode == "window" else 0  # SAM's windowed layers: 25 windows of 14 x 14 (64 padded to 70)
    sdpa, eager = _layer("sdpa", window_size=window, **factory), _layer("eager", window_size=window, **factory)
    floor = _layer("sdpa", False, window, **factory)
    eager.load_state_dict(sdpa.state_dict())
    hidden = torch.randn(25, 14, 14, 768) if window else torch.randn(1, 64, 64, 768)
    hidden = hidden.to(**factory)
    fns = {"hf_sdpa": sdpa, "hf_eager": eager}
    cuda = is_cuda(str(factory["device"]))
    fns["relpos_triton" if cuda else "relpos_tiles"] = _relpos_layer(sdpa, "triton" if cuda else "tiles")  # tiles: CPU
    fns |= {"relpos_fold": _relpos_layer(sdpa, "fold"), "no_bias_floor": floor}
    if mode in ("forward", "window"):

        def forward(fn):
            def call():
                with torch.no_grad():
                    fn(hidden)

            return call

        return {name: forward(fn) for name, fn in fns.items()}
    leaf = hidden.clone().requires_grad_()

    def train(fn, params):
        def call():
            for p in params:
                p.grad = None
            leaf.grad = None
            fn(leaf)[0].sum().backward()

        return call

    params = {"hf_eager": list(eager.parameters()), "no_bias_floor": list(floor.parameters())}
    return {name: train(fn, params.get(name, list(sdpa.parameters()))) for name, fn in fns.items()}


def _encoder_variants(**factory) -> dict:
    from transformers import SamVisionConfig, SamVisionModel

    import relpos.hf

    torch.manual_seed(0)
    sdpa = SamVisionModel._from_config(SamVisionConfig(), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in sdpa.named_parameters():
            if name.endswith(("rel_pos_h", "rel_pos_w")):
                p.normal_()
    sdpa = sdpa.to(**factory)
    ours = relpos.hf.accelerate(copy.deepcopy(sdpa))
    floor = SamVisionModel._from_config(SamVisionConfig(use_rel_pos=False), attn_implementation="sdpa").eval().to(**factory)
    pixels = torch.randn(1, 3, 1024, 1024).to(**factory)

    def forward(model, impl: str | None = None):
        def call():
            chosen = contextlib.nullcontext() if impl is None else _every_layer(impl)
            with torch.no_grad(), chosen:
                model(pixels)

        return call

    variants = {"hf_sdpa": forward(sdpa), "relpos": forward(ours)}
    if is_cuda(str(factory["device"])):
        variants["relpos_triton"] = forward(ours, "triton")
    return variants | {"no_bias_floor": forward(floor)}


@contextlib.contextmanager
def _every_layer(impl: str):
    """While inside: every ``decomposed_attention(impl="auto")`` call runs ``impl`` (the accelerated model's layers)."""
    saved = decomposed._choose
    decomposed._choose = lambda chosen, query, dropout_p: impl if chosen == "auto" else chosen
    try:
        yield
    finally:
        decomposed._choose = saved


def run(variants: dict, rounds: int, cuda: bool = False) -> dict:
    samples = {name: [] for name in variants}
    peaks = {name: [] for name in variants}
    for fn in variants.values():  # warm-up, not timed
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            ms, peak = measure(fn, cuda=cuda)
            samples[name].append(ms)
            peaks[name].append(peak)
            print(f"  {name}: {ms:.0f} ms, {peak:.0f} MiB", file=sys.stderr, flush=True)
    return {name: (statistics.median(samples[name]), max(peaks[name]), samples[name]) for name in variants}


def markdown(mode: str, results: dict) -> str:
    base_ms, base_mib = results["hf_sdpa"][:2]
    lines = [f"### {mode}", "", "| variant | time (median) | peak extra memory | hf_sdpa / variant (time) | variant / hf_sdpa (memory) | rounds (ms) |", "|---|---|---|---|---|---|"]
    for name, (ms, mib, samples) in results.items():
        rounds = ", ".join(f"{s:.0f}" for s in samples)
        lines.append(f"| {name} | {ms:.0f} ms | {mib:.0f} MiB | {base_ms / ms:.2f}x | {mib / base_mib:.2f}x | {rounds} |")
    return "\n".join(lines)


def page(payload: dict, mode: str) -> str:
    """One mode's table from the JSON ``--json`` keeps (``tools/bench_tables.py`` renders the committed ones)."""
    results = payload["modes"][mode]["results"]
    return markdown(mode, {name: (r["ms"], r["peak_mib"], r["samples"]) for name, r in results.items()}) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("forward", "train", "window", "encoder"), default="forward")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forward-rows", type=int, default=None, help="override the tiles' forward block (query rows)")
    add_device_arguments(parser)
    parser.add_argument("--json", help="keep this mode's run in this JSON file (the other modes' runs stay)")
    parser.add_argument("--markdown", help="write this mode's table into this page's region generated for it")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.forward_rows:
        decomposed._FORWARD_ROWS = args.forward_rows
    device = device_arguments(args)
    factory = {"device": torch.device(device["device"]), "dtype": getattr(torch, device["dtype"])}
    variants = _encoder_variants(**factory) if args.mode == "encoder" else _layer_variants(args.mode, **factory)
    cuda = is_cuda(device["device"])
    where = torch.cuda.get_device_name(factory["device"]) if cuda else f"{torch.get_num_threads()} threads"
    machine = f"{platform.platform()}, {where}, {device['dtype']}, torch {torch.__version__}"
    print(f"machine: {machine}")
    results = run(variants, args.rounds, cuda)
    print(markdown(args.mode, results))
    payload = {"modes": {}}
    if args.json and os.path.exists(args.json):
        with open(args.json) as fh:
            payload = json.load(fh)
    payload["modes"][args.mode] = {
        "command": "python benchmarks/sam.py " + " ".join(sys.argv[1:] if argv is None else argv), "machine": machine,
        "results": {name: {"ms": ms, "peak_mib": mib, "samples": samples} for name, (ms, mib, samples) in results.items()},
    }
    write_report(payload, page(payload, args.mode), args.json, args.markdown, part=args.mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
