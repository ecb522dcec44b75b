"""rd.exit_process: a barrier, the group destroyed, stdio flushed, then os._exit (no interpreter teardown, in
which a gloo worker thread can abort the process: docs/distributed.md, "Choices and limits")."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(tmp_path / "store"), "3"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "unflushed line"  # flushed; neither the atexit handler nor the line after it ran
    assert done.stderr.endswith("to stderr")


@pytest.mark.parametrize("code, error, match", [
    (-1, ValueError, "code must be"), (256, ValueError, "code must be an exit status from 0 to 255, got 256"),
    ("0", TypeError, "code"), (1.0, TypeError, "code"), (True, TypeError, "code"),
])
def test_exit_process_refuses_a_bad_code_before_closing_anything(code, error, match):
    with pytest.raises(error, match=match):
        rd.exit_process(code)
