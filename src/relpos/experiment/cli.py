"""``relpos extrapolate`` (held-out text) and ``relpos tasks`` (algorithmic tasks): options,
their validation before any training, and the printed summary."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
from typing import Callable

from .._cli import HelpFormatter
from .._io import json_safe, write_text
from .._process import close_process_group
from ..encodings.buckets import STRATEGIES
from . import runner
from .parallel import PARALLEL
from .report import markdown_report, ranking, ranking_markdown
from .tasks import TASKS
from .variants import ALL_MODELS, MODELS, ROPE_SCALING_ROWS

__all__ = ["DESCRIPTION", "TASKS_DESCRIPTION", "DEFAULT_OUT", "DEFAULT_TASKS_OUT", "add_arguments", "add_task_arguments",
           "config_from_args", "task_configs_from_args", "run_from_args",
           "run_tasks_from_args", "main"]

DEFAULT_TASKS = ("copy", "reverse", "sort")
#: the reference preset's tasks: Kazemnejad et al.'s that fit the budget (sort is left out: it needs no
#: positions) and SCAN's length split
REFERENCE_TASKS = ("copy", "reverse", "addition", "parity", "summation", "scan")
#: where each experiment writes when --out is not given: a folder in the current directory (the
#: repository's .gitignore lists both, so a run inside a clone leaves no untracked files)
DEFAULT_OUT, DEFAULT_TASKS_OUT = "relpos-extrapolate", "relpos-tasks"
#: the default preset's wall time on this project's 2-core VM, in minutes, measured: text 486 s
#: (docs/extrapolate/default/results.json, "wall_seconds"; tests/experiment/test_extrapolate.py holds the two
#: equal), tasks about 13 min (docs/experiments/running.md); every page quotes these
DEFAULT_MINUTES = {"extrapolate": 8, "tasks": 13}
DESCRIPTION = (
    "Train small byte-level language models on short windows of text and test them on windows up to 16 times "
    "longer, one model per position encoding (and RoPE with each scaling, no fine-tuning), over several seeds; "
    "print bits per byte at every length and write results.json, results.md, a plot and checkpoints to --out "
    f"(by default ./{DEFAULT_OUT}/). --preset sets the size; --estimate-only prints the time first."
)
TASKS_DESCRIPTION = (
    "Train small models on short instances of algorithmic tasks (copy, reverse, sort, addition, ... and SCAN's "
    "length split) and test exact-match accuracy on longer ones, one model per position encoding, over several "
    "seeds; print a ranking past the training lengths and write one folder per task plus summary.md and "
    f"summary.json to --out (by default ./{DEFAULT_TASKS_OUT}/). --estimate-only prints the time first."
)


def _csv(kind, text: str, option: str) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{option} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None


def _seeds(text: str) -> tuple[int, ...]:
    """``--seeds 0,1,2`` (the seeds) or ``--seeds 3`` (that many: 0, 1, 2)."""
    values = _csv(int, text, "--seeds")
    if len(values) == 1 and "," not in text:
        if values[0] < 1:
            raise ValueError(f"--seeds as a count must be >= 1, got {values[0]}")
        return tuple(range(values[0]))
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise ValueError(f"--seeds must be distinct non-negative integers (or one count), got {text!r}")
    return values


def _common(parser: argparse.ArgumentParser, presets: dict, sizes: tuple[tuple[str, type], ...], minutes: int) -> None:
    parser.add_argument("--preset", choices=sorted(presets), default="default",
                        help=f"size of the run: default (about {minutes} minutes on 2 cores), reference (the committed evidence, "
                             "about two hours: see --estimate-only), full (longer), smoke (seconds); docs/experiments/running.md")
    parser.add_argument("--encodings",
                        help=f"comma-separated models, from: {', '.join(ALL_MODELS)} (t5_md128: T5 with max_distance 128; "
                             f"rope_randomized: RoPE at randomized positions, Ruoss et al. 2023; default: {', '.join(MODELS)}; "
                             "the reference presets run every model)")
    parser.add_argument("--rope-scalings",
                        help="RoPE scalings evaluated on the trained RoPE model, no fine-tuning (empty: none), "
                             f"from: {', '.join(ROPE_SCALING_ROWS)} (default: all; the reference presets: fewer)")
    parser.add_argument("--seeds", help="seeds as 0,1,2 or a count (3 = 0,1,2); default: the preset's (3)")
    for name, kind in sizes:
        parser.add_argument(f"--{name}", type=kind, help="overrides the preset (default: the preset's)")
    parser.add_argument("--lrs", help="learning-rate sweep, e.g. 1e-3,3e-3,1e-2: each model's rate is chosen on "
                                      "in-distribution validation (default: the preset's; the reference preset sweeps)")
    parser.add_argument("--lr-from", help="each model's learning rate as an earlier run chose it (that run's results.json); no sweep "
                                          "(default: none: --lrs or the preset's rates)")
    parser.add_argument("--eval-every", type=int, help="steps between learning-curve points (0: only the end) (default: the preset's: "
                                                       "0, 100 for the reference presets)")
    parser.add_argument("--max-steps", type=int,
                        help="train to a plateau: the constant rate until the validation loss gains < 1%% over the last "
                             "20%% of the steps (checked at every --eval-every, from --steps on) or this many steps, then a "
                             "cool-down of 20%% of the steps done (0: exactly --steps, cosine) (default: the preset's: 0; the "
                             "reference text preset: 3000, with --plateau-from 3000)")
    parser.add_argument("--plateau-from", type=int,
                        help="with --max-steps: the first step at which the plateau rule may end the constant rate "
                             "(default: --steps; equal to --max-steps: a fixed budget, the rule only reported)")
    parser.add_argument("--rope-factor", type=float, help="the fixed RoPE scaling factor (default: longest evaluation length / training length)")
    parser.add_argument("--estimate-only", action="store_true", help="print the estimated time of the run (measured steps) and stop")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (for --resume)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoints and results in --out (the options must be the same; more seeds or models may be added)")
    parser.add_argument("--parallel", choices=PARALLEL, default="runs",
                        help="under torchrun: each process trains whole runs of its own (runs: the results equal one "
                             "process's) or its slice of every run's batch (batch: DistributedDataParallel; the committed "
                             "text reference was made so)")
    parser.add_argument("--no-plot", action="store_true", help="skip the plot (no matplotlib needed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")


_SIZES = (("dim", int), ("layers", int), ("heads", int), ("batch", int), ("steps", int), ("lr", float))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``relpos extrapolate``: byte-level language modelling, trained short and tested long."""
    _common(parser, runner.PRESETS, _SIZES + (("train-len", int), ("eval-tokens", int), ("val-windows", int)), DEFAULT_MINUTES["extrapolate"])
    parser.add_argument("--multipliers", default="1,2,4,8,16", help="evaluation lengths as multiples of --train-len")
    parser.add_argument("--buckets", default="", help="ablation: T5 bias with these bucket counts, e.g. 8,16,32,64,128 "
                                                     "(default: none, no ablation)")
    parser.add_argument("--bucketing", default="", help=f"ablation: T5 bias with these strategies, from {', '.join(STRATEGIES)} "
                                                          "(default: none, no ablation)")
    parser.add_argument("--corpus", help="a text file or a folder of text files (default: the Python standard library)")
    parser.add_argument("--second-corpus", help="a second text (a folder) evaluated the same way (default: the preset's: none; "
                             "the reference preset: /usr/include, C headers)")
    parser.add_argument("--second-eval-tokens", type=int, help="held-out bytes per length on the second corpus (default: the preset's, "
                             "or --eval-tokens)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="folder for results.json, results.md, the plot and checkpoints, created if missing "
                             f"(default: {DEFAULT_OUT}, in the current directory)")


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """``relpos tasks``: algorithmic tasks, trained on short instances and tested on longer ones."""
    _common(parser, runner.TASK_PRESETS, _SIZES + (("train-max", int), ("eval-instances", int)), DEFAULT_MINUTES["tasks"])
    parser.add_argument("--tasks", help=f"comma-separated, from: {', '.join(TASKS)}, scan (SCAN's length split, Lake & Baroni "
                                        f"2018: its own lengths, --train-max and --test-lengths do not apply) (default: {','.join(DEFAULT_TASKS)}; "
                                        f"reference preset: {','.join(REFERENCE_TASKS)})")
    parser.add_argument("--test-lengths", help="instance lengths to test, e.g. 8,16,32,64 (default: the preset's)")
    parser.add_argument("--out", default=DEFAULT_TASKS_OUT,
                        help="folder: one subfolder per task, and summary.md, created if missing "
                             f"(default: {DEFAULT_TASKS_OUT}, in the current directory)")


