"""benchmarks/triton_host.py: the CPU time of a Triton-route call, measured without a GPU (launches compiled for
sm_90, stopped before the driver). Run in a subprocess: this process imported triton under ``TRITON_INTERPRET=1``
(tests/conftest.py), where kernels cannot be compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
CASES = ("T5 values (a later layer), forward", "T5 values, key mask (a later layer), forward")


def test_a_later_layer_costs_one_launch_and_a_handful_of_operators(tmp_path):
    """Each case launches the forward kernel once; a later layer dispatches a handful of torch operators (the kept
    key-mask terms included: a padded batch's later layer no more than an unpadded one's plus one), and the CPU
    time is measured per call."""
    out = tmp_path / "host.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_host.py"), "--rounds", "1", "--calls", "2",
                          "--cases", *CASES, "--json", str(out)], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(CASES)
    plain, padded = (rows[case] for case in CASES)
    assert plain["launches"] == padded["launches"] == 1
    assert plain["operators"] <= 6 and padded["operators"] <= plain["operators"] + 1, rows
    assert all(row["host_us"] > 0 for row in rows.values())
