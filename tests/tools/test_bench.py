"""relpos bench runs end to end at a tiny size and reports every variant (no timing assertions)."""

import json

import pytest

from relpos.tools.bench import BenchConfig, markdown_tables, ratio_summary, run_bench
from relpos.tools.cli import main


def test_bench_reports_every_variant():
    report = run_bench(BenchConfig(lengths=(64,), batches=(1,), rounds=1, flex=False))
    variants = {(r["mode"], r["variant"]) for r in report["results"]}
    assert ("train", "relpos_fused") in variants and ("forward", "hf_eager") in variants
    assert ("build", "hf_compute_bias") in variants and ("decode", "relpos_decode_step") in variants
    assert all(r["ms"] > 0 for r in report["results"])
    text = markdown_tables(report)
    assert "### forward" in text and "### train" in text and "| 1 | 64 |" in text
    assert len(ratio_summary(report, 64)) == 13 + 4 + 7  # + causal 2 per batch size x 2, padded 2, memory 3, dropout 2
    for mode in ("causal_forward", "causal_train", "padded_forward", "padded_train", "dropout_train"):
        assert (mode, "relpos_auto") in variants and f"### {mode}" in text
    assert report["machine"]["torch"] and report["machine"]["transformers"]


def test_bench_cli_writes_json_and_markdown(tmp_path, capsys):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    assert main(["bench", "--lengths", "32", "--batches", "1", "--modes", "build,decode", "--rounds", "1",
                 "--json", str(out_json), "--markdown", str(out_md)]) == 0
    assert json.loads(out_json.read_text())["results"]
    markdown = out_md.read_text()
    captured = capsys.readouterr()
    assert "### build" in markdown and "machine:" in captured.out
    # redirected (no terminal, no bar): one plain line per finished point, with its times
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert any(" build B=1 L=32: hf_compute_bias " in line and line.endswith(" ms") for line in lines), lines
    assert any(" decode B=1 L=32: recompute_full_bias " in line for line in lines), lines
    # a short run's targets table says at which length it measured, and that the goals are for 4096
    assert "| target, measured at L=32 | measured | goal (set for L=4096) |" in markdown
    assert "Measured at L=32, not 4096" in markdown


@pytest.mark.parametrize("argv,phrase", [
    (["--lengths", "1000000"], "--lengths must be integers from 1 to 32768"),
    (["--lengths", "0"], "--lengths must be integers from 1 to 32768"),
    (["--lengths", "a,b"], "--lengths must be comma-separated integers"),
    (["--batches", "1000"], "--batches must be integers from 1 to 64"),
    (["--rounds", "0"], "--rounds must be from 1 to 100"),
])
def test_bench_sizes_are_bounded_before_any_work(capsys, argv, phrase):
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2 and phrase in capsys.readouterr().err


def test_eager_paths_benchmark_measures_each_encoding():
    """benchmarks/eager_paths.py end to end at a small length (no timing assertions)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "eager_paths.py"
    spec = importlib.util.spec_from_file_location("eager_paths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("shaw", "cope"):
        row = module.measure(name, length=64, steps=2)
        assert row["eval_rows"] == 128 and row["eval_ms"] > 0 and row["step_ms"] > 0


def test_the_gpu_variants_compute_the_same_attention():
    """On CUDA relpos bench adds relpos's Triton kernel and the hand-written FlexAttention a user would write (the
    per-offset vector gathered by kv - q in score_mod). Run here on CPU tensors (the kernel under Triton's
    interpreter, flex compiled for the CPU, inference): both equal relpos's eager reference."""
    import torch

    import relpos
    from relpos.tools import bench

    torch.manual_seed(0)
    length = 24
    ours = relpos.RelativePositionalBias(bench.HEADS)
    with torch.no_grad():
        ours.relative_attention_bias.weight.normal_(0, 1.0)
    q, k, v = (torch.randn(1, bench.HEADS, length, bench.HEAD_DIM) for _ in range(3))
    variants = bench._gpu_variants(q, k, v, ours, length, BenchConfig(flex=True))
    assert set(variants) == {"relpos_triton", "hand_flex"}
    with torch.no_grad():
        want = relpos.attention(q, k, v, bias=ours, scale=bench.SCALE, backend="eager")
        plain = relpos.attention(q, k, v, scale=bench.SCALE, backend="eager")
        assert (want - plain).abs().max() > 0.05  # the table matters here
        for name, run in variants.items():
            torch.testing.assert_close(run(), want, atol=2e-5, rtol=1e-5, msg=name)


def test_timed_rounds_freezes_the_old_objects_only_while_it_times():
    """The objects alive before the rounds are frozen while they run (measure()'s collection scans only what the
    calls made) and unfrozen after, also when a call fails."""
    import gc

    from relpos._measure import timed_rounds

    class Quiet:
        def step(self, *_):
            pass

        def log(self, *_):
            pass

    seen = []
    out = timed_rounds({"a": lambda: seen.append(gc.get_freeze_count())}, 2, Quiet(), "t", False)
    assert out["a"][0] >= 0 and seen[0] == 0 and all(n > 0 for n in seen[1:]) and gc.get_freeze_count() == 0
    calls = []

    def fails():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        timed_rounds({"b": fails}, 1, Quiet(), "t", False)
    assert gc.get_freeze_count() == 0


def test_profile_call_on_the_cpu_reports_the_operators_that_took_the_time():
    """profile_call: one unprofiled call, then ``calls`` profiled ones; per call the wall time, the operators' own
    time (busy) and the slowest operators first; no syncs and no attention share on the CPU (None, not 0)."""
    import torch

    from relpos._measure import profile_call

    a = torch.randn(256, 256)
    seen = []

    def work():
        seen.append(1)
        (a @ a).relu_()

    p = profile_call(work, cuda=False, calls=3)
    assert len(seen) == 4 and p["calls"] == 3
    assert p["syncs_per_call"] is None and p["attention_ms"] is None
    names = [name for name, _ in p["top"]]
    assert names[0] == "aten::mm" and "aten::relu_" in names, p["top"]  # the product dominates a ReLU
    times = [ms for _, ms in p["top"]]
    assert times == sorted(times, reverse=True) and 0 < p["busy_ms"] <= p["wall_ms"] * 1.5

