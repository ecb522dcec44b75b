"""Model-level benchmark: transformers' T5 as users run it, against the same model after :func:`accelerate`.

Variants (the same weights in each):

* ``hf_eager`` / ``hf_sdpa``: ``attn_implementation="eager"`` / ``"sdpa"`` (transformers' dense
  ``compute_bias``, bias and mask added into one ``(B, H, Lq, Lk)`` tensor);
* ``relpos``: :func:`relpos.hf.accelerate`;
* ``no_bias_floor``: the same model with plain SDPA attention and no bias and no mask at all (not
  the same function: the floor any bias implementation is measured against).

Modes: ``forward`` (T5 encoder, ``torch.no_grad``), ``train`` (T5 encoder, forward + backward of
the summed output, ``model.train()`` with T5's dropout 0.1), ``generate`` (encoder-decoder,
greedy, 32 new tokens with the KV cache), ``layer`` (a one-layer encoder forward). Every batch is
padded: example 0 is full, the others hold 73% of L real tokens (1500 of 2048). Times are medians
of interleaved rounds; memory is the peak resident memory added by the call (:mod:`relpos.bench`).

    python benchmarks/t5_model.py --json docs/bench-t5.json --markdown docs/bench-t5.md
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .._io import write_text
from .._progress import Progress
from ..bench import _timed_rounds
from .api import accelerate

__all__ = ["ModelBenchConfig", "run_model_bench", "markdown"]

MODES = ("forward", "train", "generate", "layer")
VARIANTS = ("hf_eager", "hf_sdpa", "relpos", "no_bias_floor")
FLOOR = "relpos_no_bias_floor"


@dataclass
class ModelBenchConfig:
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    batches: tuple[int, ...] = (1, 2, 4)
    modes: tuple[str, ...] = MODES
    rounds: int = 3
    d_model: int = 256
    heads: int = 8
    layers: int = 2
    new_tokens: int = 32
    memory_limit_gib: float = 14.0


def _floor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, is_causal=bool(module.is_causal) and query.shape[2] > 1,
                                         dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _models(config: ModelBenchConfig, mode: str) -> dict[str, torch.nn.Module]:
    from transformers import AttentionInterface, T5Config, T5EncoderModel, T5ForConditionalGeneration

    AttentionInterface.register(FLOOR, _floor_attention)
    t5 = T5Config(
        vocab_size=512, d_model=config.d_model, d_kv=config.d_model // config.heads, num_heads=config.heads,
        d_ff=2 * config.d_model, num_layers=1 if mode == "layer" else config.layers,
        num_decoder_layers=config.layers, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    base = (T5ForConditionalGeneration if mode == "generate" else T5EncoderModel)(t5)
    base.train(mode == "train")
    models = {}
    for name in VARIANTS:
        model = copy.deepcopy(base)
        if name == "hf_eager":
            model.set_attn_implementation("eager")
        elif name == "hf_sdpa":
            model.set_attn_implementation("sdpa")
        else:
            accelerate(model)  # per-offset bias
            if name == "no_bias_floor":
                model.set_attn_implementation(FLOOR)  # ... then ignored, with the mask
        models[name] = model
    return models


def _inputs(batch: int, length: int):
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(2, 512, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, int(length * 0.73) :] = 0  # every example but the first is padded
    return ids.masked_fill(mask == 0, 0), mask


def _step(mode: str, model, ids, mask, new_tokens: int):
    if mode == "train":

        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()

    elif mode == "generate":

        def run():
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False)

    else:

        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)

    return run


def _fits(variant: str, mode: str, batch: int, length: int, config: ModelBenchConfig) -> bool:
    dense = batch * config.heads * length * length * 4 / 2**30  # one fp32 (B, H, L, L) tensor, GiB
    copies = {"hf_eager": 4, "hf_sdpa": 3}.get(variant, 0) * (3 if mode == "train" else 1)
    return copies * dense <= config.memory_limit_gib


def run_model_bench(config: ModelBenchConfig) -> dict:
    import transformers

    import relpos

    plan = [(m, b, n) for m in config.modes for b in config.batches for n in config.lengths]
    progress = Progress(len(plan) * len(VARIANTS) * config.rounds)
    results = []
    for mode in config.modes:
        models = _models(config, mode)
        for batch in config.batches:
            for length in config.lengths:
                ids, mask = _inputs(batch, length)
                variants = {}
                for name, model in models.items():
                    if _fits(name, mode, batch, length, config):
                        variants[name] = _step(mode, model, ids, mask, config.new_tokens)
                    else:
                        results.append({"mode": mode, "batch": batch, "length": length, "variant": name,
                                        "ms": None, "peak_mib": None, "note": "skipped: over the memory limit"})
                        progress.total -= config.rounds
                label = f"{mode} B={batch} L={length}"
                for name, (ms, peak, samples) in _timed_rounds(variants, config.rounds, progress, label).items():
                    results.append({"mode": mode, "batch": batch, "length": length, "variant": name, "ms": ms,
                                    "peak_mib": peak, "note": "", "samples": samples})
                gc.collect()
        del models
    progress.close()
    return {
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "relpos": relpos.__version__},
        "config": asdict(config),
        "results": results,
    }


def markdown(report: dict) -> str:
    table = {(r["mode"], r["batch"], r["length"], r["variant"]): r for r in report["results"]}
    lines = []
    for mode in report["config"]["modes"]:
        lines += [f"### {mode}", "", "| B | L | " + " | ".join(VARIANTS) + " | hf_sdpa / relpos (time) | relpos / hf_sdpa (memory) |",
                  "|---|---|" + "---|" * (len(VARIANTS) + 2)]
        for batch in report["config"]["batches"]:
            for length in report["config"]["lengths"]:
                cells = []
                for name in VARIANTS:
                    r = table.get((mode, batch, length, name))
                    cells.append("skipped" if r is None or r["ms"] is None else f"{r['ms']:.0f} ms / {r['peak_mib']:.0f} MiB")
                sdpa, ours = table.get((mode, batch, length, "hf_sdpa")), table.get((mode, batch, length, "relpos"))
                speed = memory = "n/a"
                if sdpa and ours and sdpa["ms"] and ours["ms"]:
                    speed = f"{sdpa['ms'] / ours['ms']:.2f}x"
                    memory = f"{ours['peak_mib'] / sdpa['peak_mib']:.2f}x" if sdpa["peak_mib"] else "n/a"
                lines.append(f"| {batch} | {length} | " + " | ".join(cells) + f" | {speed} | {memory} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="T5 model benchmark: transformers eager/sdpa vs relpos.hf.accelerate")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="comma-separated sequence lengths")
    parser.add_argument("--batches", default="1,2,4", help="comma-separated batch sizes")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, among {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds per variant (median)")
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument("--markdown", help="write the tables here")
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if set(modes) - set(MODES):
        parser.error(f"--modes must be among {', '.join(MODES)}; got {args.modes}")
    config = ModelBenchConfig(
        lengths=tuple(int(x) for x in args.lengths.split(",")), batches=tuple(int(x) for x in args.batches.split(",")),
        modes=modes, rounds=args.rounds,
    )
    report = run_model_bench(config)
    text = markdown(report)
    machine = report["machine"]
    header = f"machine: {machine['platform']}, {machine['cpus']} threads, torch {machine['torch']}, transformers {machine['transformers']}"
    print(header, "", text, sep="\n")
    if args.json:
        write_text(args.json, json.dumps(report, indent=1))
    if args.markdown:
        write_text(args.markdown, header + "\n\n" + text)
    return 0
