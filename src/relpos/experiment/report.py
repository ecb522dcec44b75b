"""Results over seeds: the summary, the markdown tables and the plot of one run, and the ranking
across algorithmic tasks (mean reciprocal rank, as Kazemnejad et al. 2023 report it)."""

from __future__ import annotations

import math
import pathlib

from .._io import save_with
from .stats import paired_difference, summarize
from .variants import describe

__all__ = ["summarize_runs", "markdown_report", "ablation_table", "plot", "ranking", "ranking_markdown", "reciprocal_ranks", "KAZEMNEJAD_MRR"]

#: Kazemnejad et al. (NeurIPS 2023), mean reciprocal rank over their tasks (APE = sinusoidal)
KAZEMNEJAD_MRR = {"none": 0.69, "t5": 0.55, "alibi": 0.50, "rope": 0.33, "sinusoidal": 0.22}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarize_runs(report: dict) -> dict:
    """``{model: {"train_loss": summary, "eval": {length: summary | None}}}`` over the seeds.

    A length where the model has no result (past a learned table) summarizes to ``None``; each
    cell's summary also carries ``se``, the mean over seeds of the evaluation's own standard error.
    """
    metric = report["metric"]
    out = {}
    for name, seeds in report["runs"].items():
        results = list(seeds.values())
        cells = {}
        for length in report["lengths"]:
            evals = [r["eval"].get(str(length)) for r in results]
            if any(e is None for e in evals):
                cells[str(length)] = None
                continue
            cell = summarize([_as_float(e[metric]) for e in evals])
            ses = [e["se"] for e in evals if _finite(e.get("se"))]
            cell["se"] = sum(ses) / len(ses) if ses else None
            cell["values"] = [_as_float(e[metric]) for e in evals]
            cells[str(length)] = cell
        losses = [_as_float(r["train_loss"]) for r in results if r["train_loss"] is not None]
        out[name] = {"train_loss": summarize(losses), "eval": cells, "seeds": list(seeds)}
    return out


def _as_float(x) -> float:
    return float(x)  # json_safe wrote non-finite values as "nan"/"inf": float() reads them back


def _cell(s: dict | None, percent: bool) -> str:
    if s is None:
        return "n/a"
    mean = s["mean"]
    if not _finite(mean):
        return str(mean)
    scale, digits = (100, 1) if percent else (1, 3)
    text = f"{mean * scale:.{digits}f}"
    return text + (f" ± {s['std'] * scale:.{digits}f}" if s["std"] is not None else "")


def _sorted_models(summary: dict, length: str, higher: bool) -> list[str]:
    ok = [n for n, s in summary.items() if s["eval"].get(length) is not None and _finite(s["eval"][length]["mean"])]
    return sorted(ok, key=lambda n: summary[n]["eval"][length]["mean"], reverse=higher)


def _differences(report: dict, length: int) -> list[str]:
    """Adjacent models in the ranking at ``length``: is the gap larger than the seeds' noise?"""
    summary, higher = report["summary"], report["higher_is_better"]
    order = _sorted_models(summary, str(length), higher)
    if length <= max(report["trained_lengths"], default=0):  # the scalings are the identity there: RoPE's own row
        order = [n for n in order if not n.startswith("rope + ")]
    lines = []
    for better, worse in zip(order, order[1:]):
        a, b = summary[better]["eval"][str(length)], summary[worse]["eval"][str(length)]
        if len(a["values"]) != len(b["values"]) or len(a["values"]) < 2:
            continue
        d = paired_difference(a["values"], b["values"])
        scale = 100 if report["metric"] == "accuracy" else 1
        verdict = "significant" if d["significant"] else "within noise"
        lines.append(f"| {describe(better)} vs {describe(worse)} | {d['mean'] * scale:+.3f} ± {d['ci95'] * scale:.3f} | {verdict} |")
    return lines


