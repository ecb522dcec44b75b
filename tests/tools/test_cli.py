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
