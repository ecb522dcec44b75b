"""``relpos extrapolate``: train short, test long, every position encoding side by side.

Each encoding gets the same byte-level transformer (:class:`relpos.lm.TransformerLM`), seed,
data order, size and number of steps. Each is trained at ``train_len`` and evaluated in bits per
byte (and perplexity) on held-out text at 1x, 2x, 4x, 8x and 16x that length. The learned
absolute embedding cannot represent positions past its table: it is reported as not applicable
there, like the seeds' "infinity".

Runs under ``torchrun --nproc_per_node N`` unchanged (DistributedDataParallel; gloo on CPU,
nccl on GPU): each rank trains on its slice of the same global batch.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import relpos

from ._io import json_safe, save_torch, save_with, write_text
from ._progress import Progress
from .buckets import STRATEGIES
from .corpus import Corpus, eval_windows, load_corpus, sample_batch, stdlib_corpus
from .lm import ENCODINGS, LMConfig, TransformerLM

__all__ = ["PRESETS", "RunConfig", "experiments", "train_steps", "evaluate", "run", "main"]

PRESETS: dict[str, dict] = {
    # about 3 minutes for the nine encodings on 2 CPU cores (docs/extrapolate.md)
    "default": dict(dim=64, layers=2, heads=4, train_len=64, batch=32, steps=1000, lr=3e-3, eval_tokens=16384, max_bytes=2_000_000),
    # longer and larger, for better numbers: about 15 minutes on 2 cores
    "full": dict(dim=96, layers=2, heads=4, train_len=128, batch=32, steps=1200, lr=2e-3, eval_tokens=65536, max_bytes=None),
    # seconds: for tests and a first look
    "smoke": dict(dim=32, layers=1, heads=2, train_len=16, batch=8, steps=12, lr=3e-3, eval_tokens=512, max_bytes=200_000),
}


@dataclass
class RunConfig:
    encodings: tuple[str, ...] = ENCODINGS
    dim: int = 64
    layers: int = 2
    heads: int = 4
    train_len: int = 64
    batch: int = 32
    steps: int = 1000
    lr: float = 3e-3
    eval_tokens: int = 16384
    max_bytes: int | None = 2_000_000
    multipliers: tuple[int, ...] = (1, 2, 4, 8, 16)
    buckets: tuple[int, ...] = ()  # ablation: T5 with these bucket counts
    bucketing: tuple[str, ...] = ()  # ablation: T5 with these bucketing strategies
    seed: int = 0
    corpus: str | None = None
    out: str = "relpos-extrapolate"
    checkpoint_every: int = 100
    resume: bool = False
    plot: bool = True
    progress: bool = True
    preset: str = "default"
    extra: dict = field(default_factory=dict)


def experiments(config: RunConfig) -> list[tuple[str, LMConfig]]:
    """(name, model config) of every model the run trains."""
    base = LMConfig(
        dim=config.dim, layers=config.layers, heads=config.heads, train_len=config.train_len,
        clip_distance=max(1, config.train_len // 2),
    )

    def t5(num_buckets: int = 32, strategy: str = "log") -> LMConfig:
        # the far bucket starts at the training length, so that it is trained; it must lie above
        # the causal exact range (num_buckets // 2)
        max_distance = max(config.train_len, num_buckets // 2 + 1)
        return base.with_(encoding="t5", num_buckets=num_buckets, strategy=strategy, max_distance=max_distance)

    runs = [(f"t5 {n} buckets", t5(num_buckets=n)) for n in config.buckets]
    runs += [(f"t5 {s}", t5(strategy=s)) for s in config.bucketing]
    if not runs:
        runs = [(e, t5() if e == "t5" else base.with_(encoding=e)) for e in config.encodings]
    return runs


# --- distributed ------------------------------------------------------------------------------


def _dist_context() -> tuple[int, int]:
    """(rank, world size); initialises the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --- training and evaluation ----------------------------------------------------------------


def _lr_at(step: int, config: RunConfig) -> float:
    warmup = max(1, config.steps // 20)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: Corpus,
    config: RunConfig,
    start: int,
    stop: int,
    *,
    rank: int = 0,
    world: int = 1,
    on_step=None,
) -> list[float]:
    """Steps ``start .. stop - 1``. The batch of step ``s`` depends only on (seed, s): every
    encoding sees the same data in the same order, and each rank takes its slice of it."""
    losses = []
    model.train()
    device = next(model.parameters()).device
    for step in range(start, stop):
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        x, y = sample_batch(corpus.train, config.batch, config.train_len, generator)  # (B, L) each
        x, y = x[rank::world].to(device), y[rank::world].to(device)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        logits = model(x)  # (B / world, L, 256)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())  # one host sync per step
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


