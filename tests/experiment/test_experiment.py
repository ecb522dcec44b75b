"""The experiment's parts: embedding scale, seed statistics, the algorithmic tasks, RoPE-scaling rows,
resuming with seeds, and ``relpos tasks`` end to end."""

import json
import math
import statistics

import numpy as np
import pytest
import torch

from relpos import RotaryEmbedding, SinusoidalPositionEmbedding
from relpos.experiment import cli
from relpos.experiment import runner as ex
from relpos.experiment.model import LMConfig, TransformerLM
from relpos.experiment.problems import TaskProblem, rotary_swapped
from relpos.experiment.report import ranking, reciprocal_ranks, summarize_runs
from relpos.experiment.stats import paired_difference, summarize, t_quantile_975
from relpos.experiment.tasks import BOS, PAD, PLUS, SEP, TASKS, make_batch
from relpos.experiment.variants import rope_scaling

# --- the absolute baselines -------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["sinusoidal", "learned", "none", "alibi"])
def test_token_embeddings_are_scaled_by_sqrt_dim_in_every_model(encoding):
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(encoding=encoding, dim=32, layers=1, heads=2, train_len=16))
    tokens = torch.randint(0, 256, (2, 10))
    expected = model.embed.weight[tokens] * math.sqrt(32)  # (B, L, D): Vaswani et al. 3.4
    if encoding == "sinusoidal":
        expected = expected + SinusoidalPositionEmbedding(32).table(torch.arange(3, 13))
    if encoding == "learned":
        expected = expected + model.absolute.weight[3:13]
    assert torch.allclose(model.embed_tokens(tokens, offset=3), expected, atol=1e-6)


# --- statistics over seeds ------------------------------------------------------------------


def test_summary_statistics_match_numpy_and_the_t_table():
    values = [2.31, 2.27, 2.35, 2.29]
    s = summarize(values)
    assert s["mean"] == pytest.approx(np.mean(values))
    assert s["std"] == pytest.approx(np.std(values, ddof=1))
    assert s["ci95"] == pytest.approx(3.182 * np.std(values, ddof=1) / 2)  # t(0.975, 3) = 3.182
    assert (s["min"], s["max"], s["n"]) == (2.27, 2.35, 4)
    assert summarize([1.5])["std"] is None and summarize([])["mean"] is None
    assert math.isnan(summarize([1.0, float("nan")])["mean"])  # a diverged seed is not averaged away
    for df, exact in ((1, 12.706), (2, 4.303), (10, 2.228), (30, 2.042), (60, 2.000), (120, 1.980)):
        assert t_quantile_975(df) == pytest.approx(exact, abs=3e-3)
    with pytest.raises(ValueError, match="df must be >= 1"):
        t_quantile_975(0)


def test_paired_difference_removes_what_seeds_share():
    a = [2.0, 2.5, 3.0]  # the seeds differ a lot ...
    b = [1.9, 2.41, 2.9]  # ... but b is lower by ~0.1 in every seed
    d = paired_difference(a, b)
    assert d["mean"] == pytest.approx(statistics.mean([0.1, 0.09, 0.1]))
    assert d["significant"]
    assert not paired_difference([2.0, 2.5, 3.0], [2.1, 2.3, 3.05])["significant"]
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference([1.0], [1.0, 2.0])


def test_summarize_runs_aggregates_each_cell_over_seeds():
    run = lambda v, se: {"train_loss": 1.0, "eval": {"8": {"accuracy": v, "se": se}, "16": None}}  # noqa: E731
    report = {"metric": "accuracy", "lengths": [8, 16], "runs": {"a": {"0": run(0.5, 0.02), "1": run(0.7, 0.04), "2": run(0.9, 0.03)}}}
    cell = summarize_runs(report)["a"]["eval"]
    assert cell["8"]["mean"] == pytest.approx(0.7) and cell["8"]["std"] == pytest.approx(0.2)
    assert cell["8"]["se"] == pytest.approx(0.03) and cell["8"]["values"] == [0.5, 0.7, 0.9]
    assert cell["16"] is None  # not applicable stays not applicable