def markdown_report(report: dict) -> str:
    """The results table (mean ± std over seeds), the significance of adjacent gaps, and the setup."""
    config, summary = report["config"], report["summary"]
    percent = report["metric"] == "accuracy"
    lengths = report["lengths"]
    trained = set(report["trained_lengths"])
    unit = "n = " if percent else "bpb @ "
    head = "| model | params (position) | " + " | ".join(
        f"{unit}{n}" + (" (trained)" if n in trained else "") for n in lengths) + " |"
    lines = [head, "|---|---|" + "---|" * len(lengths)]
    for name, s in summary.items():
        first = next(iter(report["runs"][name].values()))
        params = f"{first['parameters']:,} ({first['position_parameters']:,})"
        if "derived_from" in first:
            params = "same as RoPE"
        cells = [_cell(s["eval"][str(n)], percent) for n in lengths]
        lines.append(f"| {describe(name)} | {params} | " + " | ".join(cells) + " |")
    seeds = ", ".join(map(str, config["seeds"]))
    what = ("exact-match accuracy (%) on " if percent else "bits per byte (lower is better) on held-out ") + report["problem"]
    ses = [c["se"] for s in summary.values() for c in s["eval"].values() if c and _finite(c.get("se"))]
    env = report["environment"]
    lines += [
        "",
        f"{what}. Mean ± standard deviation over {len(config['seeds'])} seeds ({seeds}); the evaluation's own "
        f"standard error per cell is at most {max(ses) * (100 if percent else 1):.3f}." if ses else "",
        f"Trained for {config['steps']} steps of {config['batch']} (width {config['dim']}, {config['layers']} layers, "
        f"{config['heads']} heads, learning rate {config['lr']}); relpos {env['relpos']}, torch {env['torch']}, "
        f"{env['machine']}, {env['threads']} threads"
        + (f"; {report['wall_seconds'] / 60:.1f} min wall clock." if "wall_seconds" in report else "."),
    ]
    for length in (max(trained) if trained else lengths[0], lengths[-1]):
        rows = _differences(report, length)
        if rows:
            lines += ["", f"Neighbours in the ranking at {unit}{length}: paired difference over seeds, 95% t-interval",
                      "", "| pair | difference | verdict |", "|---|---|---|", *rows]
    if config.get("buckets") or config.get("bucketing"):
        lines += ["", ablation_table(report)]
    return "\n".join(lines)


def ablation_table(report: dict) -> str:
    """The bucket ablations' layout: per-byte perplexities at the training length and at 2x (seed means)."""
    config, summary = report["config"], report["summary"]
    n1, n2 = str(config["train_len"]), str(2 * config["train_len"])
    first = "Buckets" if config["buckets"] else "Strategy"
    lines = [f"| {first} | Params (bias) | Train PPL | Test PPL | Length Gen (2x) |", "|---|---|---|---|---|"]
    for name, s in summary.items():
        r = next(iter(report["runs"][name].values()))
        key = str(r["model"]["num_buckets"]) if config["buckets"] else r["model"]["strategy"]
        ppl = lambda cell: "n/a" if cell is None else f"{2 ** cell['mean']:.3f}"  # noqa: E731
        lines.append(f"| {key} | {r['position_parameters']} | {math.exp(s['train_loss']['mean']):.3f} | "
                     f"{ppl(s['eval'][n1])} | {ppl(s['eval'].get(n2))} |")
    return "\n".join(lines)


def _draw(ax, report: dict, names: list[str], colours: dict, percent: bool) -> None:
    """One line per model with error bars (std over seeds), nudged sideways so the bars do not overlap."""
    for k, name in enumerate(names):
        s = report["summary"][name]
        points = sorted((int(n), c) for n, c in s["eval"].items() if c is not None and _finite(c["mean"]))
        if not points:
            continue
        nudge = 1 + 0.012 * (k - len(names) / 2)  # a few percent along x
        xs = [n * nudge if not percent else n + 0.08 * (k - len(names) / 2) for n, _ in points]
        ys = [c["mean"] * (100 if percent else 1) for _, c in points]
        err = [(c["std"] or 0) * (100 if percent else 1) for _, c in points]
        style = dict(linestyle="--", marker="s", markersize=4) if name.startswith("rope + ") else dict(marker="o", markersize=4)
        if len(points) == 1:
            style = dict(marker="X", markersize=10, linestyle="none", zorder=5)
        ax.errorbar(xs, ys, yerr=err, capsize=2.5, elinewidth=1, color=colours[name], label=describe(name), **style)
    trained = report["trained_lengths"]
    if trained:
        ax.axvline(max(trained), color="gray", linestyle=":", label=f"longest trained ({max(trained)})")
    if percent:
        ax.set_ylim(-4, 104)  # the bars are mean ± std: accuracy itself stays in [0, 100]
    else:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("instance length n (digits)" if percent else "evaluation length (bytes)")
    ax.set_ylabel("exact-match accuracy (%)" if percent else "bits per byte (held-out, lower is better)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def plot(report: dict, path: pathlib.Path, *, title: str | None = None) -> pathlib.Path | None:
    """The metric against length: every trained model (left) and RoPE with each scaling (right);
    error bars are the standard deviation over seeds."""
    from ..plots import pyplot

    plt = pyplot(required=False)
    if plt is None:
        print("matplotlib is not installed: no plot (pip install 'relpos[plot]')")
        return None
    percent = report["metric"] == "accuracy"
    names = list(report["summary"])
    trained = [n for n in names if not n.startswith("rope + ")]
    scaled = [n for n in names if n.startswith("rope + ")]
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    colours = {n: palette[i % len(palette)] for i, n in enumerate(trained + scaled)}
    panels = 2 if scaled else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 5.2), squeeze=False)
    _draw(axes[0, 0], report, trained, colours, percent)
    axes[0, 0].set_title("every encoding, trained at the same length", fontsize=10)
    if scaled:
        ref = [n for n in ("rope", "alibi") if n in names]
        _draw(axes[0, 1], report, ref + scaled, colours, percent)
        axes[0, 1].set_title("RoPE evaluated with each scaling (no fine-tuning)", fontsize=10)
    seeds = len(report["config"]["seeds"])
    fig.suptitle(title or f"{report['problem'].split(':')[0]}: mean ± std over {seeds} seed{'s' * (seeds > 1)}", fontsize=11)
    fig.tight_layout()
    save_with(lambda tmp: fig.savefig(tmp, dpi=110), path)
    plt.close(fig)
    return path


