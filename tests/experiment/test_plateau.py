"""Training to a plateau (``max_steps``): the schedule, where the constant rate stops, the cap, the
sweep's runs as the first steps of the chosen run, and resume inside each stage."""

import math

import pytest

from relpos.experiment import cli
from relpos.experiment import runner as ex
from relpos.experiment.problems import TextProblem


def _config(out, **changes):
    return ex.RunConfig(**{**ex.PRESETS["smoke"], "out": str(out), "progress": False, "plot": False,
                           "encodings": ("alibi",), "rope_scalings": (), "eval_every": 4, "steps": 8,
                           "max_steps": 40, "seeds": (0,), **changes})


def test_schedule_warms_up_holds_then_cools_down_linearly():
    config = ex.RunConfig(steps=100, max_steps=1000, lr=1.0)
    warm = [ex._lr_at(s, config) for s in range(5)]
    assert warm == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # warm-up over steps // 20
    assert [ex._lr_at(s, config) for s in (5, 100, 999)] == [1.0, 1.0, 1.0]  # constant while the plateau is looked for
    end = 300
    cool = ex.cooldown_steps(end)
    assert cool == 60  # 20% of the steps done
    assert [ex._lr_at(s, config, stable_end=end) for s in (299, 300, 330, 359)] == pytest.approx([1.0, 1.0, 0.5, 1 / 60])
    fixed = ex.RunConfig(steps=100, lr=1.0)  # max_steps = 0: the fixed budget's cosine, unchanged
    assert ex._lr_at(5, fixed) == pytest.approx(1.0) and ex._lr_at(99, fixed) == pytest.approx(0.1, abs=1e-3)


def _scripted(monkeypatch, values):
    """Validation losses in the order they are asked for (a learning curve chosen by the test)."""
    calls = iter(values)
    monkeypatch.setattr(TextProblem, "validate", lambda self, model: next(calls))
    monkeypatch.setattr(ex, "estimate", lambda *a: {"seconds": 0.0, "models": {}})  # it would take a value


def test_the_constant_rate_stops_at_the_first_point_where_the_rule_holds(tmp_path, monkeypatch):
    # points at steps 0, 4, 8, 12, 16: the rule (gain < 1% since the point at 80% of the steps) first holds
    # at 16 (2.0 at 12 and at 16); at 8 and 12 it does not (5.0 -> 3.0, 3.0 -> 2.0); then 4 steps of cool-down
    _scripted(monkeypatch, [10.0, 5.0, 3.0, 2.0, 2.0, 1.9, 1.8])
    run = ex.run(_config(tmp_path))["runs"]["alibi"]["0"]
    assert run["stable_end"] == 16 and run["steps"] == 16 + math.ceil(0.2 * 16) == 20
    assert run["plateau"]["reached"] is True and run["capped"] is False
    assert [s for s, _ in run["curve"]] == [0, 4, 8, 12, 16, 20]
    assert run["cooldown_gain"] == pytest.approx((2.0 - 1.9) / 2.0)


def test_no_plateau_before_the_minimum_steps(tmp_path, monkeypatch):
    _scripted(monkeypatch, [10.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])  # flat from step 4: still trains to `steps`
    run = ex.run(_config(tmp_path, steps=12))["runs"]["alibi"]["0"]
    assert run["stable_end"] == 12 and run["steps"] == 12 + 3


def test_a_run_that_keeps_gaining_is_capped_and_says_so(tmp_path, monkeypatch):
    _scripted(monkeypatch, [10.0 * 0.9**k for k in range(20)])  # 10% better at every point: never a plateau
    run = ex.run(_config(tmp_path, max_steps=24))["runs"]["alibi"]["0"]
    assert run["stable_end"] == 24 and run["capped"] is True and run["plateau"]["reached"] is False
    assert run["steps"] == 24 + math.ceil(0.2 * 24)
    assert "capped" in ex.markdown_report(ex.run(_config(tmp_path, max_steps=24, resume=True)))


