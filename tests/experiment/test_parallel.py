"""relpos.experiment.parallel: torchrun's processes share whole runs (the results equal one process's)
or each run's batch; the assignment, the resume rules of the two ways."""

import gzip
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from relpos.experiment import runner as ex
from relpos.experiment.parallel import assign


def _torchrun(out, port: int, *options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "relpos.experiment", "--preset", "smoke", "--out", str(out), "--no-plot", "--no-progress", *options]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_assign_balances_the_load_and_is_the_same_list_everywhere():
    costs = {("cope", 0): 9.0, ("t5", 0): 3.0, ("t5", 1): 3.0, ("alibi", 0): 2.0, ("alibi", 1): 2.0, ("none", 0): 1.0}
    jobs = assign(costs, 2)
    assert sorted(jobs[0] + jobs[1]) == sorted(costs)  # every job once
    loads = [sum(costs[j] for j in part) for part in jobs]
    assert loads == [10.0, 10.0] and jobs[0] == [("cope", 0), ("none", 0)]  # longest first, to the least loaded
    assert assign(dict(costs), 2) == jobs  # the same input gives the same lists (every process computes them)
    assert assign(costs, 1) == [sorted(costs, key=lambda j: -costs[j])]


def test_runs_under_torchrun_equal_one_process_and_both_processes_work(tmp_path, free_port):
    """Each process trains whole runs alone: every number equals a single process's run, and the two
    processes each took some of the runs (sweep and seeds)."""
    options = ["--encodings", "alibi,t5,none", "--seeds", "2", "--lrs", "3e-3,1e-2", "--steps", "6"]
    done = _torchrun(tmp_path / "two", free_port(), *options)
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process
    try:
        one = ex.run(ex.RunConfig(**{**ex.PRESETS["smoke"], "encodings": ("alibi", "t5", "none"), "seeds": (0, 1),
                                     "lrs": (3e-3, 1e-2), "steps": 6, "out": str(tmp_path / "one"), "plot": False,
                                     "progress": False}))
    finally:
        torch.set_num_threads(threads)
    assert two["world_size"] == 2 and two["config"]["parallel"] == "runs"
    assert two["chosen_lr"] == one["chosen_lr"]
    assert {n: {k: r["val"] for k, r in v.items()} for n, v in two["sweep"].items()} == \
           {n: {k: r["val"] for k, r in v.items()} for n, v in one["sweep"].items()}
    for name in ("alibi", "t5", "none"):
        for seed in ("0", "1"):
            a, b = two["runs"][name][seed], one["runs"][name][seed]
            assert a["curve"] == [list(c) for c in b["curve"]], (name, seed)
            assert {n: c["bits_per_byte"] for n, c in a["eval"].items()} == \
                   {n: c["bits_per_byte"] for n, c in b["eval"].items()}, (name, seed)
    assert {r["process"] for runs in two["runs"].values() for r in runs.values()} == {0, 1}
    assert not (tmp_path / "two" / ex.PARTIAL).exists()  # the processes' partial results, merged, are gone
    assert done.stderr.count("seed 1 lr") == 3  # each finished run logged once, by the process that ran it


def test_batch_way_still_splits_each_batch(tmp_path, free_port):
    _torchrun(tmp_path, free_port(), "--encodings", "alibi", "--steps", "3", "--parallel", "batch")
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["config"]["parallel"] == "batch" and report["world_size"] == 2


def test_resume_of_a_run_made_before_the_option_needs_the_batch_way(tmp_path):
    """Runs saved before ``parallel`` existed were made with DDP: resuming them under the new default
    is refused (the numbers would come from another computation), under ``parallel="batch"`` it goes on."""
    config = ex.RunConfig(**{**ex.PRESETS["smoke"], "encodings": ("alibi",), "steps": 4, "out": str(tmp_path),
                             "plot": False, "progress": False, "parallel": "batch"})
    ex.run(config)
    results = tmp_path / "results.json"
    saved = json.loads(results.read_text())
    del saved["config"]["parallel"]  # as written before the option existed
    results.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"parallel: saved 'batch', requested 'runs'"):
        ex.run(ex.RunConfig(**{**ex.asdict(config), "parallel": "runs", "resume": True}))
    again = ex.run(ex.RunConfig(**{**ex.asdict(config), "resume": True}))
    assert again["runs"]["alibi"]["0"]["eval"] == saved["runs"]["alibi"]["0"]["eval"]


