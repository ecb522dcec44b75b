"""Results over seeds: the summary, the markdown tables and the plot of one run, and the ranking
across algorithmic tasks (mean reciprocal rank, as Kazemnejad et al. 2023 report it)."""

from __future__ import annotations

import math
import pathlib

from .._io import save_with
import torch

from .stats import holm, paired_bootstrap, summarize
from .variants import describe

__all__ = ["summarize_runs", "per_file", "compare_all", "markdown_report", "ablation_table", "plot", "ranking", "learned_seeds",
           "ranking_markdown", "reciprocal_ranks", "SUCCESS", "KAZEMNEJAD_MRR"]

#: a seed "succeeds" at a length when its exact-match accuracy there reaches this
SUCCESS = 0.9

#: Kazemnejad et al. (NeurIPS 2023), mean reciprocal rank over their tasks (APE = sinusoidal)
KAZEMNEJAD_MRR = {"none": 0.69, "t5": 0.55, "alibi": 0.50, "rope": 0.33, "sinusoidal": 0.22}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summarize_runs(report: dict, key: str = "eval") -> dict:
    """``{model: {"train_loss": summary, "eval": {length: summary | None}, "degradation": ...}}`` over
    the seeds (``key="eval_second"``: the second corpus).

    A length where the model has no result (past a learned table) summarizes to ``None``; each
    cell's summary also carries ``se``, the mean over seeds of the evaluation's own standard error.
    ``degradation`` is each seed's value minus its own value at the first length (text: 1x).
    """
    metric = report["metric"]
    out = {}
    for name, seeds in report["runs"].items():
        results = [r for r in seeds.values() if key in r]
        if not results:
            continue
        cells, degradation = {}, {}
        for length in report["lengths"]:
            evals = [r[key].get(str(length)) for r in results]
            base = [r[key].get(str(report["lengths"][0])) for r in results]
            if not any(e is None for e in evals + base):
                degradation[str(length)] = summarize([_as_float(e[metric]) - _as_float(b[metric]) for e, b in zip(evals, base)])
            if any(e is None for e in evals):
                cells[str(length)] = None
                continue
            cell = summarize([_as_float(e[metric]) for e in evals])
            ses = [e["se"] for e in evals if _finite(e.get("se"))]
            cell["se"] = sum(ses) / len(ses) if ses else None
            cell["values"] = [_as_float(e[metric]) for e in evals]
            if metric == "accuracy":
                cell["successes"] = sum(v >= SUCCESS for v in cell["values"])
            cells[str(length)] = cell
        losses = [_as_float(r["train_loss"]) for r in results if r["train_loss"] is not None]
        out[name] = {"train_loss": summarize(losses), "eval": cells, "degradation": degradation, "seeds": list(seeds)}
    return out


def per_file(report: dict, name: str, length: int, which: str = "main") -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(seeds, files)`` mean bits per byte of each held-out file's windows at ``length``, and the
    windows per file ``(files,)``; only files with a window at that length. ``None``: no result."""
    key = "eval" if which == "main" else "eval_second"
    owner = report["windows"][which]["window_file"][str(length)]
    files = sorted(set(owner))
    column = {f: i for i, f in enumerate(files)}
    index = torch.tensor([column[f] for f in owner])  # (N,)
    counts = torch.bincount(index, minlength=len(files)).double()  # (F,)
    rows = []
    for seed in sorted(report["runs"][name], key=int):
        cell = report["runs"][name][seed].get(key, {}).get(str(length))
        if cell is None or "file_means" not in cell:
            return None
        rows.append(torch.tensor([_as_float(v) for v in cell["file_means"]], dtype=torch.float64))  # (F,)
    return torch.stack(rows), counts


def growth_per_file(report: dict, name: str, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(seeds, files)`` each held-out file's loss at ``length`` minus its loss at the first length
    (the files with a window at ``length``), and the windows per file; ``None``: no result."""
    first = report["lengths"][0]
    at, base = per_file(report, name, length), per_file(report, name, first)
    if at is None or base is None:
        return None
    columns = sorted(set(report["windows"]["main"]["window_file"][str(length)]))
    base_columns = sorted(set(report["windows"]["main"]["window_file"][str(first)]))
    keep = torch.tensor([base_columns.index(f) for f in columns])  # the length's files among the first length's
    return at[0] - base[0][:, keep], at[1]


