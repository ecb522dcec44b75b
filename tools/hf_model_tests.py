"""transformers' own model tests with every model they build accelerated by relpos.hf.

    python tools/hf_model_tests.py ROOT --families t5,mt5 [--baseline] [--json out.json] [-k EXPR]

ROOT is a directory laid out like transformers' repository: ``tests/`` with the common mixins
(``test_modeling_common.py`` ... from transformers' sdist), ``tests/generation``, ``tests/utils``,
``tests/models/<family>/test_modeling_<family>.py`` (from transformers' repository history that runs
against the installed release), ``utils/test_module`` and ``src/transformers`` (a link to the installed
package). relpos does not ship transformers' code: docs/integrations/model-tests.md says how to assemble ROOT.

Every ``PreTrainedModel`` the tests build is passed to ``relpos.hf.accelerate`` at the end of its
``post_init`` (a pytest plugin: this file, loaded with ``-p hf_model_tests``; the patch lives in the
test process only). ``test_pipeline_*`` tests are deselected (they download models from the Hub).
``--baseline`` reruns the failures unaccelerated, so that a failure transformers has on its own is
told apart from one relpos causes. Prints pass/fail counts per family and every failure with the
first line of its message; ``--json`` writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

_ENV = "RELPOS_HF_ACCELERATE"
_MARKERS = ("torch_compile_test", "torch_export_test", "flash_attn_test", "flash_attn_3_test", "generate",
            "is_training_test", "is_tensor_parallel_test", "not_device_test", "slow", "training_ci")


# ---- the pytest plugin (runs inside the test process) ----

_accelerated: list[str] = []


def pytest_configure(config) -> None:
    for marker in _MARKERS:
        config.addinivalue_line("markers", marker)
    _stand_in_for_datasets()
    if os.environ.get(_ENV) == "1":
        _install()


def _stand_in_for_datasets() -> None:
    """UDOP's and Pop2Piano's test files import ``datasets`` at the top, for slow integration tests that download
    data (skipped here). Without ``datasets`` installed, a stand-in module lets the model tests run; calling it raises."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        import types

        def load_dataset(*args, **kwargs):
            raise RuntimeError("datasets is not installed (tools/hf_model_tests.py stands in for it): this test downloads data")

        sys.modules["datasets"] = types.SimpleNamespace(load_dataset=load_dataset, Audio=None, Dataset=None)


def _install() -> None:
    from transformers import PreTrainedModel

    import relpos.hf as rh

    original = PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        found = rh.find_family(self)
        if found is not None and found[1] and not rh.is_accelerated(self):
            rh.accelerate(self)  # an error here fails the test that built the model: it is reported
            _accelerated.append(type(self).__name__)

    PreTrainedModel.post_init = post_init


def pytest_runtest_setup(item) -> None:
    _accelerated.clear()


def pytest_runtest_teardown(item) -> None:
    item.user_properties.append(("accelerated", ",".join(sorted(set(_accelerated)))))


# ---- the runner ----


#: families whose test file is not tests/models/<family>/test_modeling_<family>.py
_FILES = {"donut_swin": ("donut", "test_modeling_donut_swin.py")}


def _test_file(root: pathlib.Path, family: str) -> pathlib.Path:
    folder, name = _FILES.get(family, (family, f"test_modeling_{family}.py"))
    path = root / "tests" / "models" / folder / name
    if not path.is_file():
        raise SystemExit(f"--families: {family!r} has no {path} (see docs/integrations/model-tests.md to assemble ROOT)")
    return path


def _run(root: pathlib.Path, family: str, accelerate: bool, expr: str | None, timeout: int,
         only: list[str] | None = None) -> dict[str, dict]:
    """Run one family's tests (``only``: these "Class::test" names); {name: {"outcome", "message", "accelerated"}}."""
    path = _test_file(root, family)
    targets = [f"{path}::{name}" for name in only] if only is not None else [str(path)]
    if only == []:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        junit = pathlib.Path(tmp) / "junit.xml"
        select = "not test_pipeline_" + (f" and ({expr})" if expr else "")
        cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider",
               "-p", "hf_model_tests", "-o", "addopts=", "-k", select, f"--junitxml={junit}",
               f"--timeout={timeout}", "-W", "ignore"]
        paths = [str(root / "utils"), str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **{_ENV: "1" if accelerate else "0"})
        subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not junit.exists():
            raise SystemExit(f"pytest wrote no report for {family}: run {' '.join(cmd)} in {root} to see why")
        return _parse(junit)


def _parse(junit: pathlib.Path) -> dict[str, dict]:
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (node.get("message") or node.text) else ""
                break
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        results[name] = {"outcome": outcome, "message": message, "accelerated": props.get("accelerated", "")}
    return results


def _summary(family: str, results: dict[str, dict], baseline: dict[str, dict] | None) -> list[str]:
    counts = {}
    for r in results.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    built = sum(1 for r in results.values() if r["accelerated"])
    lines = [f"## {family}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
             + f" ({built} tests built an accelerated model)"]
    for name, r in sorted(results.items()):
        if r["outcome"] in ("failed", "error"):
            also = ""
            if baseline is not None:
                plain = baseline.get(name, {}).get("outcome")
                also = " [fails unaccelerated too]" if plain in ("failed", "error") else f" [unaccelerated: {plain}]"
            lines.append(f"- {name}{also}: {r['message']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=pathlib.Path, help="a directory laid out like transformers' repository")
    parser.add_argument("--families", default="t5", help="comma-separated tests/models/<family> names")
    parser.add_argument("--baseline", action="store_true",
                        help="rerun the failures unaccelerated, to mark transformers' own failures")
    parser.add_argument("-k", dest="expr", default=None, help="a pytest -k expression to narrow the tests")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write every result here")
    args = parser.parse_args(argv)
    if not (args.root / "tests" / "test_modeling_common.py").is_file():
        raise SystemExit(f"root: {args.root} has no tests/test_modeling_common.py (see docs/integrations/model-tests.md)")
    report = {}
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        results = _run(args.root, family, True, args.expr, args.timeout)
        failed = [name for name, r in results.items() if r["outcome"] in ("failed", "error")]
        baseline = _run(args.root, family, False, args.expr, args.timeout, only=failed) if args.baseline else None
        report[family] = {"accelerated": results, "baseline": baseline}
        print("\n".join(_summary(family, results, baseline)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