def test_reciprocal_rank_and_mrr():
    assert reciprocal_ranks({"a": 0.9, "b": 0.1, "c": 0.5}) == {"a": 1.0, "b": 1 / 3, "c": 0.5}
    report = lambda accs, seeds=1: {  # noqa: E731
        "lengths": [4, 8], "trained_lengths": [4],
        "summary": {n: {"eval": {"4": {"mean": 1.0}, "8": None if a is None else {"mean": a}}} for n, a in accs.items()},
        "runs": {n: {str(k): {"eval": {"4": {"accuracy": 1.0}, "8": None if a is None else {"accuracy": a}}}
                     for k in range(seeds)} for n, a in accs.items()},
    }
    r = ranking({"t1": report({"x": 0.8, "y": 0.2, "z": None}), "t2": report({"x": 0.1, "y": 0.6, "z": 0.0})})
    assert r["tasks"]["t1"]["accuracy"] == {"x": 0.8, "y": 0.2, "z": 0.0}  # n/a counts as no correct answer
    assert r["mrr"] == {"x": pytest.approx(0.75), "y": pytest.approx(0.75), "z": pytest.approx(1 / 3)}
    flat = ranking({"t1": report({"x": 0.8, "y": 0.2, "z": None}), "t3": report({"x": 0.0, "y": 0.0, "z": 0.0})})
    assert flat["uninformative"] == ["t3"]  # all tied: it ranks nothing and is left out of the mean
    assert flat["mrr"] == {"x": 1.0, "y": 0.5, "z": pytest.approx(1 / 3)}
    # seeds that agree: the bootstrap interval of the MRR is the point itself
    same = ranking({"t1": report({"x": 0.8, "y": 0.2, "z": None}, 5), "t2": report({"x": 0.1, "y": 0.6, "z": 0.0}, 5)})
    assert same["mrr_ci95"]["x"] == pytest.approx([0.75, 0.75]) and same["mrr_ci95"]["z"] == pytest.approx([1 / 3, 1 / 3])
    # seeds that disagree on the order of x and y: the interval spans both ranks
    split = report({"x": 0.8, "y": 0.2, "z": 0.0}, 5)
    for k, (x, y) in enumerate([(0.9, 0.1), (0.9, 0.1), (0.1, 0.9), (0.1, 0.9), (0.9, 0.1)]):
        split["runs"]["x"][str(k)]["eval"]["8"]["accuracy"], split["runs"]["y"][str(k)]["eval"]["8"]["accuracy"] = x, y
    wide = ranking({"t1": split})["mrr_ci95"]
    assert wide["x"] == pytest.approx([0.5, 1.0]) and wide["y"] == pytest.approx([0.5, 1.0])


# --- the algorithmic tasks ------------------------------------------------------------------


def _digits(tokens):
    return [int(t) for t in tokens]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_answers_are_correct_and_deterministic(name):
    task = TASKS[name]
    for n in (1, 3, 7, 20):
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        (tokens, start), (again, _) = task.sample(n, g1), task.sample(n, g2)
        assert torch.equal(tokens, again)  # the same seed gives the same instance
        assert tokens[0] == BOS and tokens[start - 1] == SEP and tokens.numel() == task.sequence_length(n)
        prompt, answer = _digits(tokens[1 : start - 1]), _digits(tokens[start:])
        if name == "addition":
            a, b = prompt[:n], prompt[n + 1 :]
            assert prompt[n] == PLUS and len(a) == len(b) == n
            value = lambda ds: sum(d * 10**i for i, d in enumerate(ds))  # noqa: E731 (least significant first)
            assert value(answer) == value(a) + value(b) and len(answer) == n + 1
        elif name in ("parity", "summation"):
            assert len(prompt) == n and len(answer) == 1
            assert answer == [sum(prompt) % (2 if name == "parity" else 10)]
            assert name != "parity" or set(prompt) <= {0, 1}
        else:
            assert len(prompt) == len(answer) == n
            assert answer == {"copy": prompt, "reverse": prompt[::-1], "sort": sorted(prompt)}[name]
    other = task.sample(12, torch.Generator().manual_seed(6))[0]
    assert not torch.equal(other, task.sample(12, torch.Generator().manual_seed(5))[0])


