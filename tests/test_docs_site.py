"""The docs site builds offline with ``mkdocs build --strict`` (a broken link, anchor or API reference fails it),
documents every public name, and keeps its pages short enough to read."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: the public modules whose ``__all__`` the API reference must cover, and the prefix their anchors carry
PUBLIC = {"relpos": "relpos", "relpos.hf": "relpos.hf", "relpos.distributed": "relpos.distributed",
          "relpos.registry": "relpos.registry", "relpos.experiment": "relpos.experiment"}
MAX_PAGE_WORDS, MAX_README_WORDS = 4000, 1000


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_every_public_name_has_a_reference_entry(site):
    import importlib

    html = "".join(p.read_text() for p in (site / "reference").rglob("*.html"))
    missing = [f"{module}.{name}" for module, prefix in PUBLIC.items() for name in importlib.import_module(module).__all__
               if name != "__version__" and f'id="{prefix}.{name}"' not in html]
    assert not missing, f"not in docs/reference/: {missing}"


def test_the_home_page_is_the_readme(site):
    home = (site / "index.html").read_text()
    first_heading = re.search(r"^## (.+)$", (ROOT / "README.md").read_text(), flags=re.M).group(1)
    assert first_heading in home
    assert 'href="docs/' not in home  # the README's links into docs/ are rewritten for the site


def _words(path: pathlib.Path) -> int:
    return len(path.read_text().split())


def test_pages_stay_short():
    pages = [p for p in DOCS.rglob("*.md") if "extrapolate" not in p.relative_to(DOCS).parts[:1]]
    long = {str(p.relative_to(ROOT)): _words(p) for p in pages if _words(p) > MAX_PAGE_WORDS}
    assert not long, f"pages over {MAX_PAGE_WORDS} words (split them): {long}"
    assert _words(ROOT / "README.md") <= MAX_README_WORDS
