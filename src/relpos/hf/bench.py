"""Model-level benchmark: a transformers family as users run it, against the same model after :func:`accelerate`.

``--family`` picks the family from :data:`BUILDERS` (a table from family to a small model builder
with random weights). Variants (the same weights in each):

* ``hf_eager`` / ``hf_sdpa``: transformers' own attention (``attn_implementation="eager"`` /
  ``"sdpa"``; ``hf_sdpa`` only for families that support it), the bias and mask added into one
  ``(B, H, Lq, Lk)`` tensor;
* ``relpos``: :func:`relpos.hf.accelerate`;
* ``no_bias_floor``: the accelerated model with its attention swapped, while it runs, for plain SDPA with no bias
  and no mask at all (causal where the layer is): the floor any bias implementation is measured against. Everything
  else is relpos's model (its per-offset ``compute_bias``, its ``(B, 1, 1, Lk)`` key mask), so nothing of size
  ``(Lq, Lk)`` is built around the floor's attention either.

Modes: ``forward`` (the encoder, or the decoder-only base model, ``torch.no_grad``), ``train``
(forward + backward of the summed output, ``model.train()`` with the family's default dropout:
0.1 for the T5 families, 0 for Bloom, MPT and Falcon, as their checkpoints), ``generate``
(greedy, 32 new tokens with the KV cache, ``--new-tokens`` sets them), ``layer`` (a one-layer forward). Every batch is padded:
example 0 is full, the others hold 73% of L real tokens (1500 of 2048), padded on the right, and
on the left for decoder-only generation. Times are medians of interleaved rounds; memory is the
peak resident memory added by the call, with glibc's mmap threshold fixed so each call's peak is its own
(:func:`relpos._measure.fix_mmap_threshold`). A family that ``accelerate``
refuses (an adapter not in this installation) is skipped with its message.

    python benchmarks/t5_model.py --family bloom --d-model 512 --json docs/benchmarks/alibi-families/bloom.json --markdown docs/benchmarks/alibi-families/bloom.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import platform
from dataclasses import asdict, dataclass
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F

from .._io import write_report
from .._progress import Progress
from .._measure import add_device_arguments, device_arguments, fix_mmap_threshold, is_cuda, profile_call, timed_rounds
from .api import accelerate

__all__ = ["BUILDERS", "Builder", "ModelBenchConfig", "cpu_compile_config", "recompile_room", "run_model_bench", "markdown", "report_markdown"]

MODES = ("forward", "train", "generate", "generate_static", "layer")
DEFAULT_MODES = ("forward", "train", "generate", "layer")
GENERATING = ("generate", "generate_static")  # modes that build the generating model (an LM head)
VARIANTS = ("hf_eager", "hf_sdpa", "relpos", "no_bias_floor")
HF_VARIANTS = ("hf_eager", "hf_sdpa")
#: how ``no_bias_floor`` runs, recorded in each report: reports without it (before 2026-12-02) ran the floor under
#: another implementation name, which built transformers' dense bias and masks, so their floor is not a ceiling
FLOOR_KIND = "relpos's model, its attention swapped for SDPA with no bias and no mask while it runs"
VOCAB = 512


@dataclass
class ModelBenchConfig:
    family: str = "t5"
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    batches: tuple[int, ...] = (1, 2, 4)
    modes: tuple[str, ...] = DEFAULT_MODES
    rounds: int = 3
    d_model: int = 256
    heads: int = 8
    layers: int = 2
    new_tokens: int = 32
    memory_limit_gib: float = 14.0
    device: str = "cpu"
    dtype: str = "float32"
    compile_cpu: bool = False  # generate_static compiles its decoding step on the CPU too (inductor)
    profile: bool = False  # after each point's rounds, where each variant's time goes (relpos._measure.profile_call)

    @property
    def cuda(self) -> bool:
        return is_cuda(self.device)


@dataclass(frozen=True)
class Builder:
    """How to build one family's small model: ``build(mode, config) -> model`` (random weights).

    ``decoder_only``: generation pads on the left; ``sdpa``: transformers has an sdpa path; ``alibi``:
    an ALiBi family (no attention interface: its implementation is set in the config, and relpos's adapter calls
    ``alibi_attention``, which the floor swaps for plain SDPA);
    ``extra(batch, length)``: further inputs the model needs (UDOP's boxes); ``generate_inputs(ids,
    mask, config)``: the keyword arguments of ``generate`` where they are not ``input_ids`` and
    ``attention_mask`` (Pop2Piano's audio features, Pix2Struct's image patches); ``floor``:
    False where swapping the attention function would not remove the bias (LongT5's encoder attention does not
    go through transformers' attention interface); ``static_cache``: transformers' own model generates with
    ``cache_implementation="static"`` (mode ``generate_static``; tested for these, tests/hf/test_hf*static_cache.py).
    """

    build: Callable
    decoder_only: bool = False
    sdpa: bool = True
    alibi: bool = False
    extra: Callable | None = None
    generate_inputs: Callable | None = None
    floor: bool = True
    static_cache: bool = False


def _floor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, is_causal=bool(module.is_causal) and query.shape[2] > 1,
                                         dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _floor_alibi_attention(query, key, value, *, scale, dropout_p=0.0, **kwargs):
    """The ALiBi families' floor: causal SDPA, no bias, no padding mask."""
    causal = query.shape[2] > 1  # a prompt (Lq == Lk); one decoded token sees every key
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    out = F.scaled_dot_product_attention(query, key, value, is_causal=causal, dropout_p=dropout_p, scale=scale, **gqa)
    return out, None


@contextlib.contextmanager
def _floor():
    """While timing the floor variant: relpos's attention (the T5 families' registered ``"relpos"`` function, the
    ALiBi families' ``alibi_attention``) swapped for plain SDPA without bias or mask."""
    from transformers import AttentionInterface

    from . import bloom
    from . import falcon
    from . import mpt
    from ._attention import NAME

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(AttentionInterface._global_mapping, {NAME: _floor_attention}))
        for module in (bloom, falcon, mpt):
            stack.enter_context(mock.patch.object(module, "alibi_attention", _floor_alibi_attention))
        stack.enter_context(mock.patch.object(falcon, "per_key_channel", lambda q, k, v, per_key: (q, k, v)))
        yield


