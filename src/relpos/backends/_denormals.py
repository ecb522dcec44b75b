"""Denormal floats flushed to zero inside relpos's CPU attention kernels (forward and backward).

A position term that reaches far below a row's best logit (ALiBi at long range, Sandwich's
``-d'/2``, a forgetting gate's decay, T5's far buckets after training) gives softmax
probabilities between ``2**-149`` and ``2**-126``: denormal floats, which x86 cores compute
through a slow microcode path. Measured by ``PYTHONPATH=src python benchmarks/denormals.py --threads 1``
(the project's 2-core VM, torch 2.13 CPU; causal attention with Bloom's ALiBi slopes, B=2, H=8,
L=2048, d=64, one example left-padded; forward + backward):

    ==============================================  ========
    SDPA with no bias (the floor)                   0.270 s
    relpos tiles, torch's SDPA backward (kept)      0.884 s
    relpos frozen-bias path, denormals kept         0.711 s
    relpos frozen-bias path, denormals flushed      0.268 s
    ==============================================  ========

Flushing changes each probability below ``2**-126`` (1.2e-38) to exactly 0, i.e. an output by
less than ``L * 2**-126`` of its scale: far below fp32's own rounding (``2**-24``), so results
stay equal to transformers' and the fp64 oracles within every tolerance used. The CPU's flag
(MXCSR's flush-to-zero and denormals-are-zero bits, set by ``torch.set_flush_denormal``) belongs
to each thread: torch's OpenMP workers keep the one they were created with, so setting it on the
calling thread alone flushes only the calling thread's share of a kernel (measured: forgetting-gate
training at 2 threads did not move). :func:`flushing` therefore sets it on the calling thread and,
where torch runs on GNU OpenMP (Linux wheels), on every thread of its OpenMP team (one
``GOMP_parallel`` region), for the duration of one kernel call, and restores what
the caller had, including a caller who had turned it on. ``relpos.backends._denormals.ENABLED = False``
turns the whole mechanism off (to measure it).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import torch

__all__ = ["ENABLED", "flushing"]

ENABLED = True  # the switch: False leaves the CPU's denormal handling alone everywhere in relpos
_PROBE = 1e-39  # a denormal fp32: multiplied by 1 under flush-to-zero / denormals-are-zero it becomes 0


def _flush_is_on() -> bool:
    """Whether this thread flushes denormals now (torch has no getter: a 4-byte probe)."""
    return bool(torch.tensor([_PROBE], dtype=torch.float32).mul(1.0).item() == 0.0)


def _openmp_team():
    """``GOMP_parallel`` of the libgomp torch loaded, or None (another OpenMP, or not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return None
    if len(paths) != 1:  # none, or two OpenMP runtimes: which team torch uses is unknown
        return None
    try:
        return ctypes.CDLL(paths.pop()).GOMP_parallel  # dlopen of a loaded library: the same instance
    except (OSError, AttributeError):
        return None


_TEAM: list = []  # [GOMP_parallel or None], looked up once
_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_FLAG = {"on": False}


@_REGION
def _set_this_thread(_data) -> None:
    torch.set_flush_denormal(_FLAG["on"])


def _set_everywhere(on: bool) -> bool:
    """Flush (or not) on this thread and on each thread of torch's OpenMP team; False if unsupported."""
    if not torch.set_flush_denormal(on):
        return False
    if not _TEAM:
        _TEAM.append(_openmp_team())
    if _TEAM[0] is not None and torch.get_num_threads() > 1:
        _FLAG["on"] = on
        _TEAM[0](_set_this_thread, None, ctypes.c_uint(torch.get_num_threads()), ctypes.c_uint(0))
    return True


def _applies(tensor: torch.Tensor) -> bool:
    return (
        ENABLED
        and tensor.device.type == "cpu"
        and tensor.dtype in (torch.float32, torch.bfloat16, torch.float16)  # fp64: the oracles' dtype, left alone
        and not torch.compiler.is_compiling()  # set_flush_denormal is a graph break: compiled code is left alone
    )


@contextlib.contextmanager
def flushing(tensor: torch.Tensor) -> Iterator[None]:
    """Flush denormals to zero inside the block when ``tensor`` is a CPU float tensor; restore after.

    >>> with flushing(torch.ones(1)):
    ...     torch.tensor([1e-39]).mul(1.0).item()
    0.0
    >>> torch.tensor([1e-39]).mul(1.0).item() > 0    # restored
    True
    """
    if not _applies(tensor) or _flush_is_on():
        yield
        return
    if not _set_everywhere(True):  # this CPU has no such mode: nothing to restore
        yield
        return
    try:
        yield
    finally:
        _set_everywhere(False)
