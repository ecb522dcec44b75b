"""Train every model on one problem, once per seed; evaluate at every length; write the results.

Each model gets the same transformer (:class:`~relpos.experiment.model.TransformerLM`), seed,
data order, size and number of steps; only the position encoding differs. The batch of step
``s`` under seed ``k`` depends only on ``(k, s)``. After each (model, seed) the results file is
rewritten atomically, and checkpoints are written every ``checkpoint_every`` steps, so a killed
run continues with ``resume=True``.

Runs under ``torchrun --nproc_per_node N`` unchanged (DistributedDataParallel; gloo on CPU,
nccl on GPU): each rank trains on its slice of the same global batch.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import relpos

from .._io import json_safe, save_torch, write_text
from .._progress import Progress
from .data import load_corpus, stdlib_corpus
from .model import LMConfig, TransformerLM
from .problems import TaskProblem, TextProblem
from .report import markdown_report, plot, summarize_runs
from .variants import MODELS, ROPE_SCALING_ROWS, models, rope_scaling

__all__ = ["PRESETS", "TASK_PRESETS", "RunConfig", "make_problem", "train_steps", "run"]

PRESETS: dict[str, dict] = {
    # the default run: three seeds of ten models, about 8 minutes on 2 CPU cores (docs/extrapolate.md)
    "default": dict(dim=64, layers=2, heads=4, train_len=64, batch=32, steps=500, lr=3e-3, eval_tokens=16384,
                    max_bytes=2_000_000, seeds=(0, 1, 2)),
    # longer and larger, for better numbers: several times the default run's time
    "full": dict(dim=96, layers=2, heads=4, train_len=128, batch=32, steps=1200, lr=2e-3, eval_tokens=65536,
                 max_bytes=None, seeds=(0, 1, 2)),
    # seconds: for tests and a first look
    "smoke": dict(dim=32, layers=1, heads=2, train_len=16, batch=8, steps=12, lr=3e-3, eval_tokens=512,
                  max_bytes=200_000, seeds=(0,)),
}

TASK_PRESETS: dict[str, dict] = {
    # the tasks' default run: three tasks, ten models, three seeds, about 13 minutes on 2 CPU cores
    "default": dict(dim=64, layers=2, heads=4, batch=32, steps=800, lr=3e-3, train_max=8,
                    test_lengths=(4, 8, 10, 12, 16, 24, 32), eval_instances=128, seeds=(0, 1, 2)),
    "full": dict(dim=64, layers=5, heads=4, batch=64, steps=3000, lr=1e-3, train_max=20,
                 test_lengths=(10, 20, 30, 40, 60, 80, 100), eval_instances=512, seeds=(0, 1, 2, 3, 4)),
    "smoke": dict(dim=32, layers=1, heads=2, batch=8, steps=12, lr=3e-3, train_max=4,
                  test_lengths=(2, 4, 8), eval_instances=16, seeds=(0,)),
}


@dataclass
class RunConfig:
    """Everything a run depends on. ``task="text"`` is the language-modelling run; any name in
    :data:`relpos.experiment.tasks.TASKS` is an algorithmic one (``train_max``, ``test_lengths``)."""

    task: str = "text"
    encodings: tuple[str, ...] = MODELS
    rope_scalings: tuple[str, ...] = ROPE_SCALING_ROWS
    seeds: tuple[int, ...] = (0, 1, 2)
    dim: int = 64
    layers: int = 2
    heads: int = 4
    batch: int = 32
    steps: int = 500
    lr: float = 3e-3
    # text
    train_len: int = 64
    eval_tokens: int = 16384
    max_bytes: int | None = 2_000_000
    multipliers: tuple[int, ...] = (1, 2, 4, 8, 16)
    corpus: str | None = None
    buckets: tuple[int, ...] = ()  # ablation: T5 with these bucket counts
    bucketing: tuple[str, ...] = ()  # ablation: T5 with these bucketing strategies
    # algorithmic tasks
    train_max: int = 8
    test_lengths: tuple[int, ...] = (4, 8, 10, 12, 16, 24, 32)
    eval_instances: int = 128
    # files and display
    out: str = "relpos-extrapolate"
    checkpoint_every: int = 100
    resume: bool = False
    plot: bool = True
    progress: bool = True
    preset: str = "default"


# what a result depends on: resuming with any of it changed is refused
_RESUME_KEYS = ("task", "dim", "layers", "heads", "batch", "steps", "lr", "train_len", "corpus", "max_bytes",
                "eval_tokens", "multipliers", "train_max", "test_lengths", "eval_instances", "rope_scalings")


def make_problem(config: RunConfig) -> TextProblem | TaskProblem:
    if config.task != "text":
        return TaskProblem(config.task, train_max=config.train_max, test_lengths=config.test_lengths,
                           eval_instances=config.eval_instances)
    corpus = load_corpus(config.corpus, max_bytes=config.max_bytes) if config.corpus else stdlib_corpus(max_bytes=config.max_bytes)
    longest = config.train_len * max(config.multipliers)
    if corpus.val.numel() < longest + 1:
        raise ValueError(
            f"the validation text ({corpus.val.numel()} bytes) is shorter than one evaluation window at the longest "
            f"length ({longest} + 1 bytes): use a larger corpus or smaller --multipliers / --train-len"
        )
    return TextProblem(corpus, train_len=config.train_len, multipliers=config.multipliers, eval_tokens=config.eval_tokens)


# --- distributed ------------------------------------------------------------------------------


def _dist_context() -> tuple[int, int]:
    """(rank, world size); initialises the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# --- training -----------------------------------------------------------------------------------