def _t5_config(config_class, config: ModelBenchConfig, mode: str, **extra):
    return config_class(
        vocab_size=VOCAB, d_model=config.d_model, d_kv=config.d_model // config.heads, num_heads=config.heads,
        d_ff=2 * config.d_model, num_layers=1 if mode == "layer" else config.layers,
        num_decoder_layers=config.layers, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        **extra,
    )


def _seq2seq(config_name: str, encoder_name: str, generator_name: str, **extra):
    def build(mode: str, config: ModelBenchConfig):
        import transformers

        model_class = getattr(transformers, generator_name if mode in GENERATING else encoder_name)
        return model_class(_t5_config(getattr(transformers, config_name), config, mode, **extra))

    return build


def _decoder(config_name: str, base_name: str, lm_name: str, fields: Callable):
    def build(mode: str, config: ModelBenchConfig):
        import transformers

        layers = 1 if mode == "layer" else config.layers
        settings = fields(config.d_model, config.heads, layers)
        model_config = getattr(transformers, config_name)(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, **settings)
        return getattr(transformers, lm_name if mode in GENERATING else base_name)(model_config)

    return build


def _pix2struct(mode: str, config: ModelBenchConfig):
    """Pix2Struct's text decoder (its relative bias; the vision encoder has none), built inside the full
    model; ``generate``: the image-to-text model (a one-layer vision encoder over 16 patches)."""
    import transformers

    d, h = config.d_model, config.heads
    text = dict(
        vocab_size=VOCAB, hidden_size=d, d_kv=d // h, num_heads=h, d_ff=2 * d,
        num_layers=1 if mode == "layer" else config.layers, dropout_rate=0.1, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )
    vision = dict(hidden_size=d, num_attention_heads=h, num_hidden_layers=1, d_ff=2 * d, d_kv=d // h)
    full = transformers.Pix2StructForConditionalGeneration(transformers.Pix2StructConfig(text_config=text, vision_config=vision))
    return full if mode in GENERATING else full.decoder  # the decoder alone: a Pix2StructTextModel


def _pix2struct_generate(ids, mask, config: ModelBenchConfig) -> dict:
    """16 image patches (row, column, pixels) and the decoder prompt, left-padded, as the prefix."""
    g = torch.Generator().manual_seed(ids.shape[1])
    batch, pixels = ids.shape[0], 16 * 16 * 3  # Pix2Struct's patch_embed_hidden_size (16 x 16 RGB patches)
    rows = torch.randint(0, 16, (batch, 16, 2), generator=g).float()  # (B, P, 2)
    patches = torch.cat([rows, torch.randn(batch, 16, pixels, generator=g)], -1).to(ids.device)  # (B, P, 2 + pixels)
    return {"flattened_patches": patches, "attention_mask": torch.ones(batch, 16, dtype=torch.long, device=ids.device),
            "decoder_input_ids": ids, "decoder_attention_mask": mask}


def _pop2piano(mode: str, config: ModelBenchConfig):
    """Pop2Piano's encoder (T5 attention with a relative bias); ``generate``: the whole model, MIDI tokens
    from audio features (composer tokens at the top of the vocabulary, as the checkpoint's generation config)."""
    model = _seq2seq("Pop2PianoConfig", "Pop2PianoForConditionalGeneration", "Pop2PianoForConditionalGeneration")(
        mode, config)
    if mode not in GENERATING:
        return model.get_encoder()
    composers = model.config.composer_vocab_size  # transformers wants one token per composer
    model.generation_config.composer_to_feature_token = {f"composer{i + 1}": VOCAB - composers + i for i in range(composers)}
    return model


def _pop2piano_generate(ids, mask, config: ModelBenchConfig) -> dict:
    """Audio features ``(B, L, d_model)`` (what Pop2Piano's feature extractor hands the model) with the padding mask."""
    g = torch.Generator().manual_seed(ids.shape[1])
    features = torch.randn(*ids.shape, config.d_model, generator=g).to(ids.device, getattr(torch, config.dtype))
    return {"input_features": features, "attention_mask": mask, "composer": "composer1"}


def _udop_boxes(batch: int, length: int) -> dict:
    g = torch.Generator().manual_seed(length + 1)
    corners = torch.rand(batch, length, 2, generator=g) * 0.8  # (B, L, 2)
    return {"bbox": torch.cat([corners, corners + 0.1], dim=-1)}  # (B, L, 4): x0, y0, x1, y1 in [0, 1]


#: family -> how to build its small model; the --family choices
BUILDERS: dict[str, Builder] = {
    "t5": Builder(_seq2seq("T5Config", "T5EncoderModel", "T5ForConditionalGeneration"), static_cache=True),
    "umt5": Builder(_seq2seq("UMT5Config", "UMT5EncoderModel", "UMT5ForConditionalGeneration"),  # a table per layer
                    static_cache=True),
    "bloom": Builder(_decoder("BloomConfig", "BloomModel", "BloomForCausalLM", lambda d, h, n: dict(
        hidden_size=d, n_head=h, n_layer=n)), decoder_only=True, sdpa=False, alibi=True, static_cache=True),
    "mpt": Builder(_decoder("MptConfig", "MptModel", "MptForCausalLM", lambda d, h, n: dict(
        d_model=d, n_heads=h, n_layers=n, max_seq_len=8192)), decoder_only=True, sdpa=False, alibi=True),
    "falcon": Builder(_decoder("FalconConfig", "FalconModel", "FalconForCausalLM", lambda d, h, n: dict(
        hidden_size=d, num_attention_heads=h, num_hidden_layers=n, alibi=True, multi_query=False, parallel_attn=False,
        bias=True)), decoder_only=True, alibi=True),  # as Falcon-RW, the ALiBi Falcons
    "switch_transformers": Builder(_seq2seq("SwitchTransformersConfig", "SwitchTransformersEncoderModel",
                                            "SwitchTransformersForConditionalGeneration", num_experts=4,
                                            expert_capacity=4096), sdpa=False),
    "pop2piano": Builder(_pop2piano, generate_inputs=_pop2piano_generate),
    "pix2struct": Builder(_pix2struct, decoder_only=True, generate_inputs=_pix2struct_generate),
    "udop": Builder(_seq2seq("UdopConfig", "UdopEncoderModel", "UdopForConditionalGeneration"), extra=_udop_boxes),
    "longt5": Builder(_seq2seq("LongT5Config", "LongT5EncoderModel", "LongT5ForConditionalGeneration"), sdpa=False,
                      floor=False),  # local attention (transformers' default): local_radius 127, blocks of 128
    "longt5-tglobal": Builder(_seq2seq("LongT5Config", "LongT5EncoderModel", "LongT5ForConditionalGeneration",
                                       encoder_attention_type="transient-global"), sdpa=False, floor=False),
}


def _variant_names(builder: Builder) -> tuple[str, ...]:
    return tuple(v for v in VARIANTS if (builder.sdpa or v != "hf_sdpa") and (builder.floor or v != "no_bias_floor"))


def _models(config: ModelBenchConfig, mode: str) -> dict[str, torch.nn.Module]:
    builder = BUILDERS[config.family]
    torch.manual_seed(0)
    base = builder.build(mode, config).to(config.device, getattr(torch, config.dtype))
    base.train(mode == "train")
    models = {}
    for name in _variant_names(builder):
        model = copy.deepcopy(base)
        if name in HF_VARIANTS and builder.alibi:
            model.config._attn_implementation = name[3:]  # these models refuse set_attn_implementation
        elif name in HF_VARIANTS:
            model.set_attn_implementation(name[3:])
        else:
            accelerate(model)  # the floor too: its attention is swapped only while it runs (_floor)
        models[name] = model
    return models


def _inputs(batch: int, length: int, left: bool = False, device: str = "cpu"):
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    real = int(length * 0.73)
    if left:
        mask[1:, : length - real] = 0  # decoder-only generation pads on the left
    else:
        mask[1:, real:] = 0  # every example but the first is padded
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def _output(out):
    return out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out.logits


def _generate_options(mode: str, config: ModelBenchConfig) -> dict:
    """``generate``'s cache options: none for ``generate``; a static cache for ``generate_static``, which
    ``generate()`` compiles itself on CUDA (``mode="reduce-overhead"``) and leaves uncompiled on the CPU unless
    ``config.compile_cpu``: then with :func:`cpu_compile_config`."""
    if mode != "generate_static":
        return {}
    if not config.compile_cpu or config.cuda:
        return {"cache_implementation": "static"}
    return {"cache_implementation": "static", "compile_config": cpu_compile_config()}


def cpu_compile_config():
    """transformers' ``CompileConfig`` for a static-cache decoding step compiled on the CPU: inductor,
    ``fullgraph=True`` (a graph break raises instead of running eagerly), ``dynamic=False``, forced onto the CPU
    (``generate()`` compiles only on CUDA otherwise), as transformers' own compiled-generation test does."""
    import transformers

    config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default")
    config._compile_all_devices = True
    return config


def _step(mode: str, model, kwargs: dict, new_tokens: int, floor: bool, options: dict | None = None):
    if mode == "train":

        def run():
            model.zero_grad(set_to_none=True)
            _output(model(**kwargs)).sum().backward()

    elif mode in GENERATING:
        options = options or {}  # _generate_options

        def run():
            with torch.no_grad():
                model.generate(**kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **options)

    else:

        def run():
            with torch.no_grad():
                model(**kwargs)

    if not floor:
        return run

    def floored():
        with _floor():
            run()

    return floored


#: torch.compile's recompile limit per code object (torch 2.11-2.13's default), which one model's compiled decoding step
#: stays within; its frames' code (transformers' forward wrappers) is shared by every model in the process.
ONE_MODEL_RECOMPILES = 8


@contextlib.contextmanager
def _compile_room(config: ModelBenchConfig, variants: int):
    """While ``generate_static`` runs: room for every model's own compiles in dynamo's per-code-object limit.

    Each variant is a separate model a user would compile alone, but dynamo counts compiles per code object, and the
    compiled frames (transformers' forward wrappers) are the same code for all of them: the variants compiled last
    in a grid point would find the limit spent by the others and run eagerly (the H100 run of 2026-11-27 logged
    "recompile limit (8)" for relpos's and the floor's compiled T5, which came after transformers' two). The limit
    is raised to ``ONE_MODEL_RECOMPILES`` per model and grid point (:func:`recompile_room`), and restored after."""
    if "generate_static" not in config.modes:
        yield None
        return
    with recompile_room(variants * len(config.batches) * len(config.lengths)) as limit:
        yield limit


@contextlib.contextmanager
def recompile_room(models: int):
    """Dynamo's per-code-object recompile limit raised to ``ONE_MODEL_RECOMPILES`` per model (never lowered) while
    ``models`` compiled models share transformers' forward wrappers; yields the limit, restores it after."""
    dynamo = torch._dynamo.config
    saved = dynamo.recompile_limit
    dynamo.recompile_limit = max(saved, ONE_MODEL_RECOMPILES * models)
    try:
        yield dynamo.recompile_limit
    finally:
        dynamo.recompile_limit = saved


def _fits(variant: str, mode: str, batch: int, length: int, config: ModelBenchConfig) -> bool:
    dense = batch * config.heads * length * length * 4 / 2**30  # one fp32 (B, H, L, L) tensor, GiB
    copies = {"hf_eager": 4, "hf_sdpa": 3}.get(variant, 0) * (3 if mode == "train" else 1)
    return copies * dense <= config.memory_limit_gib


def _refusal(config: ModelBenchConfig) -> str | None:
    """Why ``accelerate`` refuses this family here (its adapter is not installed), or None."""
    model = BUILDERS[config.family].build("layer", ModelBenchConfig(d_model=32, heads=2, layers=1))
    try:
        accelerate(model)
    except (TypeError, ValueError, RuntimeError, ImportError) as exc:
        return str(exc)
    return None


def run_model_bench(config: ModelBenchConfig, on_point: Callable[[dict], None] | None = None) -> dict:
    """Every (mode, batch, length) point of ``config``; ``on_point(report)`` after each one (the report so
    far, with ``"complete": False``), so that a long grid stopped early keeps what it measured."""
    import transformers

    import relpos

    builder = BUILDERS[config.family]
    if "generate_static" in config.modes and not builder.static_cache:
        static = ", ".join(name for name, b in BUILDERS.items() if b.static_cache)
        raise ValueError(f"modes: generate_static needs a family whose transformers model generates with a static cache "
                         f"({static}), got family {config.family!r}; drop generate_static from the modes")
    fixed = fix_mmap_threshold() if not config.cuda else None
    names = _variant_names(builder)
    modes = list(config.modes)
    refused = _refusal(config)
    plan = [(m, b, n) for m in modes for b in config.batches for n in config.lengths] if refused is None else []
    progress = Progress(len(plan) * len(names) * config.rounds)
    results = []
    report = {
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(config.device) if config.cuda else "cpu", "dtype": config.dtype,
                    "mmap_threshold_fixed": fixed,
                    "transformers": transformers.__version__, "relpos": relpos.__version__},
        "config": asdict(config),
        "variants": list(names),
        "floor": FLOOR_KIND,
        "refused": refused,
        "results": results,  # filled point by point
        "complete": False,
    }
    with _compile_room(config, len(names)) as limit:
        report["machine"]["recompile_limit"] = limit  # None: no compiled mode ran
        _run_grid(config, builder, modes if refused is None else (), names, progress, results, report, on_point)
    progress.close()
    return report | {"complete": True}


