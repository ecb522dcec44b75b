"""rd.exit_process: a barrier, the group destroyed, stdio flushed, then os._exit (no interpreter teardown, in
which a gloo worker thread can abort the process: docs/distributed.md, "Choices and limits")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import relpos
import relpos.distributed as rd

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import relpos.distributed as rd
    if sys.argv[1] == "group":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        dist.all_reduce(torch.ones(3), async_op=True).wait()
    atexit.register(lambda: print("atexit ran"))   # os._exit: must not run
    sys.stdout.write("unflushed line")               # no newline, still buffered: must come out
    sys.stderr.write("to stderr")
    rd.exit_process(int(sys.argv[3]))
    print("after exit_process")                      # never reached
    """
)


@pytest.mark.parametrize("mode", ["none", "group"])
def test_exit_process_flushes_and_exits_with_the_code_without_teardown(tmp_path, mode):
    here = str(Path(relpos.__file__).parents[1])  # the relpos under test (tools/mutate.py's copy too), not the installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONUNBUFFERED", None)  # stdout buffered, as a piped program's is by default
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(tmp_path / "store"), "3"], capture_output=True, text=True, timeout=120,
        env=env,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "unflushed line"  # flushed; neither the atexit handler nor the line after it ran
    assert done.stderr.endswith("to stderr")


@pytest.mark.parametrize("code, error, match", [
    (-1, ValueError, "code must be"), (256, ValueError, "code must be an exit status from 0 to 255, got 256"),
    ("0", TypeError, "code"), (1.0, TypeError, "code"), (True, TypeError, "code"),
])
def test_exit_process_refuses_a_bad_code_before_closing_anything(code, error, match, monkeypatch):
    import relpos._process as process

    def exit_(code):  # a code let through would end this test process: fail instead
        raise AssertionError(f"exit_process accepted code={code!r}")

    monkeypatch.setattr(process.os, "_exit", exit_)
    with pytest.raises(error, match=match):
        rd.exit_process(code)


class _Exited(Exception):
    """Raised by the stand-in for os._exit."""


def test_exit_process_ends_the_group_before_exiting(tmp_path, monkeypatch):
    """In-process, os._exit replaced: a barrier, then the group destroyed, then the exit with the code."""
    from datetime import timedelta

    import torch.distributed as dist

    import relpos._process as process

    calls, real_barrier = [], dist.barrier

    def barrier():
        calls.append("barrier")
        real_barrier()

    def exit_(code):
        calls.append(("exit", code, dist.is_initialized()))
        raise _Exited

    monkeypatch.setattr(process.dist, "barrier", barrier)
    monkeypatch.setattr(process.os, "_exit", exit_)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        with pytest.raises(_Exited):
            rd.exit_process(7)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert calls == ["barrier", ("exit", 7, False)]  # the group was gone before the exit


@pytest.mark.parametrize("world, exits", [("2", True), ("1", False), (None, False)])
def test_command_line_runs_end_without_teardown_only_under_torchrun(world, exits, monkeypatch, capsys):
    """The ``relpos`` console script (and ``python -m relpos.experiment``, which shares ``finish``): under torchrun
    (WORLD_SIZE > 1) it ends by exit_process with main's code; on one process by SystemExit, as any script."""
    import relpos._process as process
    from relpos.tools import cli

    ended = []

    def exit_process(code):
        ended.append(code)
        raise SystemExit(f"exit_process({code})")  # stands in for os._exit: this test process goes on

    monkeypatch.setattr(process, "exit_process", exit_process)
    monkeypatch.setattr(sys, "argv", ["relpos", "buckets", "--json"])
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as info:
        cli.console()
    assert '"max_exact": 8' in capsys.readouterr().out  # main ran first
    assert (ended, info.value.code) == (([0], "exit_process(0)") if exits else ([], 0))


def test_the_console_script_is_the_ending_one():
    """pyproject's ``relpos`` script is cli.console (the torchrun ending), not cli.main."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"relpos": "relpos.tools.cli:console"}
