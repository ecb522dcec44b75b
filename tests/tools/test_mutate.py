"""tools/mutate.py: every mutant still applies to the source it names (its old text occurs exactly once), so a
refactor that moves a mutated line is noticed here, in CI, and not only when the slow mutation run refuses it."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # dataclasses look the module up while its classes are made
    spec.loader.exec_module(module)
    return module


def test_every_mutant_applies_to_the_current_source(tmp_path):
    mutate = _mutate()
    for mutant in mutate.MUTANTS:
        source = ROOT / "src" / "relpos" / mutant.file
        copy = tmp_path / "src" / "relpos" / mutant.file
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(source.read_text())
        assert mutate.apply(mutant, tmp_path) is None, mutant.id
        assert copy.read_text() != source.read_text(), mutant.id  # the patch changed something


def test_mutant_ids_are_unique():
    ids = [m.id for m in _mutate().MUTANTS]
    assert len(ids) == len(set(ids))