def _split_off(out, name: str) -> None:
    """Make ``out`` look like a run killed mid-stage: ``name``'s runs only in process 1's partial results."""
    main, windows = json.loads((out / "results.json").read_text()), json.loads(gzip.decompress((out / "windows.json.gz").read_bytes()))
    part = out / ex.PARTIAL / "rank1"
    part.mkdir(parents=True)
    mine = {**main, "runs": {name: main["runs"].pop(name)}}
    mine["runs"][name]["0"]["train_loss"] = 123.0  # a mark: only a run taken from the partial file carries it
    (part / "results.json").write_text(json.dumps(mine))
    (part / "windows.json.gz").write_bytes(gzip.compress(json.dumps({name: windows.pop(name)}).encode()))
    (out / "results.json").write_text(json.dumps(main))
    (out / "windows.json.gz").write_bytes(gzip.compress(json.dumps(windows).encode()))


def test_resume_takes_the_runs_another_process_had_not_handed_over(tmp_path):
    """After a kill in runs mode, process 1's finished runs live only in ``partial/rank1``: ``--resume``
    takes them from there (with their per-window losses) instead of training them again, and the
    finished run removes the partial folder."""
    config = ex.RunConfig(**{**ex.PRESETS["smoke"], "encodings": ("alibi", "none"), "steps": 4, "out": str(tmp_path),
                             "plot": False, "progress": False})
    first = ex.run(config)
    _split_off(tmp_path, "none")
    shutil.rmtree(tmp_path / "checkpoints")  # nothing to replay: the run must come from the partial file
    again = ex.run(ex.RunConfig(**{**ex.asdict(config), "resume": True}))
    assert again["runs"]["none"]["0"]["train_loss"] == 123.0
    assert again["runs"]["none"]["0"]["eval"] == first["runs"]["none"]["0"]["eval"]
    windows = json.loads(gzip.decompress((tmp_path / "windows.json.gz").read_bytes()))
    assert set(windows) == {"alibi", "none"} and not (tmp_path / ex.PARTIAL).exists()


def test_every_process_but_rank_0_writes_its_runs_to_its_partial_folder(tmp_path):
    from relpos.experiment.parallel import Share

    report = {"config": {}, "runs": {"alibi": {"1": {"eval": {"64": {"bits_per_byte": 2.0, "windows": [1.9, 2.1]}}}}}}
    config = ex.RunConfig(out=str(tmp_path))
    ex._Stages(config, None, Share(rank=1, world=2, split=True), None, report, {}, {}, 0.0).write()
    saved = json.loads((tmp_path / ex.PARTIAL / "rank1" / "results.json").read_text())
    assert saved["runs"]["alibi"]["1"]["eval"]["64"] == {"bits_per_byte": 2.0}  # the windows go to the gz file
    assert not (tmp_path / "results.json").exists()  # rank 0's file is rank 0's
    ex._Stages(config, None, Share(rank=1, world=2, split=False), None, report, {}, {}, 0.0).write()  # batch way
    assert not (tmp_path / "results.json").exists()


def test_partial_results_of_other_options_are_refused_and_a_fresh_run_clears_them(tmp_path):
    config = ex.RunConfig(**{**ex.PRESETS["smoke"], "encodings": ("alibi", "none"), "steps": 4, "out": str(tmp_path),
                             "plot": False, "progress": False})
    ex.run(config)
    _split_off(tmp_path, "none")
    stale = tmp_path / ex.PARTIAL / "rank1" / "results.json"
    saved = json.loads(stale.read_text())
    saved["config"]["steps"] = 5
    stale.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"partial/rank1/results.json.*steps"):
        ex.run(ex.RunConfig(**{**ex.asdict(config), "resume": True}))
    ex.run(config)  # not resuming: the stale partial results are removed before any work
    assert not (tmp_path / ex.PARTIAL).exists()


def test_parallel_must_be_a_known_way():
    with pytest.raises(ValueError, match=r"parallel must be one of 'runs', 'batch'; got 'threads'"):
        ex.RunConfig(parallel="threads")
