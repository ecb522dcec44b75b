"""Two training budgets of the same models compared run by run: does more training change the verdicts?

Reads two finished ``relpos extrapolate`` run folders evaluated on the same held-out windows (the
shorter and the longer budget) and, for every model both trained under ``--seed``, prints one
Markdown row: bits per byte at the first and the longest length under each budget, the
degradation (longest minus first) under the longer one, the change of that degradation from the
shorter budget with a paired bootstrap over the held-out files (the same seed, so the same initial
weights and batches: only the budget differs; Holm-adjusted over the rows), the plateau rule's
verdict and last-fifth gain, and the learning rate. ``--out FILE`` also writes the table (atomically).

    python tools/compare_budgets.py docs/extrapolate/reference docs/extrapolate/reference-longer-all --seed 0
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from relpos._io import write_text
from relpos.experiment.report import growth_per_file
from relpos.experiment.runner import cooldown_steps
from relpos.experiment.stats import holm, paired_bootstrap
from relpos.experiment.variants import describe


def _load(folder: str) -> dict:
    path = pathlib.Path(folder) / "results.json"
    if not path.is_file():
        raise ValueError(f"run folder {folder!r} has no results.json; pass the --out folder of a finished run")
    return json.loads(path.read_text())


def _growth(report: dict, name: str, seed: str):
    """``(1, F)`` each held-out file's loss growth from the first to the longest length under ``seed``
    alone, and the windows per file; None past a learned table."""
    one = {"windows": report["windows"], "lengths": report["lengths"], "runs": {name: {seed: report["runs"][name][seed]}}}
    return growth_per_file(one, name, report["lengths"][-1])


def _bits(run: dict, length: int) -> float | None:
    cell = run["eval"].get(str(length))
    return None if cell is None else cell["bits_per_byte"]


def compare(short: dict, long: dict, seed: int = 0, *, resamples: int = 2000) -> list[dict]:
    """One row per model trained under ``seed`` in both runs, sorted by the longer budget's loss at the longest length."""
    if short["windows"]["main"] != long["windows"]["main"]:
        raise ValueError("the two runs were evaluated on different held-out windows; compare runs made with the "
                         "same corpus, train_len and eval_tokens")
    key, first, last = str(seed), long["lengths"][0], long["lengths"][-1]
    names = [n for n in long["runs"] if key in long["runs"][n] and key in short["runs"].get(n, {})
             and "plateau" in long["runs"][n][key]]
    if not names:
        raise ValueError(f"seed={seed}: no model was trained under this seed in both runs")
    rows = []
    for name in names:
        a, b = short["runs"][name][key], long["runs"][name][key]
        spread = short.get("summary", {}).get(name, {}).get("degradation", {}).get(str(last))
        row = {"model": name, "short": (_bits(a, first), _bits(a, last)), "long": (_bits(b, first), _bits(b, last)),
               "plateau": b["plateau"], "lr": b["lr"], "change": None,
               "seed_range": None if spread is None or spread["n"] < 2 else (spread["min"], spread["max"])}
        grown_long, grown_short = _growth(long, name, key), _growth(short, name, key)
        if grown_long is not None and grown_short is not None:
            row["change"] = paired_bootstrap(grown_long[0], grown_short[0], grown_long[1], resamples=resamples)
        rows.append(row)
    tested = [r for r in rows if r["change"] is not None]
    for row, adjusted in zip(tested, holm([r["change"]["p"] for r in tested])):
        row["change"]["p_holm"] = adjusted
    return sorted(rows, key=lambda r: float("inf") if r["long"][1] is None else r["long"][1])


def _pair(values: tuple) -> str:
    return " → ".join("n/a" if v is None else f"{v:.3f}" for v in values)


def _budget(report: dict) -> str:
    """Every step a run trained: the constant rate's and the cool-down's (or the fixed step count)."""
    config = report["config"]
    steps = config["max_steps"] + cooldown_steps(config["max_steps"]) if config["max_steps"] else config["steps"]
    return f"{steps:,} steps"


def markdown(rows: list[dict], short: dict, long: dict) -> str:
    first, last = long["lengths"][0], long["lengths"][-1]
    lines = [f"| model | {_budget(short)}: @ {first} → @ {last} | {_budget(long)}: @ {first} → @ {last} | "
             f"degradation at {_budget(long)} | its change from {_budget(short)} [95% CI], Holm p | "
             f"degradation at {_budget(short)}: range over seeds | plateau rule (last fifth's gain) | rate |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        grown = None if r["long"][1] is None else r["long"][1] - r["long"][0]
        c = r["change"]
        change = "n/a" if c is None else f"{c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}], {c['p_holm']:.2g}"
        rule = r["plateau"]
        verdict = "held" if rule["reached"] else "not held"
        gain = "" if rule["gain"] is None else f" ({100 * rule['gain']:.2f}%)"
        spread = "n/a" if r["seed_range"] is None else f"{r['seed_range'][0]:+.3f} to {r['seed_range'][1]:+.3f}"
        lines.append(f"| {describe(r['model'])} | {_pair(r['short'])} | {_pair(r['long'])} | "
                     f"{'n/a' if grown is None else f'{grown:+.3f}'} | {change} | {spread} | {verdict}{gain} | {r['lr']:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("short", help="run folder of the shorter budget (results.json)")
    parser.add_argument("long", help="run folder of the longer budget, same held-out windows")
    parser.add_argument("--seed", type=int, default=0, help="the seed both runs trained (default 0)")
    parser.add_argument("--out", help="also write the table to this file (atomically)")
    args = parser.parse_args(argv)
    short, long = _load(args.short), _load(args.long)
    table = markdown(compare(short, long, args.seed), short, long)
    print(table, end="")
    if args.out:
        write_text(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