def compare_all(report: dict, *, resamples: int = 1000) -> dict:
    """Every pair of models at every length, on the bits per byte and on the degradation from
    each model's own first length: a paired bootstrap over held-out files and seeds, with Holm's
    adjustment over the whole family of comparisons (every pair, length, and both measures)."""
    if "windows" not in report:
        return {"comparisons": [], "family": 0, "correction": None}
    names = [n for n in report["runs"] if n in report.get("summary", report["runs"])]
    first = report["lengths"][0]
    rows = []
    for length in report["lengths"]:
        data = {n: per_file(report, n, length) for n in names}
        growth = {n: growth_per_file(report, n, length) for n in names} if length != first else {}
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if data[a] is None or data[b] is None or data[a][0].shape != data[b][0].shape:
                    continue
                weights = data[a][1]
                r = paired_bootstrap(data[a][0], data[b][0], weights, resamples=resamples)
                rows.append({"a": a, "b": b, "length": length, "measure": "bits_per_byte", **r})
                if growth.get(a) is not None and growth.get(b) is not None:
                    r = paired_bootstrap(growth[a][0], growth[b][0], weights, resamples=resamples)  # (S, F) each
                    rows.append({"a": a, "b": b, "length": length, "measure": "degradation", **r})
    for row, adjusted in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = adjusted
        row["significant"] = adjusted < 0.05
    return {"comparisons": rows, "family": len(rows),
            "correction": f"Holm over all {len(rows)} comparisons (every pair, length and measure), family-wise 5%"}


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
    text += f" ± {s['std'] * scale:.{digits}f}" if s["std"] is not None else ""
    return text + (f" ({s['successes']}/{s['n']})" if "successes" in s else "")


def _sorted_models(summary: dict, length: str, higher: bool) -> list[str]:
    ok = [n for n, s in summary.items() if s["eval"].get(length) is not None and _finite(s["eval"][length]["mean"])]
    return sorted(ok, key=lambda n: summary[n]["eval"][length]["mean"], reverse=higher)