def test_sweep_runs_are_the_first_steps_of_the_chosen_run(tmp_path):
    report = ex.run(_config(tmp_path, lrs=(1e-3, 3e-3), seeds=(0, 1)))
    chosen = f"{report['chosen_lr']['alibi']:g}"
    sweep = report["sweep"]["alibi"][chosen]
    assert [s for s, _ in sweep["curve"]] == [0, 4, 8]  # the sweep stops after `steps` of the constant rate
    first = report["runs"]["alibi"]["0"]
    assert [list(c) for c in first["curve"][:3]] == [list(c) for c in sweep["curve"]]  # continued, not retrained
    assert first["steps"] > 8 and first["steps"] == first["stable_end"] + ex.cooldown_steps(first["stable_end"])


@pytest.mark.parametrize("stage", ["constant", "cooldown"])
def test_resume_inside_each_stage_gives_the_straight_run(tmp_path, monkeypatch, stage):
    straight = ex.run(_config(tmp_path / "a", encodings=("alibi", "rope"), seeds=(0, 1)))
    real = ex.train_steps

    def crash(model, optimizer, problem, config, seed, start, stop, **kw):
        in_stage = (kw.get("stable_end") is not None) == (stage == "cooldown")
        if seed == 1 and in_stage and stop - start > 1:  # dies two steps into that stage of seed 1
            real(model, optimizer, problem, config, seed, start, start + 2, **kw)
            raise KeyboardInterrupt("simulated crash")
        return real(model, optimizer, problem, config, seed, start, stop, **kw)

    monkeypatch.setattr(ex, "train_steps", crash)
    with pytest.raises(KeyboardInterrupt):
        ex.run(_config(tmp_path / "b", encodings=("alibi", "rope"), seeds=(0, 1), checkpoint_every=1))
    monkeypatch.setattr(ex, "train_steps", real)
    resumed = ex.run(_config(tmp_path / "b", encodings=("alibi", "rope"), seeds=(0, 1), checkpoint_every=1, resume=True))
    for name in ("alibi", "rope"):
        for seed in ("0", "1"):
            a, b = straight["runs"][name][seed], resumed["runs"][name][seed]
            assert (a["stable_end"], a["steps"]) == (b["stable_end"], b["steps"])
            assert [s for s, _ in a["curve"]] == [s for s, _ in b["curve"]]
            for n, cell in a["eval"].items():
                assert b["eval"][n]["bits_per_byte"] == pytest.approx(cell["bits_per_byte"], abs=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "4", "--steps", "8", "--eval-every", "4"], "--max-steps must be 0"),
    (["--max-steps", "40", "--eval-every", "0"], "give --eval-every > 0"),
    (["--max-steps", "-1"], "--max-steps must be 0"),
])
def test_bad_plateau_options_are_refused_before_any_work(tmp_path, argv, message):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--preset", "smoke", "--out", str(tmp_path / "never"), *argv])
    with pytest.raises(ValueError, match=message):
        cli.config_from_args(args)
    assert not (tmp_path / "never").exists()


def test_the_reference_preset_trains_to_a_plateau_with_a_bracketing_sweep():
    preset = ex.PRESETS["reference"]
    assert preset["max_steps"] > preset["steps"] and preset["eval_every"] > 0
    assert min(preset["lrs"]) < preset["lr"] < max(preset["lrs"])  # the previous grid's best (1e-2) is inside


def test_resume_reads_a_run_saved_before_the_plateau_options_existed(tmp_path):
    """A results.json without ``max_steps`` / ``val_windows`` was a fixed-budget run with the defaults:
    resuming it with those defaults adds to it; asking for a plateau is refused (another training)."""
    import json

    config = _config(tmp_path, max_steps=0, eval_every=0)
    ex.run(config)
    path = tmp_path / "results.json"
    saved = json.loads(path.read_text())
    for key in ("max_steps", "val_windows"):
        del saved["config"][key]
    path.write_text(json.dumps(saved))
    again = ex.run(_config(tmp_path, max_steps=0, eval_every=0, resume=True, encodings=("alibi", "rope")))
    assert again["runs"]["alibi"]["0"]["train_seconds"] == saved["runs"]["alibi"]["0"]["train_seconds"]  # reused
    assert "rope" in again["runs"]  # and the added model trained
    with pytest.raises(ValueError, match="max_steps"):
        ex.run(_config(tmp_path, max_steps=40, eval_every=0, resume=True))