def _run_grid(config, builder, modes, names, progress, results, report, on_point) -> None:
    for mode in modes:
        models = _models(config, mode)
        left = builder.decoder_only and mode in GENERATING
        for batch in config.batches:
            for length in config.lengths:
                ids, mask = _inputs(batch, length, left, config.device)
                extra = {k: v.to(config.device) for k, v in (builder.extra(batch, length) if builder.extra else {}).items()}
                kwargs = {"input_ids": ids, "attention_mask": mask, **extra}
                if mode in GENERATING and builder.generate_inputs is not None:
                    kwargs = builder.generate_inputs(ids, mask, config)
                variants = {}
                for name, model in models.items():
                    if _fits(name, mode, batch, length, config):
                        floor = name == "no_bias_floor"
                        variants[name] = _step(mode, model, kwargs, config.new_tokens, floor, _generate_options(mode, config))
                    else:
                        results.append({"mode": mode, "batch": batch, "length": length, "variant": name,
                                        "ms": None, "peak_mib": None, "note": "skipped: over the memory limit"})
                        progress.total -= config.rounds
                label = f"{config.family} {mode} B={batch} L={length}"
                for name, (ms, peak, samples) in timed_rounds(variants, config.rounds, progress, label, config.cuda).items():
                    results.append({"mode": mode, "batch": batch, "length": length, "variant": name, "ms": ms,
                                    "peak_mib": peak, "note": "", "samples": samples})
                    if config.profile:
                        results[-1]["profile"] = _profiled(variants[name], config.cuda, mode)
                if on_point is not None:
                    on_point(report)
                gc.collect()
        del models


