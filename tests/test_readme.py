"""The README's Python snippets run as written (in order, one namespace), so every line a new user copies works."""

import pathlib
import re

README = pathlib.Path(__file__).parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = python_blocks()
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)  # anything a snippet writes stays out of the repository
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README is ours
    assert namespace["out"].shape == (2, 8, 128, 64)  # the last attention output of the first block
    assert namespace["tokens"].shape[0] == 2  # generate() after relpos.hf.accelerate