@torch.no_grad()
def evaluate(model: TransformerLM, corpus: Corpus, config: RunConfig) -> dict[str, dict | None]:
    """Bits per byte and perplexity at each evaluation length; ``None`` where not applicable."""
    model.eval()
    device = next(model.parameters()).device
    results: dict[str, dict | None] = {}
    for mult in config.multipliers:
        length = config.train_len * mult
        limit = model.max_length()
        if limit is not None and length > limit:
            results[str(length)] = None  # positions past the learned table do not exist
            continue
        x, y = eval_windows(corpus.val, length, max(1, config.eval_tokens // length))  # (N, L) each
        total, count = 0.0, 0
        for chunk in range(0, x.shape[0], 8):
            logits = model(x[chunk : chunk + 8].to(device))
            total += F.cross_entropy(logits.flatten(0, 1), y[chunk : chunk + 8].to(device).flatten(), reduction="sum").item()
            count += y[chunk : chunk + 8].numel()
        nats = total / count
        results[str(length)] = {"bits_per_byte": nats / math.log(2), "perplexity": math.exp(nats), "tokens": count}
    return results


def _checkpoint_path(config: RunConfig, name: str) -> pathlib.Path:
    return pathlib.Path(config.out) / "checkpoints" / (name.replace(" ", "_") + ".pt")


def _train_and_eval(name: str, lm_config: LMConfig, corpus: Corpus, config: RunConfig, rank: int, world: int, progress) -> dict:
    torch.manual_seed(config.seed)  # same initial weights for what the models share
    model = TransformerLM(lm_config)
    params = sum(p.numel() for p in model.parameters())
    position_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("absolute", "position")) or ".position." in n)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.01)
    ckpt = _checkpoint_path(config, name)
    fingerprint = _fingerprint(lm_config, config)
    start = 0
    if config.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        _check_same("checkpoint " + str(ckpt), state.get("fingerprint", {}), fingerprint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        progress.step(f"{name}: resumed at step {start}", start)
    def on_step(step: int, loss: float) -> None:
        progress.step(f"train {name} loss {loss:.3f}")
        last = step + 1 == config.steps
        if rank == 0 and ((step + 1) % config.checkpoint_every == 0 or last):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1, "fingerprint": fingerprint}
            save_torch(state, ckpt)  # atomic: a kill mid-write leaves the previous checkpoint

    start_time = time.perf_counter()
    losses = train_steps(ddp, optimizer, corpus, config, start, config.steps, rank=rank, world=world, on_step=on_step)
    train_seconds = time.perf_counter() - start_time
    evals = evaluate(model, corpus, config) if rank == 0 else {}
    progress.step(f"evaluated {name}", len(config.multipliers))
    tail = losses[-20:]
    return {
        "encoding": lm_config.encoding,
        "model": asdict(lm_config),
        "parameters": params,
        "position_parameters": position_params,
        "train_loss": sum(tail) / len(tail) if tail else None,
        "train_seconds": train_seconds,
        "eval": evals,
    }


_RESUME_KEYS = ("dim", "layers", "heads", "train_len", "batch", "steps", "lr", "seed", "corpus", "max_bytes",
                "eval_tokens", "multipliers")


def _fingerprint(lm_config: LMConfig, config: RunConfig) -> dict:
    """What a checkpoint or a result depends on: resuming with any of it changed is refused."""
    fields = asdict(config)
    return {"model": asdict(lm_config), **{k: fields[k] for k in _RESUME_KEYS if k in fields}}


def _check_same(what: str, saved: dict, requested: dict) -> None:
    differ = sorted(k for k in set(saved) | set(requested) if _norm(saved.get(k)) != _norm(requested.get(k)))
    if differ:
        detail = ", ".join(f"{k}: saved {saved.get(k)!r}, requested {requested.get(k)!r}" for k in differ)
        raise ValueError(
            f"--resume: {what} was made with other options ({detail}); rerun with the same options, "
            "or use another --out to start afresh"
        )


def _norm(value):
    return list(value) if isinstance(value, tuple) else value


