"""A Griffe extension for the docs site (mkdocs.yml): doctest runs in docstrings render as code.

relpos's docstrings print the small matrix a function returns as doctests (``>>> f(...)`` and its output,
run by the test suite). Markdown would reflow them into a paragraph; this wraps every run of ``>>>`` /
``...`` lines and the output under them (up to a blank line) in a ``pycon`` fence, outside existing fences.
"""

from __future__ import annotations

import griffe

FENCE = "```"


def fence_doctests(text: str) -> str:
    """Wrap doctest runs of ``text`` in ``pycon`` fences.

    >>> fence_doctests("Slopes:\\n\\n>>> f(2)\\n[0.5, 0.25]\\n\\nAfter.").splitlines()
    ['Slopes:', '', '```pycon', '>>> f(2)', '[0.5, 0.25]', '```', '', 'After.']
    """
    out: list[str] = []
    in_fence = in_run = False
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(FENCE) and not in_run:
            in_fence = not in_fence
        elif not in_fence and not in_run and stripped.startswith(">>>"):
            out.append(line[: len(line) - len(stripped)] + FENCE + "pycon")
            in_run = True
        elif in_run and not stripped:
            out.append(_indent_of_run(out) + FENCE)
            in_run = False
        out.append(line)
    if in_run:
        out.append(_indent_of_run(out) + FENCE)
    return "\n".join(out)


def _indent_of_run(lines: list[str]) -> str:
    """The indentation of the open ``pycon`` fence."""
    opener = next(line for line in reversed(lines) if line.lstrip() == FENCE + "pycon")
    return opener[: len(opener) - len(opener.lstrip())]


class DoctestFences(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
