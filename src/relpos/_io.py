"""Files a user relies on are written atomically: a temporary file beside the target, flushed and
fsynced, then renamed over it. A run killed at any moment leaves either the old file or the new
one, never a truncated one."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import tempfile
from typing import Any, Callable

__all__ = ["atomic_write", "write_report", "generated_begin", "generated_region", "json_safe", "replace_generated", "save_torch", "save_with",
           "write_generated", "write_text"]


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, suffix: str = ""):
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path`` (fsynced)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield pathlib.Path(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; give what open() would have
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as tmp:
        tmp.write_text(text)


#: Closes a page's generated region (see :func:`generated_begin`).
GENERATED_END = "<!-- end generated -->"


def generated_begin(source: str | os.PathLike, part: str | None = None) -> str:
    """The line that opens a page's generated region: the JSON file it is rendered from (by name) and, where one
    JSON feeds several regions of a page, which part. ``tools/bench_tables.py --check`` compares each region
    with what its JSON gives; the prose around the regions is the page's own."""
    name = os.path.basename(os.fspath(source))
    return f"<!-- generated from {name}{f' ({part})' if part else ''} by tools/bench_tables.py: do not edit -->"


def generated_region(page: str, begin: str) -> str | None:
    """The text of the region that ``begin`` opens in ``page`` (None if the page has no such region)."""
    start = page.find(begin + "\n")
    end = page.find(GENERATED_END, start) if start >= 0 else -1
    return None if end < 0 else page[start + len(begin) + 1:end]


def replace_generated(page: str, begin: str, text: str) -> str | None:
    """``page`` with the region that ``begin`` opens holding ``text`` (None if the page has no such region)."""
    old = generated_region(page, begin)
    if old is None:
        return None
    start = page.find(begin + "\n") + len(begin) + 1
    return page[:start] + text.rstrip("\n") + "\n" + page[start + len(old):]


def write_generated(path: str | os.PathLike, text: str, source: str | os.PathLike | None, part: str | None = None) -> None:
    """Write a benchmark's tables to the page ``path``: into the region generated from ``source`` (the run's JSON)
    where the page has one, keeping the prose around it; otherwise the page becomes that region alone. Without a
    ``source`` (no JSON written) the page is just ``text``."""
    if source is None:
        write_text(path, text)
        return
    begin = generated_begin(source, part)
    page = pathlib.Path(path).read_text() if os.path.exists(path) else ""
    new = replace_generated(page, begin, text)
    write_text(path, new if new is not None else f"{begin}\n{text.rstrip()}\n{GENERATED_END}\n")


def write_report(payload: Any, text: str, json_path: str | os.PathLike | None, markdown_path: str | os.PathLike | None,
                 *, part: str | None = None, indent: int = 1) -> None:
    """A benchmark run's outputs, each only where asked: ``payload`` as JSON at ``json_path`` and ``text`` (its
    tables) into the page ``markdown_path``, in the region generated from that JSON (:func:`write_generated`)."""
    if json_path:
        write_text(json_path, json.dumps(payload, indent=indent))
    if markdown_path:
        write_generated(markdown_path, text, json_path, part=part)


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    import torch

    with atomic_write(path) as tmp:
        torch.save(obj, tmp)


def save_with(save: Callable[[pathlib.Path], None], path: str | os.PathLike) -> None:
    """Atomically write whatever ``save(tmp_path)`` writes (a plot's ``savefig``, say)."""
    with atomic_write(path) as tmp:
        save(tmp)


def json_safe(obj: Any) -> Any:
    """Non-finite floats as the strings "nan", "inf", "-inf": valid JSON that still says what happened."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
