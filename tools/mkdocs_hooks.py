"""MkDocs hooks for the docs site (mkdocs.yml): the README is the site's home page.

One source for the first page a user reads: the README's links and images point into docs/
(``docs/encodings/index.md``), which on the site are relative to the docs folder (``encodings/index.md``).
"""

from __future__ import annotations

import pathlib
import re

from mkdocs.structure.files import File, Files

ROOT = pathlib.Path(__file__).resolve().parents[1]


def home_page(readme: str) -> str:
    """The README with its ``docs/`` link targets made relative to the docs folder.

    >>> home_page("See [encodings](docs/encodings/index.md) and ![page](docs/explore-bias.png).")
    'See [encodings](encodings/index.md) and ![page](explore-bias.png).'
    """
    return re.sub(r"\]\(docs/", "](", readme)


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", content=home_page((ROOT / "README.md").read_text())))
    return files
