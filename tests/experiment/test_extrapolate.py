"""relpos extrapolate (text): runs every model, reports n/a past the learned table, resumes, scales out."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relpos.experiment import cli
from relpos.experiment import runner as ex
from relpos.experiment.data import eval_windows, load_corpus, sample_batch, stdlib_corpus
from relpos.experiment.model import LMConfig, TransformerLM
from relpos._process import exit_process
from relpos.experiment.problems import TextProblem
from relpos.experiment.variants import MODELS, ROPE_SCALING_ROWS, models


def smoke(tmp_path, **changes):
    config = ex.RunConfig(**{**ex.PRESETS["smoke"], "out": str(tmp_path), "progress": False, **changes})
    return config


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("extrapolate")
    return out, ex.run(ex.RunConfig(**{**ex.PRESETS["smoke"], "out": str(out), "progress": False}))


def test_every_encoding_trained_and_evaluated(smoke_report):
    out, report = smoke_report
    scaled = [f"rope + {k}" for k in ROPE_SCALING_ROWS]
    at = MODELS.index("rope") + 1
    assert list(report["runs"]) == [*MODELS[:at], *scaled, *MODELS[at:]]
    lengths = [str(16 * m) for m in (1, 2, 4, 8, 16)]
    for name, seeds in report["runs"].items():
        r = seeds["0"]
        assert r["train_loss"] < 5.6  # below uniform over 256 bytes (ln 256 = 5.55) after 12 steps: it learned
        for n in lengths:
            e = r["eval"][n]
            if name == "learned" and n != "16":
                assert e is None  # past its table: not applicable, not a crash
            else:
                assert 0 < e["bits_per_byte"] < 9 and e["perplexity"] > 1
    runs = report["runs"]
    assert runs["alibi"]["0"]["position_parameters"] == 0
    assert runs["t5"]["0"]["position_parameters"] == 32 * 2  # one table shared by both layers
    # max_distance above the largest trained distance (15), raised just above the exact range (32 buckets, causal: 16)
    assert runs["t5"]["0"]["model"]["max_distance"] == 17 and runs["t5_md128"]["0"]["model"]["max_distance"] == 128
    assert runs["clipped"]["0"]["model"]["clip_distance"] == 16  # R = the training length: nothing trained is clipped
    attention = runs["alibi"]["0"]["attention"]
    assert set(attention) == {"16", "256"} and sum(attention["256"]["share"]) == pytest.approx(1.0)
    assert runs["shaw"]["0"]["attention"]["16"] is None  # its own attention path: not covered
    # within the training length the oracle scalings and dynamic NTK are the identity: the same numbers as plain
    # RoPE; the fixed factor (16 here: the longest length over the training length) already changes 1x
    rope_1x = runs["rope"]["0"]["eval"]["16"]["bits_per_byte"]
    for kind in ("dynamic", "linear-oracle", "yarn-oracle", "llama3-oracle"):
        assert runs[f"rope + {kind}"]["0"]["eval"]["16"]["bits_per_byte"] == pytest.approx(rope_1x)
    assert report["rope_factor"] == 16.0
    assert runs["rope + linear"]["0"]["eval"]["16"]["bits_per_byte"] != pytest.approx(rope_1x, abs=1e-6)
    assert runs["rope + linear"]["0"]["eval"]["256"]["bits_per_byte"] == pytest.approx(
        runs["rope + linear-oracle"]["0"]["eval"]["256"]["bits_per_byte"])  # at the longest length the two agree
    saved = json.loads((out / "results.json").read_text())
    assert saved["environment"]["relpos"] and saved["environment"]["torch"] == torch.__version__
    table = (out / "results.md").read_text()
    assert "| learned absolute |" in table and "| n/a |" in table and "| RoPE + yarn, fixed factor (eval only) | same as RoPE |" in table


def test_plot_is_written_and_not_blank(smoke_report):
    import matplotlib.image as mpimg

    out, _ = smoke_report
    image = mpimg.imread(out / "extrapolate.png")
    assert image.shape[0] > 300 and image.shape[1] > 500
    assert image[..., :3].std() > 0.05  # lines and text, not an empty canvas


def test_same_data_order_for_every_encoding():
    corpus = stdlib_corpus(max_bytes=50_000)
    a = sample_batch(corpus.train, 4, 16, torch.Generator().manual_seed(7))
    b = sample_batch(corpus.train, 4, 16, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])


def test_stdlib_split_is_deterministic_and_disjoint():
    one, two = stdlib_corpus(max_bytes=100_000), stdlib_corpus(max_bytes=100_000)
    assert torch.equal(one.train, two.train) and torch.equal(one.val, two.val)
    assert "stdlib" in one.source
    x, y = eval_windows(one.val, 32, 5)
    assert x.shape == (5, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_resume_continues_where_it_stopped(tmp_path, monkeypatch):
    straight = ex.run(smoke(tmp_path / "a", encodings=("t5",), checkpoint_every=6))

    real = ex.train_steps

    def crash_after_step_8(model, optimizer, problem, config, seed, start, stop, **kw):
        real(model, optimizer, problem, config, seed, start, min(stop, 8), **kw)
        if stop > 8:
            raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(ex, "train_steps", crash_after_step_8)
    with pytest.raises(KeyboardInterrupt):
        ex.run(smoke(tmp_path / "b", encodings=("t5",), checkpoint_every=6))
    monkeypatch.setattr(ex, "train_steps", real)
    state = torch.load(tmp_path / "b" / "checkpoints" / "t5.lr0.003.seed0.pt", weights_only=True)
    assert state["step"] == 6
    resumed = ex.run(smoke(tmp_path / "b", encodings=("t5",), checkpoint_every=6, resume=True))
    for n, e in straight["runs"]["t5"]["0"]["eval"].items():
        assert resumed["runs"]["t5"]["0"]["eval"][n]["bits_per_byte"] == pytest.approx(e["bits_per_byte"], abs=1e-5)


def test_ablations_build_the_t5_variants():
    sizes = dict(dim=32, layers=1, heads=2, train_len=16, vocab=256)
    assert [n for n, _ in models(MODELS, buckets=(8, 16), **sizes)] == ["t5 8 buckets", "t5 16 buckets"]
    runs = models(MODELS, bucketing=("log", "uniform"), **sizes)
    assert [c.strategy for _, c in runs] == ["log", "uniform"] and all(c.encoding == "t5" for _, c in runs)


def test_corpus_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text: it is empty"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 10)
    with pytest.raises(ValueError, match="looks binary"):
        load_corpus(tmp_path / "blob.bin")
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing.txt")
    text = tmp_path / "book.txt"
    text.write_text("the cat sat on the mat. " * 400)
    corpus = load_corpus(text)
    assert corpus.train.numel() > corpus.val.numel() > 0


def test_cli_arguments_are_validated():
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(ValueError, match="--encodings: unknown"):
        cli.config_from_args(parser.parse_args(["--encodings", "t5,fourier"]))
    with pytest.raises(ValueError, match="--bucketing must be among"):
        cli.config_from_args(parser.parse_args(["--bucketing", "cubic"]))
    with pytest.raises(ValueError, match="--steps must be positive"):
        cli.config_from_args(parser.parse_args(["--steps", "0"]))
    with pytest.raises(ValueError, match="--rope-scalings must be among"):
        cli.config_from_args(parser.parse_args(["--rope-scalings", "ntk"]))
    for bad in ("0", "1,1", "-1,2", "a"):
        with pytest.raises(ValueError, match="--seeds"):
            cli.config_from_args(parser.parse_args([f"--seeds={bad}"]))
    assert cli.config_from_args(parser.parse_args(["--seeds", "3"])).seeds == (0, 1, 2)
    assert cli.config_from_args(parser.parse_args(["--seeds", "4,7"])).seeds == (4, 7)
    assert cli.config_from_args(parser.parse_args([])).seeds == (0, 1, 2)  # the default run has three seeds


def test_model_decodes_with_caches_like_parallel():
    torch.manual_seed(0)
    for encoding in ("t5", "rope", "sinusoidal", "shaw"):
        model = TransformerLM(LMConfig(encoding=encoding, dim=32, layers=2, heads=2, train_len=16)).eval()
        tokens = torch.randint(0, 256, (1, 12))
        with torch.no_grad():
            full = model(tokens)
            caches = [ex_cache() for _ in model.blocks]
            steps = torch.cat([model(tokens[:, t : t + 1], caches=caches) for t in range(12)], dim=1)
        assert torch.allclose(steps, full, atol=1e-4), encoding


def ex_cache():
    from relpos import KVCache

    return KVCache()


# --- scale-out ---------------------------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(encoding="t5", dim=32, layers=2, heads=2, train_len=16))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ex.RunConfig(**{**ex.PRESETS["smoke"], "batch": 8})
    problem = TextProblem(stdlib_corpus(max_bytes=100_000), train_len=16, multipliers=(1,), eval_tokens=64)
    losses = ex.train_steps(ddp, optimizer, problem, config, 0, 0, 1, rank=rank, world=world)
    table = model.position.relative_attention_bias.weight
    torch.save({"loss": losses[0], "weight": table.detach().clone(), "grad": table.grad.clone()}, f"{out}/rank{rank}.pt")
    del ddp  # its reducer holds the process group: gone before the group is
    exit_process(0)  # a barrier, the group destroyed, no interpreter teardown (a gloo thread can abort it)


def test_ddp_two_processes_keep_the_shared_table_identical(tmp_path, free_port):
    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert a["loss"] != b["loss"]  # each rank saw its own half of the batch ...
    assert torch.equal(a["grad"], b["grad"])  # ... and DDP averaged the gradients
    assert torch.equal(a["weight"], b["weight"])
    assert a["grad"].abs().sum() > 0


def test_torchrun_runs_the_cli_unchanged(tmp_path, free_port):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        "-m", "relpos.experiment", "--preset", "smoke", "--encodings", "alibi", "--steps", "3",
        "--out", str(tmp_path), "--no-plot", "--no-progress",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["world_size"] == 2 and "alibi" in report["runs"]


def test_ablation_run_prints_the_ablation_table(tmp_path):
    report = ex.run(smoke(tmp_path, buckets=(8, 16), steps=3, plot=False))
    table = (tmp_path / "results.md").read_text()
    assert "| Buckets | Params (bias) | Train PPL | Test PPL | Length Gen (2x) |" in table
    rows = [line for line in table.splitlines() if line.startswith(("| 8 |", "| 16 |"))]
    assert len(rows) == 2 and rows[0].split("|")[2].strip() == str(8 * 2)  # 8 buckets x 2 heads
    assert set(report["runs"]) == {"t5 8 buckets", "t5 16 buckets"}


def test_resume_refuses_changed_options(tmp_path):
    ex.run(smoke(tmp_path, encodings=("alibi",), steps=4, plot=False))
    with pytest.raises(ValueError, match=r"--resume: .* other options \(steps: saved 4, requested 6\)"):
        ex.run(smoke(tmp_path, encodings=("alibi",), steps=6, plot=False, resume=True))
    (tmp_path / "results.json").unlink()  # only the checkpoint is left: it is checked too
    with pytest.raises(ValueError, match=r"checkpoint .* other options \(dim: .*"):
        ex.run(smoke(tmp_path, encodings=("alibi",), steps=4, dim=48, plot=False, resume=True))


def test_options_are_validated_before_training(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    bad = {
        ("--checkpoint-every", "0"): "--checkpoint-every must be positive",
        ("--multipliers", "0"): "--multipliers must be positive",
        ("--lr", "inf"): "--lr must be a finite number > 0",
        ("--encodings", ""): "--encodings is empty",
    }
    for argv, message in bad.items():
        with pytest.raises(ValueError, match=message):
            cli.config_from_args(parser.parse_args(["--preset", "smoke", *argv]))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="is not a writable folder"):
        ex.run(smoke(blocker / "out", encodings=("alibi",)))
    with pytest.raises(ValueError, match="shorter than one evaluation window"):
        ex.run(smoke(tmp_path / "o", encodings=("alibi",), multipliers=(100000,)))


def test_non_finite_results_are_valid_json(tmp_path):
    from relpos._io import json_safe

    assert json.loads(json.dumps(json_safe({"a": float("nan"), "b": [float("inf"), 1.5]}))) == {"a": "nan", "b": ["inf", 1.5]}
    report = ex.run(smoke(tmp_path, encodings=("alibi",), steps=3, lr=1e30, plot=False))  # diverges
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON parses
    loss = saved["runs"]["alibi"]["0"]["train_loss"]
    assert loss in ("nan", "inf")  # lr=1e30 diverges: the loss is saved as the string JSON can hold
    table = (tmp_path / "results.md").read_text()
    assert "| ALiBi |" in table and report
    cell = report["summary"]["alibi"]["eval"]["16"]
    assert cell is not None and not math.isfinite(cell["mean"])  # a diverged seed is not hidden


def test_ctrl_c_is_one_line_and_resumable(tmp_path, monkeypatch, capsys):
    import argparse

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(ex, "run", interrupted)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run_from_args(parser.parse_args(["--preset", "smoke", "--out", str(tmp_path)])) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err


def _checkpoints(out) -> list:
    """(name, mtime) of every checkpoint a run has written so far: changes at each checkpoint write.

    The writer's temporary files (``.name.pt.XXXX.pt``, renamed into place) are skipped, and a file
    renamed between the listing and its ``stat`` is read at the next poll."""
    found = []
    for p in (out / "checkpoints").glob("*.pt"):
        if p.name.startswith("."):
            continue
        try:
            found.append((p.name, p.stat().st_mtime_ns))
        except FileNotFoundError:
            continue
    return sorted(found)


def test_killed_runs_resume_to_the_uninterrupted_numbers(tmp_path):
    """SIGKILL a run 3 times mid-training (after a random number of checkpoint writes, so the kills land
    whatever the machine's speed), resume each time: the final numbers equal an uninterrupted run."""
    import random
    import signal
    import time

    common = ["--preset", "smoke", "--encodings", "alibi,t5", "--seeds", "0,1", "--steps", "30", "--checkpoint-every", "1",
              "--no-plot", "--no-progress"]
    straight = tmp_path / "straight"
    subprocess.run([sys.executable, "-m", "relpos.experiment", *common, "--out", str(straight)], check=True,
                   capture_output=True, timeout=300)
    out = tmp_path / "killed"
    rng = random.Random(0)
    kills = 0
    for attempt in range(10):
        proc = subprocess.Popen([sys.executable, "-m", "relpos.experiment", *common, "--out", str(out), "--resume"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if kills < 3:
            writes, target, last = 0, rng.randint(1, 8), _checkpoints(out)
            while proc.poll() is None and writes < target:  # 120 checkpoint writes in all: 3 kills land mid-run
                time.sleep(0.005)
                now = _checkpoints(out)
                writes, last = writes + (now != last), now
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        if proc.wait(timeout=300) == 0:
            break
    assert kills == 3 and (out / "results.json").exists()
    a = json.loads((straight / "results.json").read_text())
    b = json.loads((out / "results.json").read_text())
    for name in ("alibi", "t5"):
        for seed in ("0", "1"):
            for n, e in a["runs"][name][seed]["eval"].items():
                got = b["runs"][name][seed]["eval"][n]["bits_per_byte"]
                assert got == pytest.approx(e["bits_per_byte"], abs=1e-5), (name, seed, n)
        for n, cell in a["summary"][name]["eval"].items():
            assert b["summary"][name]["eval"][n]["mean"] == pytest.approx(cell["mean"], abs=1e-5)


def test_small_corpora_split_whatever_their_file_names(tmp_path):
    """Three small files, or one file under any name: the split no longer depends on how names hash."""
    folder = tmp_path / "three"
    folder.mkdir()
    for i in range(3):
        (folder / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 400)
    corpus = load_corpus(folder)
    assert corpus.train.numel() > corpus.val.numel() > 1000
    for name in ("latin1.txt", "notes.txt", "a.txt", "zzz.txt"):
        single = tmp_path / name
        single.write_bytes(b"the cat sat on the mat. " * 1400)  # 33.6 KB
        corpus = load_corpus(single)
        assert corpus.train.numel() > corpus.val.numel() > 1000, name


def test_plot_gives_every_model_its_own_colour(tmp_path, monkeypatch):
    from relpos.experiment import report as reporting
    from relpos.experiment.variants import ALL_MODELS

    names = [*ALL_MODELS, *(f"rope + {s}" for s in ROPE_SCALING_ROWS)]  # more than tab10 + Dark2's 18 colours
    seen = {}
    monkeypatch.setattr(reporting, "_draw", lambda ax, report, drawn, colours, percent: seen.update(colours))
    report = {"metric": "bits_per_byte", "summary": dict.fromkeys(names), "config": {"seeds": [0]}, "problem": "text"}
    reporting.plot(report, tmp_path / "p.png")
    assert set(seen) == set(names) and len(set(seen.values())) == len(names)


def test_the_default_runs_time_is_quoted_from_its_measurement():
    """The default run's minutes come from one measured place: the committed default run's wall time. The CLI's
    help and the pages quote that number and no other."""
    import json
    import pathlib

    from relpos.experiment import cli

    root = pathlib.Path(__file__).resolve().parents[2]
    measured = json.loads((root / "docs" / "extrapolate" / "default" / "results.json").read_text())["wall_seconds"]
    minutes = cli.DEFAULT_MINUTES["extrapolate"]
    assert round(measured / 60) == minutes
    assert f"about {minutes} minutes on 2 cores" in " ".join(cli.build_parser(tasks=False).format_help().split())
    running = (root / "docs" / "experiments" / "running.md").read_text()
    assert f"the default run: about {minutes} minutes" in running and f"about {minutes} min (text" in running
