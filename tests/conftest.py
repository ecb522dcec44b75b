"""No silent skips in CI: under ``CI=true`` (set by CI and by .ci/run) a skipped test fails.

Only two kinds of test may skip there, each only when what it needs is missing:

* ``gpu``: needs a CUDA device, which CI does not have (tests/backends/test_cuda.py,
  tests/hf/test_hf_cuda.py and the flex training test);
* ``timm``: runs timm itself against relpos (tests/*/test_*_timm.py). timm imports torchvision,
  which has no build for the CPU torch CI installs; the tests beside them check the same
  computations against oracles written from timm's formulas, and these run where timm installs.

Locally (CI unset) a skip stays a skip, and pytest's summary lists it.
"""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels (relpos's backend="triton") can run on CPU tensors only under its interpreter, and triton reads
    # this when it first decorates a function: set before any test module imports triton (transformers' vision
    # modules do), or triton.language's own helpers stay compiled-mode and the interpreter refuses them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ci_env import in_ci

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest -n: the workers share the cores instead of each taking all
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; may skip under CI=true when there is none")
    config.addinivalue_line("markers", "timm: runs timm itself; may skip under CI=true where timm does not import")
    config.addinivalue_line(
        "markers",
        "newest_transformers: uses an API or internal of the newest supported transformers release that the oldest "
        "one lacks (the oldest-release run deselects it with -m 'not newest_transformers'; see docs/testing.md)",
    )


def timm_available() -> bool:
    if importlib.util.find_spec("timm") is None:
        return False
    try:
        import timm  # noqa: F401  (imports torchvision, which may not match the installed torch)
    except Exception:
        return False
    return True


def may_skip(item) -> bool:
    if item.get_closest_marker("gpu") is not None:
        return not torch.cuda.is_available()
    if item.get_closest_marker("timm") is not None:
        return not timm_available()
    return False


def _fail_skip(report, what: str) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{what} was skipped under CI=true ({reason}); only tests marked gpu or timm may skip in CI (no CUDA, no timm)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail") and not may_skip(item):
        _fail_skip(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped:  # a whole module skipped (pytest.importorskip of a test dependency)
        _fail_skip(report, collector.nodeid)