def _differences(report: dict, length: int, measure: str = "bits_per_byte") -> list[str]:
    """Adjacent models in the ranking at ``length``: the paired bootstrap's difference, interval and
    Holm-adjusted p (from :func:`compare_all`, whose family covers every pair)."""
    summary = report["summary"]
    found = {(c["a"], c["b"]): c for c in report.get("comparisons", {}).get("comparisons", [])
             if c["length"] == length and c["measure"] == measure}
    cells = {n: (s["eval"] if measure == "bits_per_byte" else s["degradation"]).get(str(length)) for n, s in summary.items()}
    order = sorted((n for n, c in cells.items() if c is not None and _finite(c["mean"])), key=lambda n: cells[n]["mean"])
    if length <= max(report["trained_lengths"], default=0):  # the oracle scalings are the identity there
        order = [n for n in order if not n.endswith("-oracle")]
    lines = []
    for better, worse in zip(order, order[1:]):
        c = found.get((better, worse))
        sign = 1
        if c is None:
            c, sign = found.get((worse, better)), -1
        if c is None:
            continue
        lo, hi = sorted((sign * c["low"], sign * c["high"]))
        verdict = "significant" if c["significant"] else "not significant"
        lines.append(f"| {describe(better)} vs {describe(worse)} | {sign * c['mean']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                     f"{_p_text(c['p_holm'])} | {verdict} |")
    return lines


def _p_text(p: float) -> str:
    """A p-value for a table: 3 significant digits; below the float range, said so rather than '0'.

    >>> _p_text(0.0123), _p_text(0.0)
    ('0.0123', '< 1e-300')
    """
    return "< 1e-300" if p < 1e-300 else f"{p:.3g}"


def _plateau_start(config: dict) -> int:
    """The first step at which the plateau rule may end a run's constant rate."""
    return max(config.get("plateau_from") or 0, config["steps"])


def _budget(config: dict) -> str:
    """How the run was trained, in words (a fixed cosine budget, a fixed constant-rate budget, or to a plateau)."""
    cool = "then a linear cool-down over 20% of the steps done"
    if not config.get("max_steps"):
        return f"Trained for {config['steps']} steps of {config['batch']}"
    if _plateau_start(config) >= config["max_steps"]:
        return (f"Trained {config['max_steps']} steps at a constant rate, {cool}, in batches of {config['batch']} "
                "(the plateau rule checked at the end of the constant rate)")
    return (f"Trained to a plateau (at least {_plateau_start(config)}, at most {config['max_steps']} steps of the constant "
            f"rate, {cool}) in batches of {config['batch']}")


def _training_table(report: dict) -> list[str]:
    """Per model: the chosen learning rate, the in-distribution validation loss at the end, the
    plateau rule (seeds where it held) and, when training to a plateau, the steps it took."""
    runs, config = report["runs"], report["config"]
    to_plateau, start = bool(config.get("max_steps")), _plateau_start(config)
    rule = (f"the constant rate's plateau (the rule checked at every learning-curve point from step {start}; capped: "
            f"{config.get('max_steps')} steps reached first) and the steps with the cool-down" if to_plateau
            else "the plateau rule at the end of the budget")
    lines = ["", f"Learning rate chosen on in-distribution validation, {rule}", "",
             "| model | learning rate | validation (first seed) | plateaued (seeds) |" + (" steps to the plateau | steps in all |" if to_plateau else ""),
             "|---|---|---|---|" + ("---|---|" if to_plateau else "")]
    for name, seeds in runs.items():
        first = next(iter(seeds.values()))
        if "derived_from" in first or "curve" not in first:
            continue
        reached = [r["plateau"]["reached"] for r in seeds.values()]
        val = first["curve"][-1][1] if first["curve"] else None
        row = (f"| {describe(name)} | {first['lr']:g} | {'' if val is None else f'{_as_float(val):.4f}'} | "
               f"{sum(bool(x) for x in reached)}/{len(reached)} |")
        if to_plateau:
            ends = [str(r.get("stable_end")) + (" (capped)" if r.get("capped") else "") for r in seeds.values()]
            row += f" {', '.join(ends)} | {', '.join(str(r.get('steps')) for r in seeds.values())} |"
        lines.append(row)
    return lines


def _text_tables(report: dict) -> list[str]:
    """Degradation from each model's own 1x, the learning rate and plateau, loss by position, the second corpus."""
    summary, lengths, runs = report["summary"], report["lengths"], report["runs"]
    lines = ["", "Degradation: each seed's bits per byte minus its own at the training length (mean ± std over seeds)", "",
             "| model | " + " | ".join(f"Δ @ {n}" for n in lengths[1:]) + " |", "|---|" + "---|" * len(lengths[1:])]
    for name, s in summary.items():
        lines.append(f"| {describe(name)} | " + " | ".join(_cell(s["degradation"].get(str(n)), False) for n in lengths[1:]) + " |")
    lines += _training_table(report)
    longest = str(lengths[-1])
    stretches = lengths[-1] // report["trained_lengths"][0]
    lines += ["", f"Loss by position at {longest} bytes: bits per byte of each {report['trained_lengths'][0]}-byte stretch "
              "(mean over windows and seeds); the first stretch is the trained range", "",
              "| model | " + " | ".join(str(k + 1) for k in range(stretches)) + " |", "|---|" + "---|" * stretches]
    for name in summary:
        rows = [r["eval"].get(longest) for r in runs[name].values()]
        if any(r is None or "by_position" not in r for r in rows):
            continue
        mean = [sum(_as_float(r["by_position"][k]) for r in rows) / len(rows) for k in range(stretches)]
        lines.append(f"| {describe(name)} | " + " | ".join(f"{v:.2f}" for v in mean) + " |")
    second = summarize_runs(report, "eval_second")
    if second:
        lines += ["", "Second corpus (" + str(report["config"].get("second_corpus")) + "), bits per byte", "",
                  "| model | " + " | ".join(f"bpb @ {n}" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for name, s in second.items():
            lines.append(f"| {describe(name)} | " + " | ".join(_cell(s["eval"].get(str(n)), False) for n in lengths) + " |")
    buckets = [(n, r["t5_buckets"]) for n, seeds in runs.items() for r in seeds.values() if "t5_buckets" in r]
    if buckets:
        lines += ["", "T5 buckets after training (mean |value| over heads and seeds)", "",
                  "| model | far bucket trained? | mean abs, trained buckets | mean abs, far bucket |", "|---|---|---|---|"]
        for name in dict(buckets):
            own = [b for n, b in buckets if n == name]
            lines.append(f"| {describe(name)} | {'yes' if own[0]['far_bucket_trained'] else 'no'} | "
                         f"{sum(b['trained_mean_abs'] for b in own) / len(own):.4f} | {sum(b['far_bucket_mean_abs'] for b in own) / len(own):.4f} |")
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
        f"{what}. Mean ± standard deviation over {len(config['seeds'])} seeds ({seeds})"
        + (f", (k/n): seeds reaching {SUCCESS:.0%}" if percent else "") + "; the evaluation's own "
        f"standard error per cell is at most {max(ses) * (100 if percent else 1):.3f}." if ses else "",
        _budget(config) + f" (width {config['dim']}, {config['layers']} layers, "
        f"{config['heads']} heads, " + (f"learning rate chosen per model from {', '.join(f'{v:g}' for v in config['lrs'])}"
                                         if len(config.get("lrs") or ()) > 1 else f"learning rate {config['lr']}")
        + f"); relpos {env['relpos']}, torch {env['torch']}, "
        f"{env['machine']}, {env['threads']} threads"
        + (f"; {report['wall_seconds'] / 60:.1f} min wall clock." if "wall_seconds" in report else "."),
    ]
    if percent and report["trained_lengths"] and any(n > max(report["trained_lengths"]) for n in lengths):
        lines += _learned_table(report)
    if "windows" not in report and any("curve" in r for seeds in report["runs"].values() for r in seeds.values()):
        lines += _training_table(report)
    if "windows" in report:
        lines += _text_tables(report)
        family = report.get("comparisons", {})
        for length, measure in ((lengths[0], "bits_per_byte"), (lengths[-1], "bits_per_byte"), (lengths[-1], "degradation")):
            rows = _differences(report, length, measure)
            if rows:
                lines += ["", f"Neighbours in the ranking at {unit}{length} ({measure.replace('_', ' ')}): paired bootstrap over "
                              f"held-out files and seeds, 95% interval; p adjusted by {family.get('correction')}",
                          "", "| pair | difference [95% interval] | p (Holm) | verdict |", "|---|---|---|---|", *rows]
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
    from .._plotting import category_colours, pyplot

    plt = pyplot(required=False)
    if plt is None:
        print("matplotlib is not installed: no plot (pip install 'relpos[plot]')")
        return None
    percent = report["metric"] == "accuracy"
    names = list(report["summary"])
    trained = [n for n in names if not n.startswith("rope + ")]
    scaled = [n for n in names if n.startswith("rope + ")]
    colours = dict(zip(trained + scaled, category_colours(len(trained + scaled))))  # every model its own colour
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


def reciprocal_ranks(scores: dict[str, float]) -> dict[str, float]:
    """1 / rank, higher score first; tied models share the better rank.

    >>> reciprocal_ranks({"a": 0.9, "b": 0.5, "c": 0.9})
    {'a': 1.0, 'b': 0.3333333333333333, 'c': 1.0}
    """
    return {n: 1.0 / (1 + sum(other > s for other in scores.values())) for n, s in scores.items()}


def _beyond_per_seed(report: dict, name: str) -> list[float]:
    """Each seed's mean accuracy over the lengths past training (n/a counts as 0)."""
    trained = max(report["trained_lengths"], default=0)
    seeds = sorted(report["runs"][name], key=int)
    past = [n for n in report["lengths"] if n > trained]
    per_seed = []
    for seed in seeds:
        cells = [report["runs"][name][seed]["eval"].get(str(n)) for n in past]
        per_seed.append(sum(0.0 if c is None else _as_float(c["accuracy"]) for c in cells) / max(1, len(cells)))
    return per_seed


def _mrr(per_task: dict[str, dict[str, float]], names: list[str]) -> tuple[dict, list[str]]:
    ranks = {t: reciprocal_ranks({n: scores[n] for n in names if n in scores}) for t, scores in per_task.items()}
    counted = [t for t, scores in per_task.items() if len({scores[n] for n in names if n in scores}) > 1]
    mrr = {n: sum(ranks[t][n] for t in counted) / len(counted) if counted else None for n in names}
    return mrr, counted


def ranking(reports: dict[str, dict], models: list[str] | None = None, *, resamples: int = 1000) -> dict:
    """Per task, accuracy past the training lengths and its reciprocal rank; the mean over tasks,
    with a 95% bootstrap interval (seeds resampled with replacement, the same seeds for every
    model and task: the models share their seeds' data order and initial weights).

    A task on which every model scores the same (all 0, say) ranks nothing: it is listed under
    ``uninformative`` and left out of the mean, rather than giving every model rank 1.
    """
    names = models or [n for n in next(iter(reports.values()))["summary"]]
    per_seed = {t: {n: _beyond_per_seed(r, n) for n in names if n in r["summary"]} for t, r in reports.items()}
    scores = {t: {n: sum(v) / len(v) for n, v in per.items()} for t, per in per_seed.items()}
    mrr, counted = _mrr(scores, names)
    per_task = {t: {"accuracy": scores[t], "reciprocal_rank": reciprocal_ranks(scores[t]),
                    "per_seed": per_seed[t]} for t in reports}
    seeds = min(len(v) for per in per_seed.values() for v in per.values())
    draws = {n: [] for n in names}
    g = torch.Generator().manual_seed(0)
    for _ in range(resamples if seeds > 1 else 0):
        pick = torch.randint(0, seeds, (seeds,), generator=g).tolist()
        sample = {t: {n: sum(v[i] for i in pick) / seeds for n, v in per.items()} for t, per in per_seed.items()}
        for n, value in _mrr(sample, names)[0].items():
            if value is not None:
                draws[n].append(value)
    interval = {}
    for n, values in draws.items():
        if values:
            low, high = torch.quantile(torch.tensor(values, dtype=torch.float64), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
            interval[n] = [low, high]
    return {"tasks": per_task, "mrr": mrr, "mrr_ci95": interval, "uninformative": [t for t in reports if t not in counted]}


def learned_seeds(report: dict) -> dict[str, dict]:
    """Accuracy past training at matched in-distribution quality: per model, the seeds that reach
    :data:`SUCCESS` at the longest trained length, and their mean accuracy at every longer length
    (``{model: {"seeds": [...], "accuracy": {length: mean | None}}}``; no such seed: empty ``seeds``)."""
    trained = str(max(report["trained_lengths"]))
    past = [n for n in report["lengths"] if n > int(trained)]
    out = {}
    for name, seeds in report["runs"].items():
        good = [k for k, r in seeds.items() if (r["eval"].get(trained) or {}).get("accuracy", 0) >= SUCCESS]
        accuracy = {}
        for n in past:
            cells = [seeds[k]["eval"].get(str(n)) for k in good]
            accuracy[str(n)] = None if not good or any(c is None for c in cells) else sum(_as_float(c["accuracy"]) for c in cells) / len(good)
        out[name] = {"seeds": sorted(good, key=int), "accuracy": accuracy}
    return out


def _learned_table(report: dict) -> list[str]:
    trained = max(report["trained_lengths"])
    past = [n for n in report["lengths"] if n > trained]
    lines = ["", f"At matched in-distribution quality: the seeds that reach {SUCCESS:.0%} at n = {trained} (the longest "
                 "trained length) and their mean accuracy (%) past it", "",
             "| model | seeds | " + " | ".join(f"n = {n}" for n in past) + " |", "|---|---|" + "---|" * len(past)]
    for name, row in learned_seeds(report).items():
        cells = [("n/a" if row["seeds"] else "") if v is None else f"{100 * v:.1f}" for v in row["accuracy"].values()]
        total = len(report["runs"][name])
        lines.append(f"| {describe(name)} | {len(row['seeds'])}/{total} | " + " | ".join(cells) + " |")
    return lines


def ranking_markdown(reports: dict[str, dict]) -> str:
    """Accuracy past training per task, mean reciprocal rank over all models and over Kazemnejad et al.'s five."""
    everyone = ranking(reports)
    five = ranking(reports, [n for n in KAZEMNEJAD_MRR if all(n in r["summary"] for r in reports.values())])
    tasks = list(reports)
    lines = ["| model | " + " | ".join(f"{t} (past training; seeds ≥ {SUCCESS:.0%} at the first longer n)" for t in tasks)
             + " | MRR, all models [95% bootstrap] | MRR, the paper's five | paper's MRR |",
             "|---|" + "---|" * (len(tasks) + 3)]
    number = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731

    def successes(task: str, name: str) -> str:
        report = reports[task]
        past = [n for n in report["lengths"] if n > max(report["trained_lengths"], default=0)]
        cell = report["summary"][name]["eval"].get(str(past[0])) if past else None
        return "n/a" if cell is None else f"{cell.get('successes', 0)}/{cell['n']}"

    def interval(name: str) -> str:
        ci = everyone["mrr_ci95"].get(name)
        return "" if ci is None else f" [{ci[0]:.2f}, {ci[1]:.2f}]"

    for name in sorted(everyone["mrr"], key=lambda n: -(everyone["mrr"][n] or 0)):
        accs = " | ".join(f"{100 * everyone['tasks'][t]['accuracy'][name]:.1f}% ({successes(t, name)})" for t in tasks)
        paper = f"{KAZEMNEJAD_MRR[name]:.2f}" if name in KAZEMNEJAD_MRR else ""
        lines.append(f"| {describe(name)} | {accs} | {number(everyone['mrr'][name])}{interval(name)} | "
                     f"{number(five['mrr'].get(name))} | {paper} |")
    if everyone["uninformative"]:
        lines += ["", f"Left out of the MRR: {', '.join(everyone['uninformative'])} (every model scores the same there)."]
    return "\n".join(lines)
