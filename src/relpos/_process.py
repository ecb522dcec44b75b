"""Ending a process that ran gloo collectives, without the abort at interpreter teardown.

A gloo worker thread drops its last reference to a finished collective (and so to the tensors it held) after
the caller's ``wait()`` or ``barrier()`` has already returned. When that drop lands after Python has begun to
finalize, releasing a tensor's Python object takes the GIL, CPython ends the thread with ``pthread_exit`` inside
a C++ destructor, and the process aborts: "terminate called without an active exception", SIGABRT, exit code -6
(torch 2.13.0 CPU, read from a core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` ->
``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). A barrier and
``destroy_process_group()`` do not prevent it: the worker threads outlive both. Under load it hit 4 of 10 runs of
``examples/context_parallel_t5.py`` on 2 processes. The only ending with no such race is one without
interpreter teardown: flush, then ``os._exit``.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist

from ._checks import check_int

__all__ = ["close_process_group", "exit_process", "finish"]


def close_process_group(clean: bool = True) -> None:
    """End the default process group, if any: after a barrier on a clean finish, so that no rank tears gloo down
    while another still talks to it (a failing rank skips the barrier: the others would wait for it)."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """Close the process group (:func:`close_process_group`), flush stdout and stderr, and end the process with
    ``code`` at once (``os._exit``: no interpreter teardown, so no gloo thread can abort it; ``atexit`` handlers
    do not run)."""
    code = check_int("code", code, minimum=0)
    if code > 255:
        raise ValueError(f"code must be an exit status from 0 to 255, got {code}")
    close_process_group()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)


def finish(code: int) -> NoReturn:
    """End a command-line run (the ``relpos`` console script, ``python -m relpos.experiment``) with ``code``: under
    torchrun (``WORLD_SIZE`` > 1) by :func:`exit_process`, without teardown; otherwise by ``SystemExit``."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_process(code)
    raise SystemExit(code)
