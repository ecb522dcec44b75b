"""benchmarks/gpu_session.py: the one command a lent GPU runs. Without a GPU its bookkeeping is checked with
stand-in steps: each step's status, time and log in session.json (rewritten after every step), a failing or
timed-out step does not stop the next, the budget is honoured, bad options are refused before any work."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path):
    """The script as a module, without putting benchmarks/ on sys.path (tools/bench_tables.py does the same): a
    module there whose name a standard module has would shadow it in every subprocess that inherits the path,
    inductor's CPU-ISA probe among them (benchmarks/encodings.py did, and inductor then compiled no CPU kernel)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_session = _load(ROOT / "benchmarks" / "gpu_session.py")


def stand_ins(monkeypatch):
    monkeypatch.setattr(gpu_session, "STEPS", {
        "ok": (30, [sys.executable, "-c", "print('step ran')"]),
        "fails": (30, [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]),
        "slow": (1, [sys.executable, "-c", "import time; time.sleep(30)"]),
        "writes": (30, [sys.executable, "-c", "import sys; open(sys.argv[1] + '/x.json', 'w').write('1')", "{out}"]),
    })


def test_every_step_is_recorded_and_a_failure_does_not_stop_the_next(tmp_path, monkeypatch, capsys):
    stand_ins(monkeypatch)
    assert gpu_session.main(["--out", str(tmp_path)]) == 1
    session = json.loads((tmp_path / "session.json").read_text())
    steps = session["steps"]
    assert [steps[n]["status"] for n in ("ok", "fails", "slow", "writes")] == [0, 3, "timed out", 0]
    assert "step ran" in (tmp_path / "ok.log").read_text() and "boom" in (tmp_path / "fails.log").read_text()
    assert (tmp_path / "x.json").exists()  # {out} filled in
    assert 1 <= steps["slow"]["seconds"] < 20
    out = capsys.readouterr().out
    assert "[gpu_session]" in out and "steps not passed: fails, slow" in out


def test_only_and_the_budget(tmp_path, monkeypatch):
    stand_ins(monkeypatch)
    assert gpu_session.main(["--out", str(tmp_path), "--only", "ok"]) == 0
    assert list(json.loads((tmp_path / "session.json").read_text())["steps"]) == ["ok"]
    assert gpu_session.main(["--out", str(tmp_path / "b"), "--only", "ok,writes", "--budget", "5"]) == 1
    steps = json.loads((tmp_path / "b" / "session.json").read_text())["steps"]
    assert all(s["status"] == "not run: the budget was spent" for s in steps.values())  # under 20 s left: none starts


@pytest.mark.parametrize("argv,message", [
    (["--only", "tests_kernel,bogus"], "--only must name steps among"),
    (["--budget", "0"], "--budget must be a positive number of seconds, got 0.0"),
])
def test_bad_options_are_refused_before_any_work(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_session.main(["--out", str(tmp_path / "o"), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_real_steps_name_scripts_and_options_that_exist():
    """Each step's command parses with its script's own parser (no GPU needed to catch a stale option)."""
    from relpos.hf import bench

    for name, (_, command) in gpu_session.STEPS.items():
        if command[1] == "benchmarks/t5_model.py":
            args = [part.format(out="/tmp/o").replace("cuda", "cpu") for part in command[2:]]  # no GPU here
            parser_error = []
            real_error = bench.argparse.ArgumentParser.error

            def record(self, message, real_error=real_error):
                parser_error.append(message)
                real_error(self, message)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(bench.argparse.ArgumentParser, "error", record)
                patch.setattr(bench, "run_model_bench", lambda config, on_point=None: (_ for _ in ()).throw(KeyboardInterrupt))
                with pytest.raises(KeyboardInterrupt):  # parsed and validated, stopped before the work
                    bench.main(args)
            assert not parser_error, (name, parser_error)
        elif command[1] in ("benchmarks/sam.py", "benchmarks/swin.py"):
            args = [part.format(out="/tmp/o") for part in command[2:]]
            parsed = _load(ROOT / command[1]).build_parser().parse_args(args)  # exits 2 on a stale option
            assert parsed.device == "cuda" and parsed.dtype == "bfloat16", name
        else:
            assert (ROOT / command[1]).exists() or command[1] == "-m", name


def test_the_tests_step_names_every_file_with_gpu_tests():
    """pytest runs a folder's files in its own order, so the step lists the files: every file that marks a test
    ``gpu`` must be among them, or the lent GPU never runs it."""
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if "mark.gpu" in p.read_text() and p.parent.name != "tools"}  # this file names the marker too
    assert marked == set(gpu_session.GPU_TEST_FILES)
    steps = {"tests_kernel": gpu_session.GPU_KERNEL_TEST_FILES, "tests_models": gpu_session.GPU_MODEL_TEST_FILES}
    for step, files in steps.items():  # each file in exactly one step, which runs it
        command = gpu_session.STEPS[step][1]
        assert [part for part in command if part.startswith("tests/")] == list(files), step


def test_a_timed_out_step_is_interrupted_first_and_writes_its_summary(tmp_path, monkeypatch):
    """Past its limit a step gets SIGINT (pytest then prints what ran and the slowest tests) and is killed only if it
    does not end within the grace period; either way its status is "timed out"."""
    handles = ("import signal, sys, time\n"
               "def stop(*_):\n    print('summary written'); sys.exit(2)\n"
               "signal.signal(signal.SIGINT, stop)\nprint('started', flush=True)\ntime.sleep(60)\n")
    ignores = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nprint('started', flush=True)\ntime.sleep(60)\n"
    monkeypatch.setattr(gpu_session, "GRACE_SECONDS", 1.0)
    for name, code in (("handles", handles), ("ignores", ignores)):
        record = gpu_session.run_step(name, 4, [sys.executable, "-c", code], str(tmp_path))  # 4 s: the handler is set by then
        assert record["status"] == "timed out" and record["seconds"] < 20, record
    assert "summary written" in (tmp_path / "handles.log").read_text()
    assert "started" in (tmp_path / "ignores.log").read_text()  # killed after the grace period


def test_the_grids_run_only_when_named(tmp_path, monkeypatch):
    """The model grids (issue 35's L = 1024 to 8192, B = 1 and 4, 64 new tokens) take minutes each: a default run
    leaves them out, ``--only`` names them."""
    assert set(gpu_session.GRID_STEPS) == {"t5_grid", "bloom_grid"}
    assert all("--new-tokens" in command and "8192" in ",".join(command) for _, command in gpu_session.GRID_STEPS.values())
    ran = []
    monkeypatch.setattr(gpu_session, "run_step", lambda name, limit, command, out: ran.append(name) or {"status": 0})
    gpu_session.main(["--out", str(tmp_path / "a")])
    assert ran and not set(ran) & set(gpu_session.GRID_STEPS) and "kernel" in ran
    ran.clear()
    gpu_session.main(["--out", str(tmp_path / "b"), "--only", "t5_grid"])
    assert ran == ["t5_grid"]