def _check_models(text: str) -> tuple[str, ...]:
    names = _csv(str, text, "--encodings")
    unknown = [e for e in names if e not in ALL_MODELS]
    if unknown:
        raise ValueError(f"--encodings: unknown {unknown}; choose from {', '.join(ALL_MODELS)}")
    return names


def _check_plateau(preset: dict) -> None:
    """Training to a plateau needs learning-curve points and at least ``steps`` steps."""
    max_steps, steps = preset.get("max_steps", 0), preset["steps"]
    if max_steps < 0 or 0 < max_steps < steps:
        raise ValueError(f"--max-steps must be 0 (exactly --steps) or >= --steps ({steps}), got {max_steps}")
    plateau_from = preset.get("plateau_from", 0)
    if plateau_from < 0 or (plateau_from and not max_steps) or plateau_from > max_steps:
        raise ValueError(f"--plateau-from must be between 0 and --max-steps ({max_steps}) and needs --max-steps, "
                         f"got {plateau_from}")
    if max_steps and not preset.get("eval_every"):
        raise ValueError("--max-steps (training to a plateau) checks the rule at learning-curve points: "
                         "give --eval-every > 0, e.g. 100")


def _base_config(args, presets: dict, keys: tuple[str, ...]) -> dict:
    preset = dict(presets[args.preset])
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            preset[key] = value
    for key in keys:
        if key != "lr" and preset.get(key, 1) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {preset[key]}")
    if not (math.isfinite(preset["lr"]) and preset["lr"] > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {preset['lr']}")
    if args.checkpoint_every < 1:
        raise ValueError(f"--checkpoint-every must be positive, got {args.checkpoint_every}")
    text = args.rope_scalings if args.rope_scalings is not None else ",".join(preset.pop("rope_scalings", ROPE_SCALING_ROWS))
    preset.pop("rope_scalings", None)
    scalings = _csv(str, text, "--rope-scalings")
    if any(s not in ROPE_SCALING_ROWS for s in scalings):
        raise ValueError(f"--rope-scalings must be among {', '.join(ROPE_SCALING_ROWS)}, got {text!r}")
    if args.seeds is not None:
        preset["seeds"] = _seeds(args.seeds)
    if args.lrs is not None:
        preset["lrs"] = _csv(float, args.lrs, "--lrs")
        if any(not (math.isfinite(v) and v > 0) for v in preset["lrs"]):
            raise ValueError(f"--lrs must be finite numbers > 0, got {args.lrs!r}")
    if args.lr_from is not None:
        if args.lrs is not None:
            raise ValueError("--lr-from and --lrs both set each model's learning rate: give one")
        preset.pop("lrs", None)  # the preset's sweep gives way to the earlier run's choice
        preset["lr_from"] = args.lr_from
    if args.eval_every is not None:
        if args.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0, got {args.eval_every}")
        preset["eval_every"] = args.eval_every
    if args.max_steps is not None:
        preset["max_steps"] = args.max_steps
    if args.plateau_from is not None:
        preset["plateau_from"] = args.plateau_from
    _check_plateau(preset)
    if args.rope_factor is not None:
        if not (math.isfinite(args.rope_factor) and args.rope_factor >= 1):
            raise ValueError(f"--rope-factor must be a finite number >= 1, got {args.rope_factor}")
        preset["rope_factor"] = args.rope_factor
    encodings = args.encodings if args.encodings is not None else ",".join(preset.pop("encodings", MODELS))
    preset.pop("encodings", None)
    return dict(preset, encodings=_check_models(encodings), rope_scalings=scalings, out=args.out,
                checkpoint_every=args.checkpoint_every, resume=args.resume, plot=not args.no_plot,
                progress=not args.no_progress, preset=args.preset, parallel=args.parallel)


def config_from_args(args) -> runner.RunConfig:
    fields = _base_config(args, runner.PRESETS, ("dim", "layers", "heads", "batch", "steps", "lr", "train_len", "eval_tokens",
                                                 "val_windows"))
    bucketing = _csv(str, args.bucketing, "--bucketing")
    if any(s not in STRATEGIES for s in bucketing):
        raise ValueError(f"--bucketing must be among {', '.join(STRATEGIES)}, got {args.bucketing!r}")
    buckets = _csv(int, args.buckets, "--buckets")
    if buckets and min(buckets) < 2:
        raise ValueError(f"--buckets must be bucket counts >= 2, got {args.buckets!r}")
    if not fields["encodings"] and not buckets and not bucketing:
        raise ValueError("--encodings is empty: name at least one of " + ", ".join(MODELS))
    multipliers = _csv(int, args.multipliers, "--multipliers")
    if not multipliers or min(multipliers) < 1:
        raise ValueError(f"--multipliers must be positive integers, got {args.multipliers!r}")
    for key in ("second_corpus", "second_eval_tokens"):
        if getattr(args, key, None) is not None:
            fields[key] = getattr(args, key)
    if fields.get("second_corpus") and not pathlib.Path(fields["second_corpus"]).exists():
        raise ValueError(f"--second-corpus {fields['second_corpus']!r} does not exist; give a folder of text files "
                         "(or --second-corpus '' for none)")
    return runner.RunConfig(task="text", multipliers=multipliers, buckets=buckets, bucketing=bucketing,
                            corpus=args.corpus, **fields)


def task_configs_from_args(args) -> list[runner.RunConfig]:
    """One configuration per task, each writing into ``--out/<task>``."""
    fields = _base_config(args, runner.TASK_PRESETS, ("dim", "layers", "heads", "batch", "steps", "lr", "train_max", "eval_instances"))
    if not fields["encodings"]:
        raise ValueError("--encodings is empty: name at least one of " + ", ".join(MODELS))
    tasks = _csv(str, args.tasks or ",".join(REFERENCE_TASKS if args.preset == "reference" else DEFAULT_TASKS), "--tasks")
    if not tasks or any(t not in (*TASKS, "scan") for t in tasks):
        raise ValueError(f"--tasks must name some of {', '.join(TASKS)}, scan; got {args.tasks!r}")
    if args.test_lengths is not None:
        fields["test_lengths"] = _csv(int, args.test_lengths, "--test-lengths")
    lengths = fields["test_lengths"]
    if not lengths or min(lengths) < 1 or list(lengths) != sorted(set(lengths)):
        raise ValueError(f"--test-lengths must be increasing positive integers, got {lengths!r}")
    out = fields.pop("out")
    return [runner.RunConfig(task=t, out=str(pathlib.Path(out) / t), **fields) for t in tasks]


def _interrupted(out: str) -> int:
    print(f"\ninterrupted: the checkpoints in {out} are complete; continue with the same options and --resume", file=sys.stderr)
    return 130


def _closing(run: Callable[[], int]) -> int:
    """``run()``, then the process group ended (:func:`relpos._process.close_process_group`; under torchrun,
    ``python -m relpos.experiment`` then exits without interpreter teardown: ``relpos._process`` says why)."""
    try:
        code = run()
    except BaseException:
        close_process_group(clean=False)
        raise
    close_process_group()
    return code


def run_from_args(args) -> int:
    return _closing(lambda: _run_one(args))


def _run_one(args) -> int:
    config = config_from_args(args)
    if args.estimate_only:
        runner.run(config, estimate_only=True)
        return 0
    try:
        report = runner.run(config)
    except KeyboardInterrupt:
        return _interrupted(args.out)
    if int(os.environ.get("RANK", "0")) == 0:
        print(markdown_report(report))
        print(f"\nresults: {pathlib.Path(args.out) / 'results.json'}" + ("" if args.no_plot else f", plot: {pathlib.Path(args.out) / 'extrapolate.png'}"))
    return 0


def run_tasks_from_args(args) -> int:
    return _closing(lambda: _run_tasks(args))


def _run_tasks(args) -> int:
    configs = task_configs_from_args(args)
    if args.estimate_only:
        total = sum(runner.run(c, estimate_only=True)["estimate"]["seconds"] for c in configs)
        print(f"estimated time of every task on this machine: {total / 60:.0f} min", file=sys.stderr)
        return 0
    reports = {}
    try:
        for config in configs:
            reports[config.task] = runner.run(config)
    except KeyboardInterrupt:
        return _interrupted(args.out)
    if int(os.environ.get("RANK", "0")) == 0:
        for task, report in reports.items():
            print(f"\n## {task}\n\n{markdown_report(report)}")
        summary = ranking_markdown(reports)
        write_text(pathlib.Path(args.out) / "summary.md", summary + "\n")
        write_text(pathlib.Path(args.out) / "summary.json", json.dumps(json_safe(ranking(reports)), indent=1))
        print(f"\n## ranking past the training lengths\n\n{summary}\n\nresults: {args.out}/<task>/results.json, {args.out}/summary.md")
    return 0


def build_parser(tasks: bool = False) -> argparse.ArgumentParser:
    """The parser of ``python -m relpos.experiment`` (``tasks=False``: ``relpos extrapolate``'s options) or of
    ``python -m relpos.experiment tasks`` (``tasks=True``: ``relpos tasks``'s, given the arguments after ``tasks``)."""
    parser = argparse.ArgumentParser(prog="relpos tasks" if tasks else "relpos extrapolate",
                                     description=TASKS_DESCRIPTION if tasks else DESCRIPTION, formatter_class=HelpFormatter)
    (add_task_arguments if tasks else add_arguments)(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m relpos.experiment [tasks] ...`` (and under torchrun): the same as the CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    tasks = bool(argv) and argv[0] == "tasks"
    parser = build_parser(tasks)
    args = parser.parse_args(argv[1:] if tasks else argv)
    try:
        return (run_tasks_from_args if tasks else run_from_args)(args)
    except (ValueError, TypeError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
