"""Byte-level corpora for the length-generalization experiment.

The default corpus exists on every machine: the source files of the running Python's standard
library (tests and site-packages excluded), sorted by path and split deterministically, by a hash
of each file's path, into train, validation (in-distribution: learning-rate choice and learning
curves) and held-out test files (the length evaluation, kept file by file so that a bootstrap can
resample files). ``load_corpus(path)`` reads a text file or every file under a folder.
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from dataclasses import dataclass

import torch

__all__ = ["Corpus", "stdlib_corpus", "load_corpus", "sample_batch", "eval_windows", "file_windows"]


@dataclass(frozen=True)
class Corpus:
    """Train and validation byte streams (uint8 tensors), the held-out test files (name, bytes)
    one by one, and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    test: tuple[tuple[str, torch.Tensor], ...] = ()

    def describe(self) -> str:
        held_out = sum(t.numel() for _, t in self.test)
        return (f"{self.source}: {self.train.numel() / 1e6:.2f} MB train, {self.val.numel() / 1e6:.2f} MB validation, "
                f"{held_out / 1e6:.2f} MB held-out test in {len(self.test)} files")


def _hash_fraction(relative_path: str) -> float:
    digest = hashlib.sha256(relative_path.encode()).digest()  # stable across machines and runs
    return int.from_bytes(digest[:4], "big") / 2**32


def _as_tensor(data: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


#: the share of files held out for the length evaluation: 15% of the Python 3.11 standard library's
#: sources is about 1.3 MB in about 100 files (10% gave 0.86 MB in 58, short of the 1 MB the reference needs)
TEST_FRACTION = 0.15


def _split(files: list[tuple[str, bytes]], source: str, val_fraction: float, max_bytes: int | None) -> Corpus:
    """Files whose path hashes below ``val_fraction`` are validation, the next ``TEST_FRACTION``
    held-out test, the rest training."""
    train, val, test = bytearray(), bytearray(), []
    for rel, data in files:
        u = _hash_fraction(rel)
        if u < val_fraction:
            val.extend(data + b"\n")
        elif u < val_fraction + TEST_FRACTION:
            test.append((rel, data))
        else:
            train.extend(data + b"\n")
    if not val or not train or not test:
        # Too few files for the name hash to put some on each side (one file, or three that all hash
        # the same way): split within every file instead, its last fractions going to validation and test.
        train, val, test = bytearray(), bytearray(), []
        for rel, data in files:
            cut, end = int(len(data) * (1 - val_fraction - TEST_FRACTION)), int(len(data) * (1 - TEST_FRACTION))
            train.extend(data[:cut] + b"\n")
            val.extend(data[cut:end] + b"\n")
            test.append((rel, data[end:]))
    if max_bytes is not None:
        train, val = train[:max_bytes], val[: max(1, int(max_bytes * val_fraction))]
    if len(train) < 2 or len(val) < 2:
        raise ValueError(f"corpus {source!r} is too small to split into train and validation bytes")
    return Corpus(_as_tensor(train), _as_tensor(val), source, tuple((rel, _as_tensor(data)) for rel, data in test if data))


def stdlib_corpus(*, val_fraction: float = 0.1, max_bytes: int | None = None) -> Corpus:
    """The running Python's standard library sources (``*.py``, no tests), split by file."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py") if not {"site-packages", "test", "tests", "idlelib"} & set(p.relative_to(root).parts)
    )
    files = [(str(p.relative_to(root)), p.read_bytes()) for p in paths]
    return _split(files, f"python {sysconfig.get_python_version()} stdlib ({len(files)} files)", val_fraction, max_bytes)


def load_corpus(path: str | pathlib.Path, *, val_fraction: float = 0.1, max_bytes: int | None = None) -> Corpus:
    """A text file, or every file under a folder (sorted), split into train and validation.

    Raises ``ValueError`` for a missing path, an empty corpus, or binary content (NUL bytes or
    mostly non-text bytes): the experiment models text bytes.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise ValueError(f"--corpus {str(path)!r} does not exist; give a text file or a folder of text files")
    paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    files = []
    for p in paths:
        data = p.read_bytes()
        if not data:
            continue
        sample = data[:65536]
        printable = sum(32 <= b < 127 or b in (9, 10, 13) or b >= 128 for b in sample)
        if b"\x00" in sample or printable < 0.95 * len(sample):
            raise ValueError(f"--corpus file {str(p)!r} looks binary (NUL or non-text bytes); give text files")
        files.append((str(p.relative_to(path)) if p != path else p.name, data))
    if not files:
        raise ValueError(f"--corpus {str(path)!r} holds no text: it is empty")
    return _split(files, str(path), val_fraction, max_bytes)


def sample_batch(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows: inputs (B, L) and next-byte targets (B, L), int64."""
    if stream.numel() < length + 1:
        raise ValueError(f"the training stream has {stream.numel()} bytes, fewer than length + 1 = {length + 1}")
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)  # (B,)
    idx = starts[:, None] + torch.arange(length + 1)[None, :]  # (B, L + 1)
    window = stream[idx].long()
    return window[:, :-1], window[:, 1:]


def file_windows(files: tuple[tuple[str, torch.Tensor], ...], length: int, max_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Non-overlapping windows of ``length`` (+1 target byte) inside each file, never across two.

    Taken round-robin over the files long enough for one (the first window of every file, then
    the second, ...) until ``max_tokens`` predicted bytes, so a budget spreads over as many files
    as it can. Returns inputs (N, L), targets (N, L) and the index in ``files`` of each window.
    """
    per_file = [(i, (t.numel() - 1) // length) for i, (_, t) in enumerate(files)]
    per_file = [(i, n) for i, n in per_file if n > 0]
    picks: list[tuple[int, int]] = []
    budget = max(1, max_tokens // length)
    for k in range(max((n for _, n in per_file), default=0)):
        for i, n in per_file:
            if k < n and len(picks) < budget:
                picks.append((i, k))
    if not picks:
        raise ValueError(f"no held-out file is longer than one evaluation window of {length + 1} bytes")
    offsets = torch.arange(length + 1)  # (L + 1,)
    window = torch.stack([files[i][1][k * length + offsets] for i, k in picks]).long()  # (N, L + 1)
    return window[:, :-1], window[:, 1:], [i for i, _ in picks]


def eval_windows(stream: torch.Tensor, length: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping validation windows of ``length`` from the start of the stream."""
    count = min(max_windows, (stream.numel() - 1) // length)
    if count < 1:
        raise ValueError(f"the validation stream ({stream.numel()} bytes) is shorter than one window of {length + 1}")
    idx = torch.arange(count)[:, None] * length + torch.arange(length + 1)[None, :]  # (N, L + 1)
    window = stream[idx].long()
    return window[:, :-1], window[:, 1:]
