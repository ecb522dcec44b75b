"""Timing and peak memory of one call, and the device options: shared by ``relpos bench`` (:mod:`relpos.tools.bench`)
and the model benchmark (:mod:`relpos.hf.bench`).

Memory: on CPU the process's peak resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) minus
its resident set before the call (``None`` where Linux's counters are missing); on CUDA the allocator's peak
minus what was allocated before, every timed call bracketed by ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import gc
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from ._checks import check_choice, check_device, check_positive_float
from ._progress import Progress

__all__ = ["DTYPES", "add_device_arguments", "checkout_commit", "device_arguments", "fix_mmap_threshold", "is_cuda",
           "measure", "timed_rounds"]


def checkout_commit(root: str | Path) -> str:
    """The commit of the git checkout at ``root`` (a benchmark's results name the code that produced them),
    ``-modified`` when its src/ differs from it; ``unknown`` outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("-modified" if git("status", "--porcelain", "src") else "")


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 64 * 1024


def fix_mmap_threshold() -> bool:
    """Make CPU peak-memory readings per call: allocations of 64 KiB and more go to mmap and return
    to the OS when freed (glibc's ``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_=65536``).

    With glibc's adaptive threshold, freed tensors stay in the heap and a later call reuses them
    without raising the resident peak: every variant after the largest reads about 0 MiB. Returns
    False where there is no glibc (the readings then keep that caveat).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def _measure_cuda(fn: Callable[[], None]) -> tuple[float, float]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    return ms, max(0.0, (torch.cuda.max_memory_allocated() - base) / 2**20)


def measure(fn: Callable[[], None], memory: bool = True, cuda: bool = False) -> tuple[float, float | None]:
    gc.collect()
    if cuda:
        return _measure_cuda(fn)
    base = _status_kib("VmRSS") if memory else None
    can_peak = base is not None and _reset_peak()
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    peak = _status_kib("VmHWM") if can_peak else None
    return ms, None if peak is None else max(0.0, (peak - base) / 1024)


def timed_rounds(variants: dict[str, Callable], rounds: int, progress: Progress, label: str, cuda: bool) -> dict[str, tuple]:
    samples: dict[str, list] = {name: [] for name in variants}
    peaks: dict[str, list] = {name: [] for name in variants}
    for name, fn in variants.items():  # warm-up (and flex compilation), not timed
        fn()
    gc.collect()
    gc.freeze()  # what lives now is never garbage during the rounds: measure()'s collection then scans only the
    try:  # objects made since (in a large process, a test session, 0.2-0.6 s a collection otherwise)
        for _ in range(rounds):  # interleaved: this kind of VM has slow phases lasting seconds
            for name, fn in variants.items():
                repeats = getattr(fn, "repeats", 1)
                ms, peak = measure(fn, memory=repeats == 1, cuda=cuda)
                samples[name].append(ms / repeats)
                peaks[name].append(peak)
                progress.step(f"{label} {name}")
    finally:
        gc.unfreeze()
    out = {name: (statistics.median(samples[name]), peaks[name][-1], samples[name]) for name in variants}
    progress.log(f"{time.strftime('%H:%M:%S')} {label}: " + ", ".join(f"{n} {ms:.3g} ms" for n, (ms, _, _) in out.items()))
    return out


#: the CUDA runtime calls that make the CPU wait for the GPU (``.item()``, ``.tolist()``, a copy to the host, an explicit
#: synchronize): what :func:`profile_call` counts as host syncs
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
#: a kernel (or, on the CPU, an operator) whose name matches is attention: SDPA's flash / cuDNN / memory-efficient
#: kernels, FlexAttention's, relpos's Triton kernels (``_fwd_kernel``, ``_dkdv_kernel``, ``_dq_kernel`` ...)
ATTENTION_NAMES = re.compile(r"attention|attn|flash|fmha|sdpa|_fwd_kernel|_dkdv|_dq_|_delta|flex")


def kernel_events(events) -> list:
    """The device's own events of a torch.profiler ``key_averages()`` (kernels, copies, memsets): summing these
    counts each kernel once, where a CPU operator's self CUDA time would count its kernels again."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]


def profile_call(fn: Callable[[], None], cuda: bool, calls: int = 3, top: int = 6) -> dict:
    """Where one call's time goes, by torch.profiler over ``calls`` calls (after one unprofiled call): per call, the
    wall time, the GPU's busy time (the kernels' and copies' own time: far below the wall time, the GPU waited for
    the CPU), the part of it in attention kernels (:data:`ATTENTION_NAMES`), the host syncs (:data:`SYNC_CALLS`, the
    profile's own closing synchronize not counted) and the ``top`` kernels by time. On the CPU the same from the
    operators' own CPU time, and no syncs (``None``)."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / calls
    events = prof.key_averages()
    if cuda:
        timed = [(e.key, e.self_device_time_total) for e in kernel_events(events)]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events]
    per_call = sorted(((name, us / calls / 1e3) for name, us in timed if us > 0), key=lambda x: -x[1])  # (name, ms)
    syncs = sum(e.count for e in events if e.key in SYNC_CALLS) - 1 if cuda else None  # less the closing one
    return {
        "calls": calls, "wall_ms": wall_ms, "busy_ms": sum(ms for _, ms in per_call),
        "attention_ms": sum(ms for name, ms in per_call if ATTENTION_NAMES.search(name.lower())) if cuda else None,
        "syncs_per_call": None if syncs is None else max(0, syncs) / calls,
        "top": [[name[:90], round(ms, 4)] for name, ms in per_call[:top]],
    }


DTYPES = ("float32", "bfloat16", "float16")


def add_device_arguments(parser) -> None:
    """--device, --dtype and --memory-limit-gib: shared by ``relpos bench`` and the model benchmark."""
    parser.add_argument("--device", default="cpu", help="where to run: cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the inputs and models (default: float32)")
    parser.add_argument("--memory-limit-gib", type=float, default=14.0,
                        help="skip a variant whose (B, H, L, L) tensors would exceed this many GiB (default: 14)")


def device_arguments(args) -> dict:
    """The checked ``device``, ``dtype`` and ``memory_limit_gib`` of :func:`add_device_arguments`' options."""
    device = str(check_device("--device", args.device))
    if is_cuda(device) and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device here; run with --device cpu")
    return {"device": device, "dtype": check_choice("--dtype", args.dtype, DTYPES),
            "memory_limit_gib": check_positive_float("--memory-limit-gib", args.memory_limit_gib)}