def test_batches_mask_everything_but_the_answer():
    x, y = make_batch(TASKS["copy"], [2, 4], torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (2, 2 * 4 + 1)  # BOS, 4 digits, SEP, 4 digits, minus the last
    assert (y[0] != -100).sum() == 2 and (y[1] != -100).sum() == 4
    assert (x[0, 5:] == PAD).all() and x[0, 4] != PAD  # the short instance is right-padded
    answer = y[1] != -100
    assert torch.equal(y[1][answer], x[1, 1:5])  # the copy of the prompt is what is predicted


def test_training_lengths_and_test_lengths_are_as_asked():
    problem = TaskProblem("reverse", train_max=8, test_lengths=(4, 8, 16, 32), eval_instances=8)
    seen = set()
    for step in range(30):
        x, y = problem.batch(step, 16)
        seen |= set((y != -100).sum(dim=1).tolist())
    assert seen <= set(range(1, 9)) and {1, 8} <= seen  # 1 .. train_max, both ends drawn
    assert problem.train_len == 2 * 8 + 1 and problem.trained_lengths == [4, 8]


def test_exact_match_equals_greedy_decoding():
    """The teacher-forced all-argmax metric equals decoding the answer greedily token by token."""
    torch.manual_seed(0)
    problem = TaskProblem("copy", train_max=4, test_lengths=(3,), eval_instances=64)
    model = TransformerLM(LMConfig(encoding="alibi", dim=32, layers=1, heads=2, train_len=9, vocab=14)).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = ex.RunConfig(steps=40, batch=32, lr=3e-3)
    ex.train_steps(model, optimizer, problem, config, 0, 0, 40)
    accuracy = problem.evaluate(model)["3"]["accuracy"]
    generator = torch.Generator().manual_seed(1_000_003 * 3 + 17)  # the evaluation's own test set
    x, y = make_batch(TASKS["copy"], [3] * 64, generator)
    correct = 0
    with torch.no_grad():
        for row in range(64):
            start = int((y[row] != -100).nonzero()[0])  # the last prompt token predicts the first answer token
            seq = x[row, : start + 1].tolist()
            for _ in range(3):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            correct += seq[start + 1 :] == y[row, start : start + 3].tolist()
    assert accuracy == correct / 64 and 0 < accuracy  # it learned something, and the two agree


# --- RoPE scaling rows ------------------------------------------------------------------------


def test_rope_scaling_rows_use_transformers_parameters():
    assert rope_scaling("linear-oracle", 16, 64, 64, 16.0).scaling is None  # the oracle at the training length: identity
    assert rope_scaling("yarn", 16, 256, 64, 16.0).scaling == {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}
    assert rope_scaling("yarn-oracle", 16, 256, 64, 16.0).scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    llama = rope_scaling("llama3-oracle", 16, 128, 64, 16.0).scaling
    assert llama["factor"] == 2.0 and llama["low_freq_factor"] == 1.0 and llama["high_freq_factor"] == 4.0
    dynamic = rope_scaling("dynamic", 16, 1024, 64, 16.0)
    assert dynamic.scaling["factor"] == 1.0  # the base grows with each position by itself
    assert torch.allclose(dynamic.frequencies(1024), RotaryEmbedding(16, base=10000 * 16 ** (16 / 14)).inv_freq, rtol=1e-5)
    with pytest.raises(ValueError, match="rope scaling must be one of"):
        rope_scaling("ntk", 16, 128, 64, 16.0)


def test_rotary_swap_reaches_every_layer_and_is_undone():
    model = TransformerLM(LMConfig(encoding="rope", dim=32, layers=2, heads=2, train_len=16))
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        plain = model(tokens)
        scaled = rope_scaling("linear-oracle", 16, 40, 16, 4.0)
        with rotary_swapped(model, scaled):
            assert all(b.attn.position is scaled for b in model.blocks)
            changed = model(tokens)
        assert torch.equal(model(tokens), plain) and not torch.allclose(changed, plain)


# --- seeds, resume, the tasks command ---------------------------------------------------------


def _smoke(tmp_path, **changes):
    return ex.RunConfig(**{**ex.PRESETS["smoke"], "out": str(tmp_path), "progress": False, "plot": False,
                           "encodings": ("alibi",), **changes})


def test_resume_adds_seeds_and_keeps_finished_ones(tmp_path):
    first = ex.run(_smoke(tmp_path, seeds=(0,), rope_scalings=("yarn",)))  # ALiBi only, one seed
    both = ex.run(_smoke(tmp_path, seeds=(0, 1), resume=True, encodings=("alibi", "rope"), rope_scalings=("yarn",)))
    assert both["runs"]["alibi"]["0"] == json.loads(json.dumps(first["runs"]["alibi"]["0"]))  # reused, not retrained
    assert list(both["runs"]) == ["alibi", "rope", "rope + yarn"]  # a model added on resume, with its scaling row
    assert set(both["runs"]["rope"]) == set(both["runs"]["rope + yarn"]) == {"0", "1"}
    again = ex.run(_smoke(tmp_path, seeds=(0, 1), resume=True, encodings=("alibi", "rope"), rope_scalings=("yarn",)))
    assert again["runs"] == json.loads(json.dumps(both["runs"]))  # everything finished: all reused
    fresh = ex.run(_smoke(tmp_path / "fresh", seeds=(0, 1)))
    for seed in ("0", "1"):
        for n, e in fresh["runs"]["alibi"][seed]["eval"].items():
            assert both["runs"]["alibi"][seed]["eval"][n]["bits_per_byte"] == pytest.approx(e["bits_per_byte"], abs=1e-5)
    values = [fresh["runs"]["alibi"][s]["eval"]["16"]["bits_per_byte"] for s in ("0", "1")]
    assert values[0] != values[1]  # the seeds differ ...
    assert fresh["summary"]["alibi"]["eval"]["16"]["mean"] == pytest.approx(sum(values) / 2)  # ... and are averaged
    table = (tmp_path / "fresh" / "results.md").read_text()
    assert "Mean ± standard deviation over 2 seeds (0, 1)" in table and " ± " in table.splitlines()[2]


def test_tasks_command_runs_each_task_and_ranks(tmp_path, capsys):
    code = cli.main(["tasks", "--preset", "smoke", "--tasks", "copy,addition", "--encodings", "none,rope",
                     "--rope-scalings", "yarn", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    for task in ("copy", "addition"):
        report = json.loads((tmp_path / task / "results.json").read_text())
        assert set(report["runs"]) == {"none", "rope", "rope + yarn"} and report["metric"] == "accuracy"
        assert report["lengths"] == [2, 4, 8] and report["trained_lengths"] == [2, 4]
        for cell in report["runs"]["none"]["0"]["eval"].values():
            p = cell["accuracy"]
            assert cell["instances"] == 16 and p * 16 == int(p * 16) and 0 <= p <= 1  # a count of correct answers / 16
            assert cell["se"] == pytest.approx(math.sqrt(p * (1 - p) / 16))
        assert (tmp_path / task / "results.md").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["mrr"]) == {"none", "rope", "rope + yarn"}
    assert "MRR, the paper's five" in (tmp_path / "summary.md").read_text()
    assert "ranking past the training lengths" in capsys.readouterr().out


def test_tasks_options_are_validated(tmp_path):
    for argv, message in ((["--tasks", "division"], "--tasks must name"), (["--test-lengths", "8,4"], "increasing"),
                          (["--train-max", "0"], "--train-max must be positive"), (["--encodings", ""], "--encodings is empty")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["tasks", "--preset", "smoke", "--out", str(tmp_path), *argv])
        assert stop.value.code == 2, argv


def test_atomically_written_files_get_ordinary_permissions(tmp_path):
    import os

    from relpos._io import write_text

    mask = os.umask(0)
    os.umask(mask)
    write_text(tmp_path / "results.json", "{}")
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600
