"""Files a user relies on are written atomically: a temporary file beside the target, flushed and
fsynced, then renamed over it. A run killed at any moment leaves either the old file or the new
one, never a truncated one."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import tempfile
from typing import Any, Callable

__all__ = ["atomic_write", "json_safe", "save_torch", "save_with", "write_text"]


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