def test_accuracy_past_training_among_the_seeds_that_learned_the_trained_lengths():
    from relpos.experiment.report import learned_seeds

    def run(at8, at10):
        return {"eval": {"8": {"accuracy": at8}, "10": {"accuracy": at10}}}

    report = {"trained_lengths": [4, 8], "lengths": [4, 8, 10],
              "runs": {"a": {"0": run(0.95, 0.5), "1": run(0.5, 0.0), "2": run(0.9, 0.3)},  # seeds 0 and 2 learned n = 8
                       "b": {"0": run(0.2, 0.0)},
                       "c": {"0": {"eval": {"8": {"accuracy": 1.0}, "10": None}}}}}  # past its table
    rows = learned_seeds(report)
    assert rows["a"] == {"seeds": ["0", "2"], "accuracy": {"10": pytest.approx(0.4)}}
    assert rows["b"] == {"seeds": [], "accuracy": {"10": None}}
    assert rows["c"] == {"seeds": ["0"], "accuracy": {"10": None}}


def test_plateau_from_delays_the_rule_and_equal_to_max_steps_is_a_fixed_budget(tmp_path, monkeypatch):
    flat = [10.0, 5.0] + [2.0] * 30  # flat from step 4: the rule holds at every point from 8 on
    _scripted(monkeypatch, flat)
    run = ex.run(_config(tmp_path / "a", plateau_from=20))["runs"]["alibi"]["0"]
    assert run["stable_end"] == 20 and run["capped"] is False  # not before step 20
    _scripted(monkeypatch, flat)
    run = ex.run(_config(tmp_path / "b", plateau_from=24, max_steps=24))["runs"]["alibi"]["0"]
    assert run["stable_end"] == 24 and run["plateau"]["reached"] is True  # the budget, and the rule reported
    assert run["steps"] == 24 + ex.cooldown_steps(24)


def test_plateau_from_is_validated(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for argv in (["--plateau-from", "50", "--max-steps", "40", "--eval-every", "4"], ["--plateau-from", "8"]):
        args = parser.parse_args(["--preset", "smoke", "--out", str(tmp_path / "never"), *argv])
        with pytest.raises(ValueError, match="--plateau-from must be between 0 and --max-steps"):
            cli.config_from_args(args)


# --- each model's rate from an earlier run (--lr-from) ---------------------------------------


def test_lr_from_trains_each_model_at_the_rate_an_earlier_run_chose(tmp_path):
    """The reference run's choice, reused for a longer run: no sweep, each model at its own rate, and a
    model the earlier run did not train is refused before any work."""
    first = ex.run(ex.RunConfig(**{**ex.PRESETS["smoke"], "encodings": ("alibi", "none"), "lrs": (1e-3, 3e-2), "steps": 4,
                                   "out": str(tmp_path / "sweep"), "plot": False, "progress": False}))
    chosen = first["chosen_lr"]
    later = ex.run(ex.RunConfig(**{**ex.PRESETS["smoke"], "encodings": ("alibi", "none"), "steps": 4, "plot": False,
                                   "lr_from": str(tmp_path / "sweep" / "results.json"), "out": str(tmp_path / "later"),
                                   "progress": False}))
    assert later["chosen_lr"] == chosen and later["sweep"] == {}
    assert {n: later["runs"][n]["0"]["lr"] for n in chosen} == chosen
    with pytest.raises(ValueError, match=r"lr_from=.* has no learning rate for t5 \(it has alibi, none\)"):
        ex.run(ex.RunConfig(**{**ex.PRESETS["smoke"], "encodings": ("t5",), "lr_from": str(tmp_path / "sweep" / "results.json"),
                               "out": str(tmp_path / "refused"), "progress": False}))
    assert not (tmp_path / "refused" / "results.json").exists()
    with pytest.raises(ValueError, match=r"lr_from=.* must be a results.json"):
        ex.run(ex.RunConfig(**{**ex.PRESETS["smoke"], "lr_from": str(tmp_path / "missing.json"), "out": str(tmp_path / "x"),
                               "progress": False}))
    with pytest.raises(ValueError, match=r"lr_from=.* and lrs=.* both set"):
        ex.RunConfig(lr_from="results.json", lrs=(1e-3,))
