"""The documented command: examples/context_parallel_t5.py under torchrun on 2 processes equals one process.

docs/distributed.md's code runs under torchrun in tests/test_docs_code.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_example_matches_one_process():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "context_parallel_t5.py"), "--check", "--dtype", "float64", "--steps", "2", "--length", "128",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.findall(r"step \d+/2  loss \d+\.\d+", done.stdout) and "step 2/2" in done.stdout
    worst = float(re.search(r"largest difference from one process \(loss and every gradient\): (\S+)", done.stdout).group(1))
    assert worst < 1e-10


def test_ring_benchmark_runs_at_a_tiny_size(tmp_path):
    """benchmarks/ring.py end to end (2 spawned processes, every variant) at a size that takes seconds."""
    import json

    import importlib.util

    from relpos._io import generated_begin, generated_region

    out, page = tmp_path / "ring.json", tmp_path / "ring.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "ring.py"), "--lengths", "256", "--rounds", "1", "--heads", "2",
               "--dim", "8", "--floor", "--json", str(out), "--markdown", str(page)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads(out.read_text())
    summary = payload["summary"]
    assert [(s["length"], s["mode"]) for s in summary] == [(256, "forward"), (256, "training step")]
    assert all(s["ring_s"] > 0 and s["no_ring_s"] > 0 and s["ring_rank_peak_mib"] > 0 for s in summary)
    # the page is what tools/bench_tables.py renders from the JSON (the command, then the table of its samples)
    spec = importlib.util.spec_from_file_location("ring_benchmark", ROOT / "benchmarks" / "ring.py")
    ring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ring)
    assert generated_region(page.read_text(), generated_begin(out)) == ring.page(payload).rstrip("\n") + "\n"
    assert "--markdown" in payload["command"] and "| 256 | forward |" in page.read_text()
