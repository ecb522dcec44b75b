"""The ``relpos`` command line.

``relpos extrapolate``: the main job, train short and test long with every encoding.
``relpos tasks``: the same on algorithmic tasks, exact-match accuracy per length.
``relpos buckets``: which relative positions (key - query) fall in each bucket.
``relpos plot``: heatmaps of buckets, biases, and standard vs biased attention.
``relpos explore``: the interactive page, served locally.
``relpos bench``: attention with a T5 bias against transformers and SDPA with no bias.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .. import registry
from .._cli import CommandParser, HelpFormatter
from ..encodings.buckets import STRATEGIES, bucket_table

__all__ = ["main"]


def _print_buckets(payload: dict) -> None:
    mode = "bidirectional" if payload["bidirectional"] else "causal"
    print(
        f"T5 buckets: num_buckets={payload['num_buckets']} max_distance={payload['max_distance']} "
        f"{mode} strategy={payload['strategy']}"
    )
    exact = f"exact for |distance| < {payload['max_exact']}" if payload["max_exact"] else "no exact region (every bucket spans a range)"
    print(f"relative position = key - query; {exact}")
    print(f"{'bucket':>6}  {'relative positions':<22}{'kind':<6}")
    for row in payload["buckets"]:
        low = "-inf" if row["low"] is None else str(row["low"])
        high = "+inf" if row["high"] is None else str(row["high"])
        span = low if low == high else f"{low} .. {high}"
        print(f"{row['bucket']:>6}  {span:<22}{'exact' if row['exact'] else 'range':<6}")
    if payload["unused_buckets"]:
        print(f"unused buckets (no distance maps there): {payload['unused_buckets']}")


def _cmd_buckets(args: argparse.Namespace) -> int:
    payload = bucket_table(args.num_buckets, args.max_distance, bidirectional=not args.causal, strategy=args.strategy)
    if args.json:
        json.dump(payload, sys.stdout, indent=2)
        print()
    else:
        _print_buckets(payload)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from . import plots

    if args.what == "buckets":
        path = plots.plot_buckets(
            args.output, num_buckets=args.num_buckets, max_distance=128 if args.max_distance is None else args.max_distance, causal=args.causal,
            strategy=args.strategy, length=64 if args.length is None else args.length,
        )
    elif args.what == "bias":
        options = {}
        if args.kind in registry.ENCODINGS:  # an unknown kind is refused by the plot, naming the choices
            page = [o.name for o in registry.get(args.kind).options if o.page]
            options = {name: getattr(args, name) for name in page if getattr(args, name, None) is not None}
        default_length = 49 if args.kind == "window2d" else 32
        length = default_length if args.length is None else args.length  # 0 is refused by the plot, not replaced
        path = plots.plot_bias(args.output, args.kind, length=length, causal=args.causal, seed=args.seed, **options)
    else:
        path = plots.plot_attention(args.output, scale=args.scale)
    print(f"wrote {path}")
    return 0


def _cmd_explore(args: argparse.Namespace) -> int:
    from .explore import serve

    try:
        serve(args.host, args.port, allow_remote=args.allow_remote)
    except ValueError as exc:
        print(f"relpos explore: {exc}", file=sys.stderr)
        return 2
    return 0


BUCKETS_DESCRIPTION = (
    "Print which relative positions (key - query) fall in each bucket of T5's bucketed bias: one row per bucket "
    "with its range of distances, whether it is exact (one distance) or a range, and the buckets no distance "
    "reaches. Computed by relpos.bucket_table; --json for machine-readable output."
)
PLOT_DESCRIPTION = (
    "Write a PNG heatmap computed by relpos itself: 'buckets' colours the T5 bucket of every (query, key) pair, "
    "'bias' draws head 0 of any plottable bias (learned tables at their seeded initialisation), 'attention' "
    "shows the worked 'The cat sat on mat' example, standard vs biased attention weights and their difference. "
    "Needs matplotlib (pip install 'relpos[plot]'). Only the file named by -o is written."
)
EXPLORE_DESCRIPTION = (
    "Serve the interactive page (buckets, bias matrices, standard vs biased attention, image patches) from a "
    "local web server, computed live by relpos; the address is printed. Loopback only unless --allow-remote; "
    "stop it with Ctrl-C. Writes no files."
)


def _add_buckets(sub) -> None:
    p = sub.add_parser("buckets", help="print the bucket of every relative position", description=BUCKETS_DESCRIPTION,
                       formatter_class=HelpFormatter)
    p.add_argument("--num-buckets", type=int, default=32, help="number of buckets (T5: 32; even when bidirectional)")
    p.add_argument("--max-distance", type=int, default=128, help="distances at or beyond it share the last bucket (T5: 128)")
    p.add_argument("--causal", action="store_true", help="decoder (causal) bucketing instead of bidirectional")
    p.add_argument("--strategy", choices=STRATEGIES, default="log",
                   help="how distances past the exact region map to buckets (T5: log)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_buckets)


def _add_plot(sub) -> None:
    pl = sub.add_parser("plot", help="heatmaps of buckets, biases, and standard vs biased attention (PNG)",
                        description=PLOT_DESCRIPTION, formatter_class=HelpFormatter)
    pl.add_argument("what", choices=("buckets", "bias", "attention"),
                    help="buckets: the bucket of each (query, key); bias: a bias matrix; attention: standard vs biased weights")
    pl.add_argument("-o", "--output", required=True, help="the PNG file to write (missing folders are created)")
    pl.add_argument("--kind", default="t5", help=f"bias to plot: {', '.join(registry.names(plot=True))}")
    pl.add_argument("--length", type=int, default=None,
                    help="sequence length (window2d: positions, a square) (default: 64 for buckets, 32 for bias, "
                         "49 for bias --kind window2d)")
    pl.add_argument("--num-buckets", type=int, default=32, help="T5 buckets (buckets, bias --kind t5)")
    pl.add_argument("--max-distance", type=int, default=None,
                    help="T5's max distance (buckets, bias --kind t5), clipped's clip distance (bias --kind clipped) "
                         "(default: the encoding's own: 128 for T5, 8 for clipped)")
    pl.add_argument("--causal", action="store_true", help="decoder (causal) form; future keys drawn as masked")
    pl.add_argument("--strategy", choices=STRATEGIES, default="log", help="bucketing strategy (T5: log)")
    pl.add_argument("--scale", type=float, default=0.3, help="log-decay scale (attention, log_decay)")
    pl.add_argument("--r1", type=float, default=None, help="Kerple's r1 (kerple, kerple_power) (default: Kerple's own, 1.0)")
    pl.add_argument("--r2", type=float, default=None, help="Kerple's r2 (kerple, kerple_power) (default: Kerple's own, 1.0)")
    pl.add_argument("--dim", type=int, default=None, help="Sandwich's d' (default: 16)")
    pl.add_argument("--init-L", dest="init_L", type=float, default=None, help="FIRE's threshold L (default: 512)")
    pl.add_argument("--seed", type=int, default=0, help="initialisation of learned tables")
    pl.set_defaults(func=_cmd_plot)


def _add_explore(sub) -> None:
    ex = sub.add_parser("explore", help="serve the interactive page on 127.0.0.1 (a free port, printed)",
                        description=EXPLORE_DESCRIPTION, formatter_class=HelpFormatter)
    ex.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    ex.add_argument("--allow-remote", action="store_true",
                    help="allow a non-loopback --host (no authentication: anyone who reaches the port can use the page)")
    ex.add_argument("--port", type=int, default=0, help="the port to listen on; 0: a free one, printed")
    ex.set_defaults(func=_cmd_explore)


def _add_experiments(sub) -> None:
    from ..experiment import cli as experiment

    e = sub.add_parser("extrapolate", help="train short, test long on text: every position encoding side by side",
                       description=experiment.DESCRIPTION, formatter_class=HelpFormatter)
    experiment.add_arguments(e)
    e.set_defaults(func=experiment.run_from_args)
    t = sub.add_parser("tasks", help="train short, test long on algorithmic tasks (copy, reverse, sort, addition)",
                       description=experiment.TASKS_DESCRIPTION, formatter_class=HelpFormatter)
    experiment.add_task_arguments(t)
    t.set_defaults(func=experiment.run_tasks_from_args)


def _add_bench(sub) -> None:
    from .bench import DESCRIPTION, add_arguments, run_from_args

    b = sub.add_parser("bench", help="benchmark attention with a T5 bias against transformers and SDPA",
                       description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(b)
    b.set_defaults(func=run_from_args)


def build_parser() -> argparse.ArgumentParser:
    """The ``relpos`` parser: every subcommand's help gives its description and each option's default,
    and an unknown option is reported with the subcommand's own usage."""
    parser = CommandParser(prog="relpos", description="Relative position encodings for attention.",
                           formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)
    for add in (_add_buckets, _add_plot, _add_explore, _add_experiments, _add_bench):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        parser.exit(2, f"relpos {args.command}: error: {exc}\n")
    except OSError as exc:  # an unwritable output, a missing input: one line, not a traceback
        parser.exit(2, f"relpos {args.command}: error: {exc.strerror or exc}: {exc.filename or ''}\n")


def console() -> None:
    """The ``relpos`` console script: :func:`main`, then under torchrun (``WORLD_SIZE`` > 1, ``relpos experiment``
    on several processes) the exit without interpreter teardown that gloo needs (``relpos._process``: why)."""
    from .._process import finish

    finish(main())


if __name__ == "__main__":  # pragma: no cover
    console()
