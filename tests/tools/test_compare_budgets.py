"""tools/compare_budgets.py: the change of each model's degradation between two budgets, on a known case."""

import importlib.util
import json
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parents[2] / "tools" / "compare_budgets.py"
_spec = importlib.util.spec_from_file_location("compare_budgets", _PATH)
budgets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budgets)

# two held-out files: three windows at 64 bytes (a, a, b), two at 1024 (a, b)
_WINDOWS = {"main": {"window_file": {"64": ["a", "a", "b"], "1024": ["a", "b"]}}}


def _run(first: list[float], last: list[float] | None, gain: float = 0.005) -> dict:
    """One seed's result: per-file means at 64 and 1024 (None: past a learned table)."""
    cell = lambda means: {"bits_per_byte": sum(means) / len(means), "file_means": means}  # noqa: E731
    return {"eval": {"64": cell(first), "1024": None if last is None else cell(last)}, "lr": 0.01,
            "plateau": {"reached": gain < 0.01, "gain": gain}}


def _report(runs: dict, max_steps: int) -> dict:
    return {"windows": _WINDOWS, "lengths": [64, 1024], "config": {"max_steps": max_steps, "steps": 1000},
            "runs": {name: {"0": run} for name, run in runs.items()}}


def test_the_change_of_the_degradation_is_paired_file_by_file():
    short = _report({"alibi": _run([2.0, 2.2], [2.1, 2.1]), "learned": _run([2.0, 2.0], None)}, 3000)
    # alibi: every file grows by 0.3 more than at the short budget (a: 0.1 -> 0.4, b: -0.1 -> 0.2)
    long = _report({"alibi": _run([1.8, 2.0], [2.2, 2.2], gain=0.02), "learned": _run([1.9, 1.9], None)}, 9000)
    rows = {r["model"]: r for r in budgets.compare(short, long, 0)}
    change = rows["alibi"]["change"]
    assert change["mean"] == pytest.approx(0.3) and change["low"] == pytest.approx(0.3) and change["high"] == pytest.approx(0.3)
    assert rows["learned"]["change"] is None and rows["learned"]["long"] == (1.9, None)
    table = budgets.markdown(list(rows.values()), short, long)
    assert "3,600 steps" in table and "10,800 steps" in table  # constant rate + cool-down
    assert "| +0.300 [+0.300, +0.300]" in table and "not held (2.00%)" in table


def test_different_windows_or_no_shared_seed_are_refused():
    short = _report({"alibi": _run([2.0, 2.2], [2.1, 2.1])}, 3000)
    other = json.loads(json.dumps(short))
    other["windows"]["main"]["window_file"]["1024"] = ["b", "a"]
    with pytest.raises(ValueError, match="different held-out windows"):
        budgets.compare(short, other, 0)
    with pytest.raises(ValueError, match="seed=1"):
        budgets.compare(short, short, 1)


def test_main_prints_and_writes_the_table(tmp_path, capsys):
    for name, steps in (("short", 3000), ("long", 9000)):
        (tmp_path / name).mkdir()
        report = _report({"t5": _run([2.0, 2.2], [2.1, 2.3])}, steps)
        (tmp_path / name / "results.json").write_text(json.dumps(report))
    assert budgets.main([str(tmp_path / "short"), str(tmp_path / "long"), "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == capsys.readouterr().out
    with pytest.raises(ValueError, match="no results.json"):
        budgets.main([str(tmp_path), str(tmp_path / "long")])
