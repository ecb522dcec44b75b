"""`relpos buckets`: terminal table and JSON, both from relpos's own bucket function."""

import json
import subprocess
import sys

import pytest
import torch

from relpos import relative_position_bucket
from relpos.tools.cli import main


def run_json(capsys, *args):
    assert main(["buckets", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("strategy", ["log", "linear", "uniform", "quadratic"])
@pytest.mark.parametrize("causal", [False, True])
def test_json_ranges_agree_with_bucket_function(capsys, strategy, causal):
    args = ["--num-buckets", "16", "--max-distance", "40", "--strategy", strategy] + (["--causal"] if causal else [])
    payload = run_json(capsys, *args)
    assert payload["bidirectional"] is (not causal) and payload["strategy"] == strategy
    rel = torch.arange(-60, 61)
    buckets = relative_position_bucket(rel, bidirectional=not causal, num_buckets=16, max_distance=40, strategy=strategy)
    for row in payload["buckets"]:
        low = -60 if row["low"] is None else row["low"]
        high = 60 if row["high"] is None else row["high"]
        inside = (rel >= low) & (rel <= high)
        assert torch.all(buckets[inside] == row["bucket"])
        assert torch.all(buckets[~inside] != row["bucket"])
    used = {row["bucket"] for row in payload["buckets"]}
    assert used | set(payload["unused_buckets"]) == set(range(16))


def test_default_table(capsys):
    assert main(["buckets"]) == 0
    out = capsys.readouterr().out
    assert "num_buckets=32 max_distance=128 bidirectional" in out
    assert "exact for |distance| < 8" in out
    assert "    24  8 .. 11" in out and "    31  91 .. +inf" in out and "    15  -inf .. -91" in out
    assert "unused buckets (no distance maps there): [16]" in out


def test_bad_values_exit_2_with_message(capsys):
    with pytest.raises(SystemExit) as info:
        main(["buckets", "--num-buckets", "31"])
    assert info.value.code == 2
    assert "num_buckets must be even" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "relpos.tools.cli", "buckets", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["max_exact"] == 8


def test_every_option_has_help():
    import argparse

    from relpos.tools.cli import build_parser

    parser = build_parser()
    missing = []
    for action in parser._subparsers._group_actions:
        for name, sub in action.choices.items():
            for a in sub._actions:
                if not isinstance(a, argparse._HelpAction) and not a.help:
                    missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, missing


def test_cli_edge_values_and_output_folders(tmp_path, capsys):
    from relpos.tools.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "bias", "--length", "0", "-o", str(tmp_path / "b.png")])
    assert exit_info.value.code == 2 and "length must be positive, got 0" in capsys.readouterr().err
    assert main(["plot", "buckets", "--length", "8", "-o", str(tmp_path / "new" / "folder" / "b.png")]) == 0
    assert (tmp_path / "new" / "folder" / "b.png").stat().st_size > 1000  # missing folders are created
    assert main(["buckets", "--strategy", "uniform"]) == 0
    assert "no exact region" in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "buckets", "-o", str(blocker / "b.png")])  # a file where a folder should be
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error" in err and "Traceback" not in err


def _subcommands() -> dict:
    """Every subcommand's parser: the ``relpos`` console script's, ``python -m relpos.experiment``'s
    (through its main, which builds its own parser) and ``relpos bench``'s standalone one."""
    import argparse

    from relpos.tools.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"buckets", "plot", "explore", "extrapolate", "tasks", "bench"}
    return commands


def _option_help(parser, action) -> str:
    """An option's help as printed, before wrapping (so a default is never split across lines)."""
    return parser._get_formatter()._expand_help(action) if action.help else ""


def _missing_defaults(parser) -> list[str]:
    """The options whose printed help does not give their default: a value, or in words what leaving
    the option out does (``None``); flags (off unless given), required options and positionals need none."""
    import argparse

    missing = []
    for action in parser._actions:
        default = action.default
        if (isinstance(action, argparse._HelpAction) or not action.option_strings or action.required
                or default is False):
            continue
        text = _option_help(parser, action)
        shown = {f"default: {default}"} | ({f"default: {default:g}"} if isinstance(default, float) else set())
        if "default" not in text or (default is not None and not any(s in text for s in shown)):
            missing.append(f"{action.option_strings[-1]}: {text!r}")
    return missing


