"""Train every model on one problem, once per seed; evaluate at every length; write the results.

Each model gets the same transformer (:class:`~relpos.experiment.model.TransformerLM`), seed,
data order, size and number of steps; only the position encoding differs. The batch of step
``s`` under seed ``k`` depends only on ``(k, s)``. After each (model, seed) the results file is
rewritten atomically, and checkpoints are written every ``checkpoint_every`` steps, so a killed
run continues with ``resume=True``.

Runs under ``torchrun --nproc_per_node N`` unchanged: each process trains whole runs of its own
(``parallel="runs"``, the results equal a single process's) or its slice of every run's batch
(``parallel="batch"``, DistributedDataParallel): :mod:`relpos.experiment.parallel`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import pathlib
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import relpos

from .._checks import check_choice
from .._io import json_safe, save_torch, save_with, write_text
from .._progress import Progress
from .data import load_corpus, stdlib_corpus
from .diagnostics import attention_by_distance, fire_normalizer_ablation
from .model import LMConfig, TransformerLM
from .problems import ScanProblem, TaskProblem, TextProblem
from ..encodings.buckets import relative_position_bucket
from .report import compare_all, markdown_report, plot, summarize_runs
from .parallel import PARALLEL, Share
from .variants import ALL_MODELS, MODELS, ROPE_SCALING_ROWS, models, rope_scaling

__all__ = ["PRESETS", "TASK_PRESETS", "PARTIAL", "RunConfig", "make_problem", "train_steps", "plateau", "estimate", "t5_buckets", "run"]

PRESETS: dict[str, dict] = {
    # the default run: three seeds of ten models, about 8 minutes on 2 CPU cores (docs/experiments/running.md)
    "default": dict(dim=64, layers=2, heads=4, train_len=64, batch=32, steps=500, lr=3e-3, eval_tokens=16384,
                    max_bytes=2_000_000, seeds=(0, 1, 2)),
    # longer and larger, for better numbers: several times the default run's time
    "full": dict(dim=96, layers=2, heads=4, train_len=128, batch=32, steps=1200, lr=2e-3, eval_tokens=65536,
                 max_bytes=None, seeds=(0, 1, 2)),
    # the committed evidence (docs/experiments/: text.md, tasks.md): every model, a learning-rate sweep per encoding
    # (1000 steps of each constant rate), every model trained 3000 steps at its constant rate and
    # 600 of cool-down, the plateau rule checked at the end of the constant rate (a rule that may
    # stop earlier stopped runs on temporary plateaus: docs/experiments/method.md), learning curves, 1 MB
    # of held-out text from many files at every length, a second corpus (C headers), bootstrap
    # intervals (--estimate-only prints the estimate; docs/experiments/running.md gives the measured time)
    "reference": dict(dim=64, layers=2, heads=4, train_len=64, batch=32, steps=1000, max_steps=3000, plateau_from=3000, lr=1e-2,
                      lrs=(3e-3, 1e-2, 3e-2), eval_every=100, val_windows=512, eval_tokens=1_048_576, max_bytes=None,
                      seeds=(0, 1, 2), encodings=ALL_MODELS,
                      second_corpus="/usr/include", second_eval_tokens=131_072,
                      rope_scalings=("linear", "dynamic", "yarn", "linear-oracle", "yarn-oracle")),
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
    # the committed evidence: every encoding (18 models), five seeds, a learning-rate sweep, Kazemnejad et
    # al.'s parity and summation, SCAN's length split
    "reference": dict(dim=64, layers=2, heads=4, batch=32, steps=1000, lr=3e-3, lrs=(1e-3, 3e-3), eval_every=100,
                      train_max=8, test_lengths=(4, 8, 10, 12, 16, 24, 32), eval_instances=256, seeds=(0, 1, 2, 3, 4),
                      encodings=ALL_MODELS, rope_scalings=("linear", "dynamic", "linear-oracle")),
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
    lrs: tuple[float, ...] = ()  # a learning-rate sweep (chosen per model on validation); empty: ``lr`` alone
    lr_from: str | None = None  # a results.json whose ``chosen_lr`` gives each model's rate (no sweep)
    eval_every: int = 0  # steps between validation points of the learning curve (0: only at the end)
    # > 0: train to a plateau (the constant rate until the plateau rule holds, at least ``steps`` and
    # at most ``max_steps``, then a cool-down of COOLDOWN x the steps done); 0: exactly ``steps``
    max_steps: int = 0
    plateau_from: int = 0  # the first step at which the plateau rule may end the constant rate (0: ``steps``)
    rope_factor: float | None = None  # the fixed RoPE scaling factor (None: the longest length / train length)
    # text
    train_len: int = 64
    eval_tokens: int = 16384
    val_windows: int = 64  # in-distribution validation windows (the learning curves, the rate and the plateau)
    max_bytes: int | None = 2_000_000
    multipliers: tuple[int, ...] = (1, 2, 4, 8, 16)
    corpus: str | None = None
    second_corpus: str | None = None  # a second held-out text (another language), evaluated the same way
    second_eval_tokens: int = 0
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
    # how torchrun's processes share the work (relpos.experiment.parallel): whole runs each, or each run's batch
    parallel: str = "runs"

    def __post_init__(self) -> None:
        check_choice("parallel", self.parallel, PARALLEL)
        if self.lr_from is not None and self.lrs:
            raise ValueError(f"lr_from={self.lr_from!r} and lrs={self.lrs!r} both set each model's learning rate: give one")


#: held-out windows at the longest length for FIRE's normalization ablation (64 x 1,024 bytes in the
#: reference run: a few seconds per FIRE model; the ablation's differences are > 0.5 bits per byte)
FIRE_PROBE_WINDOWS = 64

# what a result depends on: resuming with any of it changed is refused
_RESUME_KEYS = ("task", "dim", "layers", "heads", "batch", "steps", "max_steps", "plateau_from", "lr", "lrs", "eval_every", "rope_factor",
                "train_len", "val_windows",
                "corpus", "second_corpus", "second_eval_tokens", "max_bytes", "eval_tokens", "multipliers", "train_max",
                "test_lengths", "eval_instances", "rope_scalings", "parallel", "lr_from")
#: the value an option had before it existed, for a saved run or checkpoint without it
_LEGACY = {"parallel": "batch"}


def make_problem(config: RunConfig) -> TextProblem | TaskProblem | ScanProblem:
    if config.task == "scan":
        return ScanProblem(eval_instances=config.eval_instances)
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
    second = None
    if config.second_corpus:
        second = load_corpus(config.second_corpus, max_bytes=config.max_bytes)
    return TextProblem(corpus, train_len=config.train_len, multipliers=config.multipliers, eval_tokens=config.eval_tokens,
                       second=second, second_tokens=config.second_eval_tokens or config.eval_tokens,
                       val_windows=config.val_windows)


# --- training -----------------------------------------------------------------------------------


#: the cool-down after a plateau, as a fraction of the steps trained until then (Hägele et al. 2024
#: find 10-20% enough for a constant-rate run to match a cosine schedule of the same length)
COOLDOWN = 0.2


def cooldown_steps(stable_end: int) -> int:
    """Steps of the linear cool-down that follows a plateau reached at ``stable_end``."""
    return max(1, math.ceil(COOLDOWN * stable_end))


def _lr_at(step: int, config: RunConfig, lr: float | None = None, stable_end: int | None = None) -> float:
    """The learning rate at ``step``. A fixed budget (``max_steps == 0``): warm-up, then cosine to 10%
    at ``steps``. Training to a plateau: warm-up, the constant rate until ``stable_end`` (unknown,
    ``None``, while the plateau is looked for), then linear to 0 over :func:`cooldown_steps`."""
    lr = config.lr if lr is None else lr
    warmup = max(1, config.steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    if config.max_steps:
        if stable_end is None or step < stable_end:
            return lr
        return lr * max(0.0, 1 - (step - stable_end) / cooldown_steps(stable_end))
    progress = (step - warmup) / max(1, config.steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine to 10%


def train_steps(model, optimizer, problem, config: RunConfig, seed: int, start: int, stop: int, *,
                rank: int = 0, world: int = 1, on_step=None, lr: float | None = None,
                stable_end: int | None = None) -> list[float]:
    """Steps ``start .. stop - 1``. The batch of step ``s`` depends only on (seed, s): every model
    sees the same data in the same order, and each rank takes its slice of it."""
    losses = []
    model.train()
    device = next(model.parameters()).device
    for step in range(start, stop):
        x, y = problem.batch(seed * 1_000_003 + step, config.batch)  # (B, L) each
        x, y = x[rank::world].to(device), y[rank::world].to(device)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config, lr, stable_end)
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


#: the stated plateau rule: the validation loss fell by less than this fraction over the last fifth of training
PLATEAU_GAIN = 0.01
_RULE = (f"the mean validation loss of the last 20% of the steps is within {PLATEAU_GAIN:.0%} of the mean "
         "of the 20% before")


def plateau(curve: list[tuple[int, float]], steps: int) -> dict:
    """Whether a learning curve ``[(step, validation loss), ...]`` has plateaued at ``steps``: the
    mean of its points in the last fifth of the steps, ``(0.8 steps, steps]``, is within
    ``PLATEAU_GAIN`` (relative) of the mean of its points in the fifth before, ``(0.6 steps, 0.8 steps]``.
    Means of several points, not two single points: at a constant rate the loss moves from point to
    point by about as much as the 1% the rule allows (a single-point rule stopped runs early on such
    a wobble). A fifth with no point falls back to the last point before it.

    >>> plateau([(0, 5.0), (60, 2.1), (70, 2.04), (80, 2.0), (90, 2.03), (100, 2.0)], 100)["reached"]
    True
    >>> plateau([(0, 5.0), (70, 2.2), (80, 2.0), (90, 2.2), (100, 2.0)], 100)["reached"]  # a wobble, no trend
    True
    >>> plateau([(0, 5.0), (70, 2.2), (80, 2.1), (90, 2.0), (100, 1.9)], 100)["reached"]
    False
    """
    if len(curve) < 2:
        return {"rule": _RULE, "reached": None, "gain": None}
    late = [v for step, v in curve if 0.8 * steps < step <= steps] or [curve[-1][1]]
    early = ([v for step, v in curve if 0.6 * steps < step <= 0.8 * steps]
             or [v for step, v in curve if step <= 0.8 * steps][-1:] or [curve[0][1]])
    before, after = sum(early) / len(early), sum(late) / len(late)
    gain = (before - after) / abs(before) if before else 0.0
    return {"rule": _RULE, "reached": gain < PLATEAU_GAIN, "gain": gain}


def _checkpoint_path(config: RunConfig, name: str, seed: int, lr: float) -> pathlib.Path:
    return pathlib.Path(config.out) / "checkpoints" / f"{name.replace(' ', '_')}.lr{lr:g}.seed{seed}.pt"


def _fingerprint(lm_config: LMConfig, config: RunConfig, seed: int, lr: float) -> dict:
    fields = asdict(config)
    return {"model": asdict(lm_config), "seed": seed, **{k: fields[k] for k in _RESUME_KEYS}, "run_lr": lr}


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


def _train(name: str, lm_config: LMConfig, seed: int, lr: float, problem, config: RunConfig, rank: int, world: int,
           progress, *, reuse: bool = False, sweep: bool = False):
    """Train one model under one seed and learning rate (continuing from its checkpoint with
    ``resume``, or ``reuse``: a checkpoint this run wrote, the sweep's run of the chosen rate).

    A fixed budget trains ``steps``. With ``max_steps`` the run trains to a plateau: the constant
    rate until the plateau rule holds at a learning-curve point (from ``plateau_from``, at least
    ``steps``) or ``max_steps`` is reached, then the cool-down (``plateau_from == max_steps``: a fixed
    budget at the constant rate, the rule only checked); a ``sweep`` run stops after ``steps`` of the
    constant rate, which are the first steps of the full run (so the chosen rate's run goes on from it).
    Returns the model, the training losses, the learning curve ``[(step, validation loss)]``, the
    seconds and the step where the constant rate ended (``None``: a fixed budget or a sweep run)."""
    torch.manual_seed(seed)  # same initial weights, per seed, for what the models share
    model = TransformerLM(lm_config)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    ckpt = _checkpoint_path(config, name, seed, lr)
    fingerprint = _fingerprint(lm_config, config, seed, lr)
    start, losses, curve, seconds, stable_end = 0, [], [], 0.0, None
    if (config.resume or reuse) and ckpt.exists():
        start, losses, curve, seconds, stable_end = _restore(ckpt, fingerprint, model, optimizer)
        progress.step(f"{name} seed {seed}: resumed at step {start}", start)
    began = time.perf_counter() - seconds
    final = stable_end + cooldown_steps(stable_end) if stable_end is not None else (
        config.steps if sweep or not config.max_steps else None)

    def save(done: int) -> None:
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                     "fingerprint": fingerprint, "losses": losses, "curve": [list(c) for c in curve],
                     "seconds": time.perf_counter() - began, "stable_end": stable_end}
            save_torch(state, ckpt)  # atomic: a kill mid-write leaves the previous checkpoint

    def on_step(step: int, loss: float) -> None:
        losses.append(loss)
        progress.step(f"{name} lr {lr:g} seed {seed} loss {loss:.3f}")
        done = step + 1
        if (config.eval_every and done % config.eval_every == 0) or done == final:
            curve.append((done, problem.validate(model)))
        if done % config.checkpoint_every == 0 or done == final:
            save(done)

    if start == 0 and config.eval_every:
        curve.append((0, problem.validate(model)))
    step = start
    while final is None:  # the constant rate, one learning-curve point at a time, until the plateau
        if step >= config.max_steps or (step >= max(config.steps, config.plateau_from) and curve and curve[-1][0] == step
                                        and plateau(curve, step)["reached"]):
            stable_end, final = step, step + cooldown_steps(step)
            save(step)
            break
        stop = min(config.max_steps, (step // config.eval_every + 1) * config.eval_every)
        train_steps(ddp, optimizer, problem, config, seed, step, stop, rank=rank, world=world, on_step=on_step, lr=lr)
        step = stop
    train_steps(ddp, optimizer, problem, config, seed, step, final, rank=rank, world=world, on_step=on_step, lr=lr,
                stable_end=stable_end)
    return model, losses, curve, time.perf_counter() - began, stable_end


def _restore(ckpt: pathlib.Path, fingerprint: dict, model: TransformerLM, optimizer) -> tuple:
    """Load a run's checkpoint into ``model`` and ``optimizer`` (refusing one made with other options):
    the step reached, the losses, the learning curve, the seconds spent and where the constant rate ended."""
    state = torch.load(ckpt, weights_only=True)
    _check_same("checkpoint " + str(ckpt), {**_LEGACY, **state.get("fingerprint", {})}, fingerprint)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    curve = [tuple(c) for c in state.get("curve", [])]
    return int(state["step"]), list(state.get("losses", [])), curve, float(state.get("seconds", 0.0)), state.get("stable_end")


def _schedule(curve: list, config: RunConfig, stable_end: int | None, steps: int) -> dict:
    """The plateau check of a finished run, and where its constant rate ended (training to a plateau):
    the rule is checked on the curve of the constant rate; ``capped`` when ``max_steps`` ended it."""
    if stable_end is None:
        return {"plateau": plateau(curve, config.steps), "steps": steps}
    constant = [c for c in curve if c[0] <= stable_end]
    check = plateau(constant, stable_end)
    return {"plateau": check, "steps": steps, "stable_end": stable_end,
            "capped": stable_end >= config.max_steps and not check["reached"],
            "cooldown_gain": (constant[-1][1] - curve[-1][1]) / abs(constant[-1][1]) if constant[-1][1] else 0.0}


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


def t5_buckets(model: TransformerLM, train_len: int) -> dict | None:
    """T5's learned bucket values after training (mean over heads) and which buckets the trained
    distances ``0 .. train_len - 1`` reach: a bucket no trained distance reaches keeps its initial value."""
    if model.config.encoding != "t5":
        return None
    bias = model.position
    distances = -torch.arange(train_len)  # key - query of every trained (causal) pair
    reached = relative_position_bucket(distances, bidirectional=False, num_buckets=bias.num_buckets,
                                       max_distance=bias.max_distance, strategy=bias.strategy).unique().tolist()
    table = bias.relative_attention_bias.weight.detach().double()  # (buckets, H)
    untrained = [b for b in range(bias.num_buckets) if b not in reached]
    return {"values": table.mean(1).tolist(), "trained_buckets": reached, "untrained_buckets": untrained,
            "far_bucket": bias.num_buckets - 1, "far_bucket_trained": bias.num_buckets - 1 in reached,
            "far_bucket_mean_abs": float(table[-1].abs().mean()),
            "trained_mean_abs": float(table[reached].abs().mean())}


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


def _saved_reports(config: RunConfig) -> list[pathlib.Path]:
    """results.json of an earlier run in ``--out``, then each process's partial one (runs mode writes
    ``partial/rank<r>/`` for the runs a process finished but has not yet handed to rank 0)."""
    out = pathlib.Path(config.out)
    return [path for path in (out / "results.json", *sorted((out / PARTIAL).glob("rank*/results.json"))) if path.exists()]


def _previous_runs(config: RunConfig) -> tuple[dict, dict]:
    """The finished runs and sweep runs of an earlier run in ``--out`` (with ``resume``), from its
    results.json and its processes' partial results (a run found in several is taken from the first)."""
    runs: dict = {}
    sweep: dict = {}
    if not config.resume:
        return runs, sweep
    requested = asdict(config)
    for path in _saved_reports(config):
        saved = json.loads(path.read_text())
        # an option newer than the saved run had its legacy value there, or else its default
        recorded = {**asdict(RunConfig()), **_LEGACY, **saved["config"]}
        _check_same(str(path), {k: recorded[k] for k in _RESUME_KEYS}, {k: requested.get(k) for k in _RESUME_KEYS})
        _add_missing(runs, saved["runs"])
        _add_missing(sweep, saved.get("sweep", {}))
    return runs, sweep


def _add_missing(into: dict, other: dict) -> None:
    """``{model: {key: entry}}``: ``other``'s entries that ``into`` lacks, added (whole entries, never merged)."""
    for name, entries in other.items():
        for key, entry in entries.items():
            into.setdefault(name, {}).setdefault(key, entry)


def rates_from(path: str, names: list[str]) -> dict[str, float]:
    """Each of ``names``' learning rate as chosen by an earlier run (its results.json's ``chosen_lr``)."""
    try:
        chosen = json.loads(pathlib.Path(path).read_text())["chosen_lr"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"lr_from={path!r} must be a results.json written by a run (with 'chosen_lr'): {exc}") from None
    missing = [n for n in names if n not in chosen]
    if missing:
        raise ValueError(f"lr_from={path!r} has no learning rate for {', '.join(missing)} (it has {', '.join(chosen)}): "
                         "run those models with --lrs or another --lr-from")
    return {n: float(chosen[n]) for n in names}


def _plain_rope(lm_config: LMConfig) -> bool:
    """RoPE at consecutive positions: the model the scaling rows evaluate."""
    return lm_config.encoding == "rope" and not lm_config.randomized_positions


#: the folder inside ``--out`` where each process of a runs-mode run keeps the runs it finished
#: until the stage's end hands them to rank 0 (removed when the run is complete)
PARTIAL = "partial"


def _write_report(report: dict, windows: dict, out: pathlib.Path) -> None:
    """results.json in ``out`` without the per-window losses, which go to windows.json.gz
    (``{model: {seed: {"main" | "second": {length: [bits per byte of each window]}}}}``, the window
    order of ``report["windows"]``): the file-level means in results.json are what the bootstrap reads."""
    for name, seeds in report["runs"].items():
        for seed, run in seeds.items():
            for key, which in (("eval", "main"), ("eval_second", "second")):
                for length, cell in (run.get(key) or {}).items():
                    if cell is not None and "windows" in cell:
                        windows.setdefault(name, {}).setdefault(seed, {}).setdefault(which, {})[length] = cell.pop("windows")
    write_text(out / "results.json", json.dumps(json_safe(report), indent=1))
    if windows:
        save_with(lambda tmp: tmp.write_bytes(gzip.compress(json.dumps(json_safe(windows)).encode(), mtime=0)),
                  out / "windows.json.gz")


def _previous_windows(config: RunConfig) -> dict:
    """The per-window losses saved beside :func:`_saved_reports` (with ``resume``)."""
    windows: dict = {}
    for path in _saved_reports(config) if config.resume else ():
        gz = path.with_name("windows.json.gz")
        if gz.exists():
            _add_missing(windows, json.loads(gzip.decompress(gz.read_bytes())))
    return windows


def _fixed_rope_factor(config: RunConfig, problem) -> float:
    """The fixed RoPE factor, set once from the configuration before any evaluation."""
    if config.rope_factor is not None:
        return float(config.rope_factor)
    tokens = getattr(problem, "input_length", lambda n: n)
    return max(1.0, max(tokens(n) for n in problem.lengths) / problem.train_len)


#: training steps timed per model for the estimate (their median is used)
ESTIMATE_STEPS = 5


def estimate(config: RunConfig, problem, plan: list[tuple[str, LMConfig]], lrs: tuple[float, ...]) -> dict:
    """Seconds the run should take on this machine, from measured per-step and per-window times:
    (sweep runs + seeds beyond the first) x steps x step time + every evaluation."""
    total, per_model = 0.0, {}
    seeds = len(config.seeds)
    for name, lm_config in plan:
        torch.manual_seed(0)
        model = TransformerLM(lm_config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        times = []
        for step in range(ESTIMATE_STEPS + 1):  # the first step warms up
            began = time.perf_counter()
            train_steps(model, optimizer, problem, config, 0, step, step + 1)
            times.append(time.perf_counter() - began)
        step_time = sorted(times[1:])[len(times[1:]) // 2]  # the median: one slow phase of a shared machine does not set it
        sweeps = len(lrs) - 1 if len(lrs) > 1 else 0  # the chosen rate's sweep run is the first seed's
        longest = config.max_steps + cooldown_steps(config.max_steps) if config.max_steps else config.steps
        steps = sweeps * config.steps + seeds * longest  # at most: a plateau may come before max_steps
        curve_points = steps // config.eval_every if config.eval_every else sweeps + seeds
        began = time.perf_counter()
        problem.validate(model)
        validate = time.perf_counter() - began
        began = time.perf_counter()
        evaluate = problem.estimate_eval(model) if hasattr(problem, "estimate_eval") else 0.0
        rows = 1 + (len(config.rope_scalings) if _plain_rope(lm_config) else 0)
        seconds = steps * step_time + curve_points * validate + seeds * rows * evaluate
        per_model[name] = {"step_seconds": step_time, "eval_seconds": evaluate, "seconds": seconds}
        total += seconds
    return {"seconds": total, "models": per_model}


@contextlib.contextmanager
def _every_thread(world: int):
    """Under torchrun rank 0 evaluates alone while the other ranks wait at their next collective:
    it borrows their threads for the evaluation and gives them back after it (also on an error)."""
    threads = torch.get_num_threads()
    if world > 1:
        torch.set_num_threads(min(os.cpu_count() or 1, threads * world))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _diagnostics(model: TransformerLM, problem) -> dict:
    """What a trained model records beside its evaluation: the second corpus, T5's bucket values,
    the attention mass by distance at the first and last length, and FIRE's loss with its position
    normalization fixed (each where the problem and the model have it)."""
    extra = {}
    if getattr(problem, "second", None) is not None:
        extra["eval_second"] = problem.evaluate(model, which="second")
    buckets = t5_buckets(model, problem.train_len)
    if buckets is not None:
        extra["t5_buckets"] = buckets
    if hasattr(problem, "attention_windows"):
        extra["attention"] = {str(n): attention_by_distance(model, problem.attention_windows(n), problem.train_len)
                              for n in (problem.lengths[0], problem.lengths[-1])
                              if model.max_length() is None or n <= model.max_length()}
    if hasattr(problem, "held_out"):  # FIRE only: its loss with the position normalization fixed
        fire = fire_normalizer_ablation(model, *problem.held_out(problem.lengths[-1], FIRE_PROBE_WINDOWS), problem.train_len)
        if fire is not None:
            extra["fire_normalizer"] = fire
    return extra


def _log_run(progress, problem, name: str, seed: int, lr: float, run_: dict, stable_end, began: float) -> None:
    """One plain line per finished (model, seed): the metric at the first and last length and how it trained."""
    cells = run_["eval"]
    first, last = cells.get(str(problem.lengths[0])), cells.get(str(problem.lengths[-1]))
    show = lambda c: "n/a" if c is None else f"{c[problem.metric]:.4f}"  # noqa: E731
    trained = (f"{run_['steps']} steps" if stable_end is None else
               f"{'capped' if run_['capped'] else 'plateau'} at step {stable_end}, {run_['steps']} steps")
    _log(progress, f"{name} seed {seed} lr {lr:g}: {problem.metric} {show(first)} at {problem.lengths[0]}, "
                   f"{show(last)} at {problem.lengths[-1]} ({trained}, {run_['train_seconds']:.0f} s training, "
                   f"{(time.perf_counter() - began) / 60:.1f} min so far)")


def _progress_units(config: RunConfig, problem, scalings: tuple[str, ...]) -> int:
    """The progress bar's units for one (model, seed): its steps and one per evaluated length and row."""
    return config.steps + len(problem.lengths) * (1 + len(scalings))


def _log(progress, line: str) -> None:
    progress.log(time.strftime("%H:%M:%S ") + line)


@dataclass
class _Stages:
    """One call of :func:`run` after its set-up: the problem, how this process shares the work, the
    report it fills and the seconds each model's step and evaluation took in the estimate."""

    config: RunConfig
    problem: object
    share: Share
    progress: Progress
    report: dict
    windows: dict
    costs: dict  # {model: {"step_seconds", "eval_seconds"}}
    began: float

    def _seconds(self, name: str, what: str) -> float:
        """A model's measured step or evaluation time (0 where not measured: every process runs every run)."""
        return self.costs.get(name, {}).get(what, 0.0)

    def write(self) -> None:
        """results.json (rank 0; atomic), after every run it finishes, or in runs mode each other process's
        ``partial/rank<r>/`` until the stage's end hands its runs over: a kill loses at most the runs in progress."""
        out = pathlib.Path(self.config.out)
        if self.share.rank == 0:
            _write_report(self.report, self.windows, out)
        elif self.share.split:
            mine = out / PARTIAL / f"rank{self.share.rank}"
            mine.mkdir(parents=True, exist_ok=True)
            _write_report(self.report, self.windows, mine)

    def sweep(self, plan, lrs, previous: dict) -> dict:
        """Stage 1: every model at every learning rate on the first seed; the rate with the lowest final
        validation loss is chosen. Returns ``{model: chosen lr}``."""
        seed, config = self.config.seeds[0], self.config
        todo = {(name, f"{lr:g}"): config.steps * self._seconds(name, "step_seconds")
                for name, _ in plan for lr in lrs if f"{lr:g}" not in previous.get(name, {})}
        mine = self.share.mine(todo)
        for name, lm_config in plan:
            record = self.report["sweep"].setdefault(name, {})
            for lr in lrs:
                key = f"{lr:g}"
                if key in previous.get(name, {}):
                    record[key] = previous[name][key]
                elif (name, key) in mine:
                    _, losses, curve, seconds, _ = _train(name, lm_config, seed, lr, self.problem, config,
                                                          *self.share.train_world, self.progress, sweep=True)
                    record[key] = {"val": curve[-1][1], "curve": curve, "seconds": seconds,
                                   "train_loss": sum(losses[-20:]) / len(losses[-20:])}
                    if self.share.logs:  # one line per run, not one per process
                        _log(self.progress, f"sweep {name} lr {key} seed {seed}: validation {curve[-1][1]:.4f} ({seconds:.0f} s)")
                    self.write()
        self.report["sweep"] = self.share.gather(self.report["sweep"])
        chosen = {}
        for name, _ in plan:
            finite = {k: v["val"] for k, v in self.report["sweep"][name].items() if math.isfinite(float(v["val"]))}
            chosen[name] = float(min(finite, key=finite.get)) if finite else lrs[0]
        return chosen

    def seeds(self, plan, chosen: dict, previous: dict, scalings: tuple[str, ...], reuse_sweep: bool) -> None:
        """Stage 2: every model under every seed at its chosen rate, evaluated (the first seed's run
        goes on from the sweep's run of the chosen rate when ``reuse_sweep``)."""
        runs, config = self.report["runs"], self.config
        longest = config.max_steps + cooldown_steps(config.max_steps) if config.max_steps else config.steps
        todo = {}
        for name, lm_config in plan:
            rows = 1 + (len(scalings) if _plain_rope(lm_config) else 0)
            for seed in config.seeds:
                done = previous.get(name, {}).get(str(seed))
                if done is None or done.get("eval") is None:
                    steps = longest - (config.steps if reuse_sweep and seed == config.seeds[0] else 0)
                    todo[name, seed] = steps * self._seconds(name, "step_seconds") + rows * self._seconds(name, "eval_seconds")
        mine = self.share.mine(todo)
        per_model = _progress_units(config, self.problem, scalings)
        for name, lm_config in plan:
            for seed in config.seeds:
                key = str(seed)
                if (name, seed) not in todo:  # finished in an earlier run
                    runs.setdefault(name, {})[key] = previous[name][key]
                    for kind in scalings if _plain_rope(lm_config) else ():
                        runs.setdefault(f"rope + {kind}", {})[key] = previous[f"rope + {kind}"][key]
                    self.progress.step(f"{name} seed {seed}: done earlier", per_model)
                elif (name, seed) in mine:
                    self._one(name, lm_config, seed, chosen[name], scalings, reuse_sweep and seed == config.seeds[0])
        self.report["runs"] = self.share.gather(runs)

    def _one(self, name: str, lm_config: LMConfig, seed: int, lr: float, scalings: tuple[str, ...], reuse: bool) -> None:
        """Train and evaluate one (model, seed); with the RoPE scalings' rows for plain RoPE."""
        problem, share, key = self.problem, self.share, str(seed)
        model, losses, curve, seconds, stable_end = _train(name, lm_config, seed, lr, problem, self.config,
                                                           *share.train_world, self.progress, reuse=reuse)
        if share.rank == 0 or share.split:
            with _every_thread(1 if share.split else share.world):
                extra = {"lr": lr, "curve": curve, "process": share.rank, **_schedule(curve, self.config, stable_end, len(losses)),
                         **_diagnostics(model, problem)}
                self.report["runs"].setdefault(name, {})[key] = _result(model, losses, seconds, problem.evaluate(model), **extra)
                self.progress.step(f"evaluated {name} seed {seed}", len(problem.lengths))
                for kind in scalings if _plain_rope(lm_config) else ():
                    head_dim = lm_config.dim // lm_config.heads
                    rotary_for = lambda length, kind=kind: rope_scaling(  # noqa: E731
                        kind, head_dim, length, problem.train_len, self.report["rope_factor"])
                    self.report["runs"].setdefault(f"rope + {kind}", {})[key] = _result(
                        model, losses, seconds, problem.evaluate(model, rotary_for), derived_from=name, rope_scaling=kind, lr=lr)
                    self.progress.step(f"evaluated rope + {kind} seed {seed}", len(problem.lengths))
            self.write()
        if share.logs:
            _log_run(self.progress, problem, name, seed, lr, self.report["runs"][name][key], stable_end, self.began)


def _plan(config: RunConfig, problem) -> list[tuple[str, LMConfig]]:
    """Every model of the run with its configuration (position tables sized for the longest input)."""
    tokens = getattr(problem, "input_length", lambda n: n)
    return models(config.encodings, dim=config.dim, layers=config.layers, heads=config.heads,
                  train_len=problem.train_len, vocab=problem.vocab, buckets=config.buckets, bucketing=config.bucketing,
                  max_positions=max(tokens(n) for n in problem.lengths))


def _new_report(config: RunConfig, problem, world: int) -> dict:
    """results.json before any run: the environment, the options, the problem and its held-out windows."""
    report = {"environment": _environment(), "config": asdict(config), "problem": problem.describe(),
              "metric": problem.metric, "higher_is_better": problem.higher_is_better, "lengths": problem.lengths,
              "trained_lengths": problem.trained_lengths, "world_size": world, "rope_factor": _fixed_rope_factor(config, problem),
              "sweep": {}, "chosen_lr": {}, "runs": {}}
    if hasattr(problem, "windows"):
        report["windows"] = {which: problem.windows(which) for which in problem.test_sets}
    return report


def _finish(stages: _Stages) -> None:
    """Rank 0 after the last stage: summaries, the paired comparisons, results.json, results.md and the plot."""
    report, config = stages.report, stages.config
    out = pathlib.Path(config.out)
    report["summary"] = summarize_runs(report)
    report["comparisons"] = compare_all(report)
    report["wall_seconds"] = time.perf_counter() - stages.began
    _write_report(report, stages.windows, out)
    shutil.rmtree(out / PARTIAL, ignore_errors=True)  # every process's runs are in results.json now
    write_text(out / "results.md", markdown_report(report) + "\n")
    if config.plot:
        plot(report, out / "extrapolate.png")
    _log(stages.progress, f"done: {out / 'results.json'} ({report['wall_seconds'] / 60:.1f} min)")


def run(config: RunConfig, *, estimate_only: bool = False) -> dict:
    """Train and evaluate every model under every seed; write results.json, results.md and the plot.

    With several ``lrs``, a first stage trains every model at each rate on the first seed and keeps
    the rate with the lowest in-distribution validation loss; the seeds then train at that rate
    (the first seed's run is the sweep's). ``report["runs"][name][str(seed)]`` holds one seed's
    result, ``report["summary"][name][length]`` the mean and spread over seeds, and
    ``report["comparisons"]`` the paired bootstrap of every pair (Holm-adjusted). Rows
    ``rope + <scaling>`` are the trained RoPE model evaluated with that scaling (no training of their own).
    """
    began = time.perf_counter()
    share = Share.of(config.parallel)
    if not share.split and config.batch % share.world:
        raise ValueError(f"batch={config.batch} must be divisible by the number of processes ({share.world}) "
                         "with parallel='batch'; or use parallel='runs'")
    if share.rank == 0:
        _check_writable(config.out)  # before any training, not after it
        if not config.resume:  # a fresh run: no earlier run's partial results may be resumed later
            shutil.rmtree(pathlib.Path(config.out) / PARTIAL, ignore_errors=True)
    problem = make_problem(config)
    previous, previous_sweep = _previous_runs(config)
    plan = _plan(config, problem)
    scalings = config.rope_scalings if any(_plain_rope(c) for _, c in plan) else ()
    lrs = tuple(config.lrs) or (config.lr,)
    rates = rates_from(config.lr_from, [name for name, _ in plan]) if config.lr_from else None  # before any work
    guess = None
    if estimate_only or share.rank == 0:
        guess = estimate(config, problem, plan, lrs)
        _log(Progress(1, enabled=False), f"estimated time on this machine: {guess['seconds'] / 60 / (share.world if share.split else 1):.0f} min "
             f"({len(plan)} models, {len(config.seeds)} seeds, {len(lrs)} learning rates, {config.steps} steps"
             f"{f', {share.world} processes' if share.split else ''})")
        if estimate_only:
            return {"estimate": guess}
    costs = share.broadcast(guess["models"] if guess else None) if share.split else {}
    report = _new_report(config, problem, share.world)
    per_model = _progress_units(config, problem, scalings)
    progress = Progress(len(plan) * (len(config.seeds) + len(lrs) - 1) * per_model // (share.world if share.split else 1),
                        enabled=config.progress and share.rank == 0)
    stages = _Stages(config, problem, share, progress, report, _previous_windows(config), costs, began)
    if rates is not None:
        report["chosen_lr"] = rates
    else:
        report["chosen_lr"] = stages.sweep(plan, lrs, previous_sweep) if len(lrs) > 1 else {name: lrs[0] for name, _ in plan}
    stages.seeds(plan, report["chosen_lr"], previous, scalings, reuse_sweep=len(lrs) > 1)
    progress.close()
    if share.rank == 0:
        _finish(stages)
    if dist.is_initialized():
        dist.barrier()
    return report
