"""The house: every import inside relpos runs down the layers, never back up.

    base        _checks, _io, _progress, _cli, _plotting, _measure, _reuse, _process    (helpers every wing shares)
    core        relative offsets and the bias interface
    backends    relpos.attention and its kernels
    encodings   one module per encoding (attention-level ones, Shaw and CoPE, call the backends)
    layers      nn.Modules on relpos attention
    registry    one record per encoding
    hf, distributed, experiment     integrations and the experiment, side by side
    tools       the command line, plots, explore page, benchmarks (may use any wing)

Read from the source with ``ast`` (imports inside functions included), so a lazy import cannot hide an
upward edge.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "relpos"
BASE = {"_checks", "_io", "_progress", "_cli", "_plotting", "_measure", "_reuse", "_process", "__init__"}
#: the wings each wing may import from (besides itself and the base)
ALLOWED = {
    "base": set(),
    "core": set(),
    "backends": {"core"},
    "encodings": {"core", "backends"},
    "layers": {"core", "backends", "encodings"},
    "registry": {"core", "backends", "encodings", "layers"},
    "hf": {"core", "backends", "encodings", "layers", "registry", "relpos"},
    "distributed": {"core", "backends", "encodings", "layers"},
    "experiment": {"core", "backends", "encodings", "layers", "registry", "relpos"},
    "tools": {"core", "backends", "encodings", "layers", "registry", "hf", "distributed", "experiment", "relpos"},
}


def wing(module: str) -> str:
    """``relpos.backends._fused`` -> ``backends``; the shared helpers -> ``base``; ``relpos`` itself -> ``relpos``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "relpos"
    name = parts[1]
    return "base" if name in BASE else name


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every relpos import in ``path``."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, target) for line, target in found if target == "relpos" or target.startswith("relpos.")]


def upward_imports(path: pathlib.Path) -> list[str]:
    mine = wing(module_name(path))
    if mine == "relpos":  # the package's __init__ gathers every public name
        return []
    allowed = ALLOWED[mine] | {mine, "base"}
    return [f"{path.relative_to(SRC.parent)}:{line} ({mine}) imports {target} ({wing(target)})"
            for line, target in imports(path) if wing(target) not in allowed]


def test_every_wing_is_known():
    wings = {wing(module_name(p)) for p in SRC.rglob("*.py")} - {"relpos"}
    assert wings == set(ALLOWED), f"add the new wing to ALLOWED (and to the picture above): {wings ^ set(ALLOWED)}"


def test_no_import_runs_back_up():
    problems = [problem for path in sorted(SRC.rglob("*.py")) for problem in upward_imports(path)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: a backend importing an encoding, even lazily inside a function, is reported."""
    fake = tmp_path / "relpos" / "backends" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..encodings.t5 import RelativePositionalBias\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path / "relpos")
    assert upward_imports(fake) == ["relpos/backends/fake.py:2 (backends) imports relpos.encodings.t5 (encodings)"]


def test_no_script_is_named_like_a_standard_module():
    """A script runs with its folder first on sys.path, and inductor hands that path to its subprocesses: a
    benchmarks/encodings.py shadowed Python's ``encodings`` there, its CPU-ISA probe failed, and compiling on
    the CPU broke (CppCompileError) in any process that had put benchmarks/ on sys.path."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = [p for folder in ("benchmarks", "tools", "examples") for p in (root / folder).glob("*.py")]
    assert scripts
    assert not [str(p) for p in scripts if p.stem in sys.stdlib_module_names]