@pytest.mark.parametrize("command", ["buckets", "plot", "explore", "extrapolate", "tasks", "bench"])
def test_every_subcommand_help_describes_it_and_gives_every_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    parser = _subcommands()[command]
    assert parser.prog == f"relpos {command}"
    assert parser.description and len(parser.description.split()) >= 25  # a paragraph, not a title
    assert _missing_defaults(parser) == []
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert info.value.code == 0 and " ".join(parser.description.split()) in out
    assert "default: None" not in out


@pytest.mark.parametrize("argv,prog", [([], "relpos extrapolate"), (["tasks"], "relpos tasks")])
def test_python_m_experiment_help_matches_the_subcommand(argv, prog, capsys):
    from relpos.experiment import cli as experiment

    with pytest.raises(SystemExit) as info:
        experiment.main([*argv, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    command = _subcommands()[prog.split()[1]]
    assert info.value.code == 0 and out.startswith(f"usage: {prog} ")
    assert " ".join(command.description.split()) in out and "default: None" not in out
    for action in command._actions:
        if action.help and "default" in action.help:  # the same help, defaults and all
            assert " ".join(_option_help(command, action).split()) in out


def test_bench_standalone_help_gives_every_default(capsys):
    from relpos.tools import bench

    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0 and " ".join(bench.DESCRIPTION.split()) in out
    assert "(default: 512,1024,2048,4096,8192)" in out and "(default: cpu)" in out and "default: None" not in out


@pytest.mark.parametrize("command", ["buckets", "plot", "explore", "extrapolate", "tasks", "bench"])
def test_a_misspelled_option_reports_the_subcommands_usage(command, capsys):
    argv = [command, "bias", "-o", "never-written.png", "--misspelled"] if command == "plot" else [command, "--misspelled"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(f"usage: relpos {command} ")
    assert f"relpos {command}: error: unrecognized arguments: --misspelled" in err


def test_a_misspelled_option_before_the_subcommand_reports_the_top_level_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--misspelled", "buckets"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: relpos ") and not err.startswith("usage: relpos buckets")
    assert "relpos: error: unrecognized arguments: --misspelled" in err


@pytest.mark.parametrize("argv,prog", [(["--misspelled"], "relpos extrapolate"), (["tasks", "--misspelled"], "relpos tasks")])
def test_python_m_experiment_misspelled_option(argv, prog, capsys):
    from relpos.experiment import cli as experiment

    with pytest.raises(SystemExit) as info:
        experiment.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"usage: {prog} ")
    assert f"{prog}: error: unrecognized arguments: --misspelled" in err


def test_default_output_folders_are_git_ignored_and_documented():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    defaults = {}
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if action.dest in ("out", "output") and action.default is not None:
                defaults[f"relpos {name} {action.option_strings[-1]}"] = (action.default, _option_help(parser, action))
    assert len(defaults) >= 2  # extrapolate and tasks write into ./relpos-extrapolate, ./relpos-tasks
    for command, (folder, text) in defaults.items():
        assert f"default: {folder}, in the current directory" in text, command
        for path in (f"{folder}/", f"{folder}/results.json", f"examples/{folder}/copy/results.json"):
            ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=root)
            assert ignored.returncode == 0, f"{command}: {path} is not in .gitignore"


def test_plot_buckets_refuses_max_distance_zero_instead_of_using_128(tmp_path, capsys):
    """0 is a value, not "the default": T5's bucketing refuses it (it was silently read as 128)."""
    with pytest.raises(SystemExit) as exc:
        main(["plot", "buckets", "--max-distance", "0", "-o", str(tmp_path / "b.png")])
    assert exc.value.code == 2
    assert "max_distance must be > the exact range" in capsys.readouterr().err
    assert not (tmp_path / "b.png").exists()