def _lr_at(step: int, config: RunConfig) -> float:
    warmup = max(1, config.steps // 20)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


def train_steps(model, optimizer, problem, config: RunConfig, seed: int, start: int, stop: int, *,
                rank: int = 0, world: int = 1, on_step=None) -> list[float]:
    """Steps ``start .. stop - 1``. The batch of step ``s`` depends only on (seed, s): every model
    sees the same data in the same order, and each rank takes its slice of it."""
    losses = []
    model.train()
    device = next(model.parameters()).device
    for step in range(start, stop):
        x, y = problem.batch(seed * 1_000_003 + step, config.batch)  # (B, L) each
        x, y = x[rank::world].to(device), y[rank::world].to(device)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        logits = model(x)  # (B / world, L, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())  # one host sync per step
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def _checkpoint_path(config: RunConfig, name: str, seed: int) -> pathlib.Path:
    return pathlib.Path(config.out) / "checkpoints" / f"{name.replace(' ', '_')}.seed{seed}.pt"


def _fingerprint(lm_config: LMConfig, config: RunConfig, seed: int) -> dict:
    fields = asdict(config)
    return {"model": asdict(lm_config), "seed": seed, **{k: fields[k] for k in _RESUME_KEYS}}


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


def _train(name: str, lm_config: LMConfig, seed: int, problem, config: RunConfig, rank: int, world: int, progress):
    """Train one model under one seed (continuing from its checkpoint with ``resume``)."""
    torch.manual_seed(seed)  # same initial weights, per seed, for what the models share
    model = TransformerLM(lm_config)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.01)
    ckpt = _checkpoint_path(config, name, seed)
    fingerprint = _fingerprint(lm_config, config, seed)
    start = 0
    if config.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        _check_same("checkpoint " + str(ckpt), state.get("fingerprint", {}), fingerprint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        progress.step(f"{name} seed {seed}: resumed at step {start}", start)

    def on_step(step: int, loss: float) -> None:
        progress.step(f"{name} seed {seed} loss {loss:.3f}")
        if rank == 0 and ((step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1, "fingerprint": fingerprint}
            save_torch(state, ckpt)  # atomic: a kill mid-write leaves the previous checkpoint

    began = time.perf_counter()
    losses = train_steps(ddp, optimizer, problem, config, seed, start, config.steps, rank=rank, world=world, on_step=on_step)
    return model, losses, time.perf_counter() - began


def _result(model: TransformerLM, losses: list[float], seconds: float, evals: dict, **extra) -> dict:
    tail = losses[-20:]
    return {
        "encoding": model.config.encoding,
        "model": asdict(model.config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "position_parameters": sum(p.numel() for n, p in model.named_parameters()
                                   if n.startswith(("absolute", "position")) or ".position." in n),
        "train_loss": sum(tail) / len(tail) if tail else None,
        "train_seconds": seconds,
        "eval": evals,
        **extra,
    }


def _environment() -> dict:
    return {
        "relpos": relpos.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def _check_writable(out: str) -> None:
    path = pathlib.Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out!r} is not a writable folder ({exc.strerror})") from None


def _previous_runs(config: RunConfig, path: pathlib.Path) -> dict:
    if not (config.resume and path.exists()):
        return {}
    saved = json.loads(path.read_text())
    requested = asdict(config)
    _check_same(str(path), {k: saved["config"].get(k) for k in _RESUME_KEYS}, {k: requested.get(k) for k in _RESUME_KEYS})
    return saved["runs"]


def run(config: RunConfig) -> dict:
    """Train and evaluate every model under every seed; write results.json, results.md and the plot.

    ``report["runs"][name][str(seed)]`` holds one seed's result, ``report["summary"][name][length]``
    the mean and spread over seeds. Rows ``rope + <scaling>`` are the trained RoPE model evaluated
    with that scaling (no training of their own).
    """
    began = time.perf_counter()
    rank, world = _dist_context()
    if config.batch % world:
        raise ValueError(f"batch={config.batch} must be divisible by the number of processes ({world})")
    if rank == 0:
        _check_writable(config.out)  # before any training, not after it
    problem = make_problem(config)
    out = pathlib.Path(config.out)
    results_path = out / "results.json"
    previous = _previous_runs(config, results_path)
    plan = models(config.encodings, dim=config.dim, layers=config.layers, heads=config.heads,
                  train_len=problem.train_len, vocab=problem.vocab, buckets=config.buckets, bucketing=config.bucketing)
    scalings = config.rope_scalings if any(c.encoding == "rope" for _, c in plan) else ()
    report = {"environment": _environment(), "config": asdict(config), "problem": problem.describe(),
              "metric": problem.metric, "higher_is_better": problem.higher_is_better, "lengths": problem.lengths,
              "trained_lengths": problem.trained_lengths, "world_size": world, "runs": {}}
    per_model = config.steps + len(problem.lengths) * (1 + len(scalings))
    progress = Progress(len(plan) * len(config.seeds) * per_model, enabled=config.progress and rank == 0)
    for name, lm_config in plan:
        for seed in config.seeds:
            key = str(seed)
            done = previous.get(name, {}).get(key)
            if done is not None and done.get("eval") is not None:
                report["runs"].setdefault(name, {})[key] = done  # finished in an earlier run
                for kind in scalings if lm_config.encoding == "rope" else ():
                    report["runs"].setdefault(f"rope + {kind}", {})[key] = previous[f"rope + {kind}"][key]
                progress.step(f"{name} seed {seed}: done earlier", per_model)
                continue
            model, losses, seconds = _train(name, lm_config, seed, problem, config, rank, world, progress)
            if rank == 0:
                report["runs"].setdefault(name, {})[key] = _result(model, losses, seconds, problem.evaluate(model))
                progress.step(f"evaluated {name} seed {seed}", len(problem.lengths))
                if lm_config.encoding == "rope":
                    for kind in scalings:
                        head_dim = lm_config.dim // lm_config.heads
                        rotary_for = lambda length, kind=kind: rope_scaling(kind, head_dim, length, problem.train_len)  # noqa: E731
                        evals = problem.evaluate(model, rotary_for)
                        report["runs"].setdefault(f"rope + {kind}", {})[key] = _result(
                            model, losses, seconds, evals, derived_from=name, rope_scaling=kind)
                        progress.step(f"evaluated rope + {kind} seed {seed}", len(problem.lengths))
                write_text(results_path, json.dumps(json_safe(report), indent=1))  # after every model: a kill loses one
    progress.close()
    if rank == 0:
        report["summary"] = summarize_runs(report)
        report["wall_seconds"] = time.perf_counter() - began
        write_text(results_path, json.dumps(json_safe(report), indent=1))
        write_text(out / "results.md", markdown_report(report) + "\n")
        if config.plot:
            plot(report, out / "extrapolate.png")
    if dist.is_initialized():
        dist.barrier()
    return report