# --- across tasks -------------------------------------------------------------------------------


def _beyond_training(report: dict, name: str) -> float:
    """Mean accuracy over the lengths past training (n/a counts as 0: no answer at all)."""
    trained = max(report["trained_lengths"], default=0)
    cells = [report["summary"][name]["eval"][str(n)] for n in report["lengths"] if n > trained]
    return sum(0.0 if c is None else c["mean"] for c in cells) / max(1, len(cells))


def reciprocal_ranks(scores: dict[str, float]) -> dict[str, float]:
    """1 / rank, higher score first; tied models share the better rank.

    >>> reciprocal_ranks({"a": 0.9, "b": 0.5, "c": 0.9})
    {'a': 1.0, 'b': 0.3333333333333333, 'c': 1.0}
    """
    return {n: 1.0 / (1 + sum(other > s for other in scores.values())) for n, s in scores.items()}


def ranking(reports: dict[str, dict], models: list[str] | None = None) -> dict:
    """Per task, accuracy past the training lengths and its reciprocal rank; the mean over tasks.

    A task on which every model scores the same (all 0, say) ranks nothing: it is listed under
    ``uninformative`` and left out of the mean, rather than giving every model rank 1.
    """
    names = models or [n for n in next(iter(reports.values()))["summary"]]
    per_task, uninformative = {}, []
    for task, report in reports.items():
        scores = {n: _beyond_training(report, n) for n in names if n in report["summary"]}
        per_task[task] = {"accuracy": scores, "reciprocal_rank": reciprocal_ranks(scores)}
        if len(set(scores.values())) <= 1:
            uninformative.append(task)
    counted = [t for t in per_task if t not in uninformative]
    mrr = {n: sum(per_task[t]["reciprocal_rank"][n] for t in counted) / len(counted) if counted else None for n in names}
    return {"tasks": per_task, "mrr": mrr, "uninformative": uninformative}


def ranking_markdown(reports: dict[str, dict]) -> str:
    """Accuracy past training per task, mean reciprocal rank over all models and over Kazemnejad et al.'s five."""
    everyone = ranking(reports)
    five = ranking(reports, [n for n in KAZEMNEJAD_MRR if all(n in r["summary"] for r in reports.values())])
    tasks = list(reports)
    lines = ["| model | " + " | ".join(f"{t} (past training)" for t in tasks) + " | MRR, all models | MRR, the paper's five | paper's MRR |",
             "|---|" + "---|" * (len(tasks) + 3)]
    number = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
    for name in sorted(everyone["mrr"], key=lambda n: -(everyone["mrr"][n] or 0)):
        accs = " | ".join(f"{100 * everyone['tasks'][t]['accuracy'][name]:.1f}%" for t in tasks)
        paper = f"{KAZEMNEJAD_MRR[name]:.2f}" if name in KAZEMNEJAD_MRR else ""
        lines.append(f"| {describe(name)} | {accs} | {number(everyone['mrr'][name])} | {number(five['mrr'].get(name))} | {paper} |")
    if everyone["uninformative"]:
        lines += ["", f"Left out of the MRR: {', '.join(everyone['uninformative'])} (every model scores the same there)."]
    return "\n".join(lines)
