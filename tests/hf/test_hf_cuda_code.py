"""tests/hf/test_hf_cuda.py's code on the CPU: the GPU model tests are sound before a lent GPU runs them.

CI has no GPU, and a GPU is lent for minutes: a GPU test with a stale input, a wrong config or a broken helper
would spend them on a traceback. ``RELPOS_GPU_TESTS_DEVICE=cpu`` runs the same tests with every model and input
on the CPU (the CPU routes, not CUDA's: what this checks is the tests' own code and that relpos equals
transformers on the same inputs). The compiled static-cache test is left out: ``generate()`` compiles only on CUDA.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_model_tests_pass_with_the_device_set_to_cpu():
    env = {**os.environ, "RELPOS_GPU_TESTS_DEVICE": "cpu"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/hf/test_hf_cuda.py",
                          "-k", "not compiled_static"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 50 and "skipped" not in run.stdout, run.stdout[-1000:]