def _profiled(fn: Callable, cuda: bool, mode: str) -> dict:
    """:func:`relpos._measure.profile_call` of one variant (a generation, many steps, once), or the profiler's error:
    a profile that fails (CUPTI under a captured CUDA graph, say) costs its table row, not the point's timings."""
    try:
        return profile_call(fn, cuda, calls=1 if mode in GENERATING else 3)
    except Exception as error:  # noqa: BLE001 - reported in the table instead of ending the grid
        return {"error": f"{type(error).__name__}: {str(error)[:160]}"}


def _fastest_hf(table: dict, key: tuple) -> dict | None:
    timed = [table[key + (v,)] for v in HF_VARIANTS if table.get(key + (v,)) and table[key + (v,)]["ms"]]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def _ceiling(best: dict | None, floor: dict | None) -> str:
    """transformers' fastest time over the floor's: no implementation of the position term can be faster than the
    same model without it, so a target above this ratio cannot be met at that point."""
    if not best or not floor or not floor["ms"]:
        return "n/a"
    return f"{best['ms'] / floor['ms']:.2f}x"


def markdown(report: dict) -> str:
    if report.get("refused"):
        return f"{report['config']['family']}: skipped, relpos.hf.accelerate refuses it here: {report['refused']}\n"
    names = report.get("variants", VARIANTS)
    table = {(r["mode"], r["batch"], r["length"], r["variant"]): r for r in report["results"] if "batch" in r}
    lines = [f"{r['mode']}: {r['note']}" for r in report["results"] if "batch" not in r]
    for mode in report["config"]["modes"]:
        if not any(key[0] == mode for key in table):
            continue
        ceiling = bool(report.get("floor")) and "no_bias_floor" in names  # the floor is a ceiling for any position term
        extra = " fastest hf / floor (time): the ceiling |" if ceiling else ""
        lines += [f"### {mode}", "", "| B | L | " + " | ".join(names)
                  + " | fastest hf / relpos (time) | relpos / fastest hf (memory) |" + extra,
                  "|---|---|" + "---|" * (len(names) + 2 + ceiling)]
        for batch in report["config"]["batches"]:
            for length in report["config"]["lengths"]:
                cells = []
                for name in names:
                    r = table.get((mode, batch, length, name))
                    cells.append("skipped" if r is None or r["ms"] is None else f"{r['ms']:.0f} ms / {r['peak_mib']:.0f} MiB")
                best, ours = _fastest_hf(table, (mode, batch, length)), table.get((mode, batch, length, "relpos"))
                speed = memory = "n/a"
                if best and ours and ours["ms"]:
                    speed = f"{best['ms'] / ours['ms']:.2f}x ({best['variant'][3:]})"
                    memory = f"{ours['peak_mib'] / best['peak_mib']:.2f}x" if best["peak_mib"] else "n/a"
                row = f"| {batch} | {length} | " + " | ".join(cells) + f" | {speed} | {memory} |"
                if ceiling:
                    row += f" {_ceiling(best, table.get((mode, batch, length, 'no_bias_floor')))} |"
                lines.append(row)
        lines.append("")
    return "\n".join(lines + _profile_lines(report["results"]))