def _environment() -> dict:
    return {
        "relpos": relpos.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def run(config: RunConfig) -> dict:
    """Train and evaluate every model; write results.json, results.md and (optionally) the plot."""
    rank, world = _dist_context()
    if config.batch % world:
        raise ValueError(f"batch={config.batch} must be divisible by the number of processes ({world})")
    if rank == 0:
        _check_writable(config.out)  # before any training, not after it
    corpus = load_corpus(config.corpus, max_bytes=config.max_bytes) if config.corpus else stdlib_corpus(max_bytes=config.max_bytes)
    out = pathlib.Path(config.out)
    results_path = out / "results.json"
    previous = {}
    if config.resume and results_path.exists():
        saved = json.loads(results_path.read_text())
        requested = asdict(config)
        _check_same(str(results_path), {k: saved["config"].get(k) for k in _RESUME_KEYS},
                    {k: requested.get(k) for k in _RESUME_KEYS})
        previous = saved["results"]
    longest = config.train_len * max(config.multipliers)
    if corpus.val.numel() < longest + 1:
        raise ValueError(
            f"the validation text ({corpus.val.numel()} bytes) is shorter than one evaluation window at the longest "
            f"length ({longest} + 1 bytes): use a larger corpus or smaller --multipliers / --train-len"
        )
    plan = experiments(config)
    report = {"environment": _environment(), "config": asdict(config), "corpus": corpus.describe(), "world_size": world, "results": {}}
    progress = Progress(len(plan) * (config.steps + len(config.multipliers)), enabled=config.progress and rank == 0)
    for name, lm_config in plan:
        if name in previous and previous[name].get("eval"):
            report["results"][name] = previous[name]  # finished in an earlier run
            progress.step(f"{name}: done earlier", config.steps + len(config.multipliers))
            continue
        report["results"][name] = _train_and_eval(name, lm_config, corpus, config, rank, world, progress)
        if rank == 0:
            write_text(results_path, json.dumps(json_safe(report), indent=1))  # after every model: a kill loses one
    progress.close()
    if rank == 0:
        write_text(out / "results.md", markdown_table(report) + "\n")
        if config.plot:
            plot(report, out / "extrapolate.png")
    if dist.is_initialized():
        dist.barrier()
    return report


# --- reporting --------------------------------------------------------------------------------


def markdown_table(report: dict) -> str:
    config = report["config"]
    lengths = [config["train_len"] * m for m in config["multipliers"]]
    head = "| model | params (position) | train loss | " + " | ".join(
        f"bpb @ {n}" + (" (train)" if n == config["train_len"] else "") for n in lengths
    ) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(lengths)]
    for name, r in report["results"].items():
        cells = []
        for n in lengths:
            e = r["eval"].get(str(n))
            cells.append("n/a (no position past its table)" if e is None else _num(e["bits_per_byte"]))
        lines.append(f"| {name} | {r['parameters']:,} ({r['position_parameters']:,}) | {_num(r['train_loss'])} | " + " | ".join(cells) + " |")
    if config["buckets"] or config["bucketing"]:
        lines += ["", ablation_table(report)]
    env = report["environment"]
    lines += [
        "",
        f"bits per byte on held-out {report['corpus']}; trained at length {config['train_len']} for {config['steps']} steps "
        f"of {config['batch']} windows; relpos {env['relpos']}, torch {env['torch']}, {env['machine']}, {env['threads']} threads.",
    ]
    return "\n".join(lines)


def _num(x) -> str:
    """A result for the tables: 3 decimals, or what it was when not finite ("nan", "inf")."""
    if isinstance(x, str) or x is None or not math.isfinite(x):
        return str(x)
    return f"{x:.3f}"


