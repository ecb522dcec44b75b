"""tools/probe_transformers.py, the probe behind the release table of docs/integrations/index.md: on the installed release every
family accelerates with transformers' logits, and a release that does not fit comes back as its refusal."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import probe_transformers  # noqa: E402


def test_every_family_fits_the_installed_release():
    assert {name: probe_transformers.probe(make) for name, make in probe_transformers.FAMILIES.items()} == dict.fromkeys(
        probe_transformers.FAMILIES, "ok")


def test_a_refusal_is_reported_not_raised():
    def refused():
        raise RuntimeError("relpos.hf.accelerate does not fit")

    assert probe_transformers.probe(refused) == "RuntimeError: relpos.hf.accelerate does not fit"