def _profile_lines(results: list[dict]) -> list[str]:
    """The profile of each point's variants (``--profile``): where the time of one call goes."""
    rows = [r for r in results if r.get("profile")]
    if not rows:
        return []
    lines = ["### where the time goes (torch.profiler, per call)", "",
             "wall: the call's time under the profiler; busy: the GPU's kernels and copies (on the CPU: the operators' "
             "own time), far below wall where the GPU waits for the CPU; attention: the attention kernels' share of "
             "busy; syncs: the CPU waiting for the GPU (.item(), copies to the host).", "",
             "| mode | B | L | variant | wall | busy | attention | syncs | top kernels (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["profile"]
        if "error" in p:
            lines.append(f"| {r['mode']} | {r['batch']} | {r['length']} | {r['variant']} | not profiled: "
                         f"{p['error'].replace('|', '/')} | | | | |")
            continue
        attention = "-" if p["attention_ms"] is None else f"{p['attention_ms']:.2f} ms"
        syncs = "-" if p["syncs_per_call"] is None else f"{p['syncs_per_call']:.1f}"
        top = "; ".join(f"{name.replace('|', '/')} {ms:.2f}" for name, ms in p["top"][:4])
        lines.append(f"| {r['mode']} | {r['batch']} | {r['length']} | {r['variant']} | {p['wall_ms']:.2f} ms | "
                     f"{p['busy_ms']:.2f} ms | {attention} | {syncs} | {top} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Model benchmark: transformers eager/sdpa vs relpos.hf.accelerate")
    parser.add_argument("--family", default="t5", choices=sorted(BUILDERS), help="the model family (default t5)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="comma-separated sequence lengths")
    parser.add_argument("--batches", default="1,2,4", help="comma-separated batch sizes")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, among {', '.join(MODES)} (default: all but generate_static)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds per variant (median)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each generate mode generates (default 32)")
    parser.add_argument("--compile-cpu", action="store_true",
                        help="generate_static compiles the decoding step on the CPU too (inductor, fullgraph; "
                             "generate() compiles it only on CUDA)")
    parser.add_argument("--profile", action="store_true",
                        help="after each point, torch.profiler over each variant's call: wall and busy time, the "
                             "attention kernels' share, host syncs, the top kernels (a table after the others)")
    add_device_arguments(parser)
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument("--markdown", help="write the tables here")
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if set(modes) - set(MODES):
        parser.error(f"--modes must be among {', '.join(MODES)}; got {args.modes}")
    try:
        device = device_arguments(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.new_tokens < 1:
        parser.error(f"--new-tokens must be a positive number of tokens, got {args.new_tokens}")
    if args.compile_cpu and ("generate_static" not in modes or is_cuda(device["device"])):
        parser.error(f"--compile-cpu compiles generate_static's decoding step on the CPU; got --modes {args.modes} and "
                     f"--device {device['device']}: add generate_static to --modes and run on the CPU (on CUDA "
                     "generate() compiles it itself)")
    config = ModelBenchConfig(
        lengths=tuple(int(x) for x in args.lengths.split(",")), batches=tuple(int(x) for x in args.batches.split(",")),
        modes=modes, rounds=args.rounds, family=args.family, d_model=args.d_model, heads=args.heads, layers=args.layers,
        new_tokens=args.new_tokens, compile_cpu=args.compile_cpu, profile=args.profile, **device,
    )
    try:
        report = run_model_bench(config, on_point=lambda partial: _save(partial, args.json, args.markdown))
    except ValueError as exc:  # refused before any work (a mode the family's transformers model lacks)
        parser.error(str(exc))
    print(_save(report, args.json, args.markdown))
    return 0


def report_markdown(report: dict) -> str:
    """What ``--markdown`` writes: the run's header (family, sizes, machine), then :func:`markdown`'s tables.
    ``tools/bench_tables.py`` renders the committed tables with it; a report from before a field existed
    (``family``, ``device``, ``dtype``) is rendered without it."""
    machine, c = report["machine"], report["config"]
    where = ", ".join([machine["platform"], *(machine[k] for k in ("device", "dtype") if k in machine),
                       f"{machine['cpus']} threads", f"torch {machine['torch']}", f"transformers {machine['transformers']}"])
    header = (f"family {c['family']}, d_model {c['d_model']}, {c['heads']} heads, {c['layers']} layers; " if "family" in c else "") \
        + f"machine: {where}"
    if c.get("compile_cpu"):
        header += "; generate_static's decoding step compiled on the CPU (inductor, fullgraph, static shapes)"
    if not report.get("complete", True):
        header += "\n\n**Partial**: the run was stopped before every point of the grid (missing points read \"skipped\")."
    return header + "\n\n" + markdown(report)


def _save(report: dict, json_path: str | None, markdown_path: str | None) -> str:
    """Write the report (atomically) and its tables (into the page's generated region where it has one); a grid
    stopped early says so in its header."""
    text = report_markdown(report)
    write_report(report, text, json_path, markdown_path)
    return text