def ablation_table(report: dict) -> str:
    """Seed 000's ablation layout: per-byte perplexities at the training length and at 2x."""
    config = report["config"]
    n1, n2 = str(config["train_len"]), str(2 * config["train_len"])
    first = "Buckets" if config["buckets"] else "Strategy"
    lines = [f"| {first} | Params (bias) | Train PPL | Test PPL | Length Gen (2x) |", "|---|---|---|---|---|"]
    for name, r in report["results"].items():
        key = str(r["model"]["num_buckets"]) if config["buckets"] else r["model"]["strategy"]
        gen = r["eval"].get(n2)
        gen_text = "n/a" if gen is None else f"{gen['perplexity']:.3f}"
        lines.append(
            f"| {key} | {r['position_parameters']} | {math.exp(r['train_loss']):.3f} | "
            f"{r['eval'][n1]['perplexity']:.3f} | {gen_text} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> pathlib.Path | None:
    from .plots import pyplot

    plt = pyplot(required=False)
    if plt is None:
        print("matplotlib is not installed: no plot (pip install 'relpos[plot]')")
        return None
    config = report["config"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in report["results"].items():
        points = [(int(n), e["bits_per_byte"]) for n, e in r["eval"].items() if e is not None]
        xs, ys = zip(*sorted(points))
        if len(points) == 1:  # e.g. learned absolute: one point, drawn so it is not hidden behind a line
            ax.plot(xs, ys, marker="X", markersize=11, linestyle="none", zorder=5, label=f"{name} (n/a past its table)")
        else:
            ax.plot(xs, ys, marker="o", label=name)
    ax.axvline(config["train_len"], color="gray", linestyle="--", label=f"train length {config['train_len']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (bytes)")
    ax.set_ylabel("bits per byte (held-out, lower is better)")
    ax.set_title(f"Train short ({config['train_len']}), test long: {report['corpus'].split(':')[0]}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_with(lambda tmp: fig.savefig(tmp, dpi=120), path)
    plt.close(fig)
    return path


def _csv(kind, text: str):
    return tuple(kind(x) for x in text.split(",") if x)


def add_arguments(parser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default", help="size of the run (default: about 3 minutes on 2 cores, docs/extrapolate.md; full: longer)")
    parser.add_argument("--encodings", default=",".join(ENCODINGS), help=f"comma-separated, from: {', '.join(ENCODINGS)}")
    for name, kind in (("dim", int), ("layers", int), ("heads", int), ("train-len", int), ("batch", int), ("steps", int), ("lr", float), ("eval-tokens", int)):
        parser.add_argument(f"--{name}", type=kind, help="overrides the preset")
    parser.add_argument("--multipliers", default="1,2,4,8,16", help="evaluation lengths as multiples of --train-len")
    parser.add_argument("--buckets", default="", help="ablation: T5 bias with these bucket counts, e.g. 8,16,32,64,128")
    parser.add_argument("--bucketing", default="", help=f"ablation: T5 bias with these strategies, from {', '.join(STRATEGIES)}")
    parser.add_argument("--corpus", help="a text file or a folder of text files (default: the Python standard library)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order (default 0)")
    parser.add_argument("--out", default="relpos-extrapolate", help="folder for results.json, results.md, the plot and checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (for --resume)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints and results in --out")
    parser.add_argument("--no-plot", action="store_true", help="skip extrapolate.png (no matplotlib needed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")


def config_from_args(args) -> RunConfig:
    preset = dict(PRESETS[args.preset])
    for key in ("dim", "layers", "heads", "train_len", "batch", "steps", "lr", "eval_tokens"):
        value = getattr(args, key)
        if value is not None:
            preset[key] = value
    encodings = _csv(str, args.encodings)
    unknown = [e for e in encodings if e not in ENCODINGS]
    if unknown:
        raise ValueError(f"--encodings: unknown {unknown}; choose from {', '.join(ENCODINGS)}")
    bucketing = _csv(str, args.bucketing)
    if any(s not in STRATEGIES for s in bucketing):
        raise ValueError(f"--bucketing must be among {', '.join(STRATEGIES)}, got {args.bucketing!r}")
    for key in ("dim", "layers", "heads", "train_len", "batch", "steps", "eval_tokens"):
        if preset[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {preset[key]}")
    if not encodings and not args.buckets and not args.bucketing:
        raise ValueError("--encodings is empty: name at least one of " + ", ".join(ENCODINGS))
    if not (math.isfinite(preset["lr"]) and preset["lr"] > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {preset['lr']}")
    if args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be positive, got {args.checkpoint_every}")
    multipliers = _csv(int, args.multipliers)
    if not multipliers or min(multipliers) < 1:
        raise ValueError(f"--multipliers must be positive integers, got {args.multipliers!r}")
    return RunConfig(
        encodings=encodings, multipliers=_csv(int, args.multipliers), buckets=_csv(int, args.buckets),
        bucketing=bucketing, seed=args.seed, corpus=args.corpus, out=args.out,
        checkpoint_every=args.checkpoint_every, resume=args.resume, plot=not args.no_plot,
        progress=not args.no_progress, preset=args.preset, **preset,
    )


def _check_writable(out: str) -> None:
    path = pathlib.Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out!r} is not a writable folder ({exc.strerror})") from None


def run_from_args(args) -> int:
    try:
        report = run(config_from_args(args))
    except KeyboardInterrupt:
        print(f"\ninterrupted: the checkpoints in {args.out} are complete; continue with the same options and --resume",
              file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        print(markdown_table(report))
        print(f"\nresults: {pathlib.Path(args.out) / 'results.json'}" + ("" if args.no_plot else f", plot: {pathlib.Path(args.out) / 'extrapolate.png'}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="relpos extrapolate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":  # torchrun -m relpos.extrapolate ...  or  python -m relpos.extrapolate
    raise SystemExit(main())
