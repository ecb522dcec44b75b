"""The evidence issue: fair task settings, equal shared initial weights, honest RoPE scalings, the
bootstrap and Holm on known cases, held-out files, and resume across the sweep stage."""

import gzip
import json
import math
import os

import pytest
import torch

from relpos.encodings.buckets import relative_position_bucket
from relpos.experiment import runner as ex
from relpos.experiment.data import file_windows, load_corpus
from relpos.experiment.model import LMConfig, TransformerLM
from relpos.experiment.problems import TaskProblem
from relpos.experiment.stats import holm, paired_bootstrap
from relpos.experiment.tasks import TASKS
from relpos.experiment.variants import MODELS, ablation_max_distance, models, rope_scaling

SIZES = dict(dim=32, layers=2, heads=2, vocab=256)


# --- fair ranges ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["copy", "reverse", "addition", "parity"])
def test_every_range_covers_the_trained_distances(task):
    problem = TaskProblem(task, train_max=8, test_lengths=(8, 16), eval_instances=4)
    largest = problem.train_len - 1  # the longest trained input has positions 0 .. train_len - 1
    x, _ = problem.batch(0, 64)
    assert x.shape[1] - 1 <= largest  # no batch has a longer distance than that
    plan = dict(models(MODELS, train_len=problem.train_len, **SIZES))
    for name in ("t5", "t5_md128"):
        config = plan[name]
        assert config.max_distance > largest
        buckets = relative_position_bucket(-torch.arange(largest + 1), bidirectional=False, num_buckets=config.num_buckets,
                                           max_distance=config.max_distance)
        far = relative_position_bucket(torch.tensor([-config.max_distance]), bidirectional=False,
                                       num_buckets=config.num_buckets, max_distance=config.max_distance)
        assert int(far) not in buckets.tolist()  # no trained distance is lumped in with the far distances
    for name in ("clipped", "shaw"):
        assert plan[name].clip_distance >= problem.train_len  # no trained offset is clipped


def test_the_bucket_ablation_states_and_uses_one_max_distance():
    plan = models((), train_len=64, buckets=(8, 16, 32, 64, 128), **SIZES)
    distances = {c.max_distance for _, c in plan}
    assert distances == {ablation_max_distance(64, (8, 16, 32, 64, 128))} == {65}
    assert all(c.max_distance > c.num_buckets // 2 and c.max_distance > 63 for _, c in plan)


# --- shared initial weights ----------------------------------------------------------------------


def test_shared_layers_start_equal_across_encodings():
    reference = None
    for encoding in ("none", "learned", "sinusoidal", "t5", "shaw", "clipped", "rope", "alibi", "fire", "cope"):
        torch.manual_seed(3)
        shared = TransformerLM(LMConfig(encoding=encoding, train_len=16, **SIZES)).shared_parameters()
        if reference is None:
            reference = shared
            continue
        assert shared.keys() == reference.keys(), encoding
        for name, value in shared.items():
            assert torch.equal(value, reference[name]), (encoding, name)
    torch.manual_seed(4)
    other = TransformerLM(LMConfig(encoding="t5", train_len=16, **SIZES)).shared_parameters()
    assert not torch.equal(other["embed.weight"], reference["embed.weight"])  # the seed does matter


# --- RoPE scalings -------------------------------------------------------------------------------


def test_fixed_factor_does_not_depend_on_the_test_length():
    for kind in ("linear", "yarn", "llama3"):
        short, long = rope_scaling(kind, 16, 64, 64, 16.0), rope_scaling(kind, 16, 1024, 64, 16.0)
        assert short.scaling["factor"] == long.scaling["factor"] == 16.0
        assert torch.equal(short.inv_freq, long.inv_freq)
        oracle = rope_scaling(f"{kind}-oracle", 16, 256, 64, 16.0)
        assert oracle.scaling["factor"] == 4.0
        assert rope_scaling(f"{kind}-oracle", 16, 64, 64, 16.0).scaling is None  # 1x: the identity
    assert torch.equal(rope_scaling("linear", 16, 64, 64, 16.0).inv_freq,
                       rope_scaling("linear-oracle", 16, 1024, 64, 16.0).inv_freq)


def test_dynamic_ntk_is_per_position_as_transformers_decodes():
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, original = 16, 64
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=original,
                         rope_parameters={"rope_type": "dynamic", "factor": 1.0, "rope_theta": 10000.0})
    rope = rope_scaling("dynamic", head_dim, 1024, original, 16.0)
    positions = torch.tensor([0, 5, 63, 64, 100, 511, 1023])
    cos, sin = rope.cos_sin(positions)  # (7, d) each
    for row, p in enumerate(positions.tolist()):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=p + 1)  # transformers at decode step p
        angles = p * inv_freq.double()
        want = torch.cat([angles, angles])  # half-split layout
        assert torch.allclose(cos[row].double(), want.cos(), atol=2e-5), p
        assert torch.allclose(sin[row].double(), want.sin(), atol=2e-5), p
    # a token's rotation does not depend on how long the input is: the same rows at any length
    whole = rope.cos_sin(torch.arange(1024))[0]
    assert torch.equal(whole[positions], cos)
    # and it differs from the whole-window rule, which rotates position 100 with the base of 1024
    window = rope_scaling("dynamic", head_dim, 1024, original, 16.0)
    base = 10000.0 * (1024 / original) ** (head_dim / (head_dim - 2))
    assert not torch.allclose(cos[4], (100 / base ** (torch.arange(0, head_dim, 2) / head_dim)).cos().repeat(2))
    assert window.cos_sin(torch.tensor([10]))[0].shape == (1, head_dim)


# --- statistics ----------------------------------------------------------------------------------


def test_bootstrap_on_known_cases():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(3, 400, generator=g, dtype=torch.float64)
    shifted = paired_bootstrap(b + 0.25, b)  # a constant difference: no spread at all
    assert shifted["mean"] == pytest.approx(0.25) and shifted["low"] == pytest.approx(0.25) and shifted["high"] == pytest.approx(0.25)
    assert shifted["p"] == 0.0 and paired_bootstrap(b, b)["p"] == 1.0
    # one seed, iid differences: the bootstrap SE is the textbook sd / sqrt(n), the interval mean ± 1.96 SE
    d = torch.randn(1, 2000, generator=g, dtype=torch.float64) * 0.5 + 0.03
    r = paired_bootstrap(d, torch.zeros_like(d), resamples=4000)
    se = float(d.std()) / math.sqrt(d.numel())
    assert r["se"] == pytest.approx(se, rel=0.1)
    assert r["low"] == pytest.approx(r["mean"] - 1.96 * se, abs=0.3 * se)
    assert r["high"] == pytest.approx(r["mean"] + 1.96 * se, abs=0.3 * se)
    z = r["mean"] / se
    assert r["p"] == pytest.approx(math.erfc(abs(z) / math.sqrt(2)), rel=0.25)  # the normal two-sided p
    # a clear difference survives Holm over a family the size of the reference run's (960 comparisons):
    # a p floored at 2 / (1 + resamples) by counting resamples never could
    clear = paired_bootstrap(d + 0.05, torch.zeros_like(d), resamples=1000)
    assert clear["p"] < 0.05 / 960 and holm([clear["p"]] + [0.5] * 959)[0] < 0.05
    # no difference in expectation: about 5% of datasets reject at 5% (a binomial band for 200 datasets);
    # one seed, since resampling two seeds that do not differ widens the interval (conservative)
    rejected = sum(paired_bootstrap(torch.randn(1, 100, generator=g), torch.randn(1, 100, generator=g),
                                    resamples=400, seed=k)["p"] < 0.05 for k in range(200))
    assert 2 <= rejected <= 22
    # weights: a file with more windows counts more
    w = paired_bootstrap(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([3.0, 1.0]))
    assert w["mean"] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="seeds, files"):
        paired_bootstrap(torch.zeros(2, 3), torch.zeros(3, 2))


def test_holm_against_a_hand_computed_case():
    # sorted: 0.01 (x4 = 0.04), 0.02 (x3 = 0.06), 0.03 (x2 = 0.06), 0.5 (x1)
    assert holm([0.5, 0.01, 0.03, 0.02]) == pytest.approx([0.5, 0.04, 0.06, 0.06])
    assert holm([0.9, 0.9]) == [1.0, 1.0]


# --- held-out files ------------------------------------------------------------------------------


def test_windows_stay_inside_files_and_spread_over_them(tmp_path):
    files = tuple((f"f{i}", torch.arange(100 * (i + 1), dtype=torch.int64) % 251) for i in range(4))
    x, y, owner = file_windows(files, 30, 30 * 8)
    assert owner[:4] == [0, 1, 2, 3]  # the first window of every file before a second of any
    assert len(owner) == 8 and torch.equal(x[:, 1:], y[:, :-1])
    for row, i in enumerate(owner):
        stream = files[i][1]
        start = int((stream == x[row, 0]).nonzero()[0])
        assert torch.equal(stream[start : start + 31], torch.cat([x[row], y[row, -1:]]))
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(60):
        (folder / f"m{i}.py").write_text(f"x{i} = {i}\n" * 50)
    corpus = load_corpus(folder)
    names = {n for n, _ in corpus.test}
    assert 1 <= len(names) < 60 and "held-out test" in corpus.describe()
    for name, data in corpus.test:  # a held-out file is in neither training nor validation
        text = (folder / name).read_bytes()
        assert bytes(data.tolist()) == text
        assert text not in bytes(corpus.train.tolist()) and text not in bytes(corpus.val.tolist())


# --- tasks ---------------------------------------------------------------------------------------


def test_parity_and_summation_answers():
    assert TASKS["parity"].instance([1, 0, 1, 1])[0].tolist()[-1] == 1
    assert TASKS["summation"].instance([9, 8, 7])[0].tolist()[-1] == 4
    digits, _ = TASKS["parity"].sample(50, torch.Generator().manual_seed(0))
    assert set(digits.tolist()[1:51]) <= {0, 1}


# --- the staged run ------------------------------------------------------------------------------


def _config(out, **changes):
    return ex.RunConfig(**{**ex.PRESETS["smoke"], "out": str(out), "progress": False, "plot": False,
                           "encodings": ("t5", "rope"), "rope_scalings": ("dynamic", "linear"),
                           "lrs": (1e-3, 3e-3), "eval_every": 4, "seeds": (0, 1), **changes})


def test_sweep_curves_comparisons_and_resume_across_stages(tmp_path, monkeypatch, capsys):
    straight = ex.run(_config(tmp_path / "a"))
    assert set(straight["sweep"]["t5"]) == {"0.001", "0.003"}
    chosen = straight["chosen_lr"]["t5"]
    best = min(straight["sweep"]["t5"], key=lambda k: straight["sweep"]["t5"][k]["val"])
    assert chosen == float(best)
    run0 = straight["runs"]["t5"]["0"]
    assert run0["lr"] == chosen and [s for s, _ in run0["curve"]] == [0, 4, 8, 12]
    assert run0["curve"][-1][1] == pytest.approx(straight["sweep"]["t5"][best]["val"])  # the sweep's run is reused
    assert "t5_buckets" in run0 and run0["t5_buckets"]["far_bucket_trained"] is False
    per_window = json.loads(gzip.decompress((tmp_path / "a" / "windows.json.gz").read_bytes()))
    owner = straight["windows"]["main"]["window_file"]["16"]
    bits = per_window["t5"]["0"]["main"]["16"]
    assert len(bits) == len(owner) and sum(bits) / len(bits) == pytest.approx(run0["eval"]["16"]["bits_per_byte"], abs=1e-4)
    files = sorted(set(owner))
    for k, f in enumerate(files):  # the file means the bootstrap reads are the means of each file's windows
        mine = [b for b, o in zip(bits, owner) if o == f]
        assert run0["eval"]["16"]["file_means"][k] == pytest.approx(sum(mine) / len(mine), abs=1e-4)
    assert "windows" not in run0["eval"]["16"] and len(run0["eval"]["256"]["by_position"]) == 16
    family = straight["comparisons"]
    assert family["family"] == len(family["comparisons"]) > 0 and "Holm" in family["correction"]
    assert "estimated time" in capsys.readouterr().err  # plain lines, even when not a terminal

    real = ex.train_steps

    def crash_in_the_main_stage(model, optimizer, problem, config, seed, start, stop, **kw):
        if seed == 1:  # the sweep (seed 0) and the first seed are done: seed 1 dies after step 8
            real(model, optimizer, problem, config, seed, start, min(stop, 8), **kw)
            raise KeyboardInterrupt("simulated crash")
        return real(model, optimizer, problem, config, seed, start, stop, **kw)

    monkeypatch.setattr(ex, "train_steps", crash_in_the_main_stage)
    with pytest.raises(KeyboardInterrupt):
        ex.run(_config(tmp_path / "b", checkpoint_every=4))
    assert (tmp_path / "b" / "checkpoints" / "t5.lr0.003.seed1.pt").exists() or (
        tmp_path / "b" / "checkpoints" / "t5.lr0.001.seed1.pt").exists()
    monkeypatch.setattr(ex, "train_steps", real)
    resumed = ex.run(_config(tmp_path / "b", resume=True, checkpoint_every=4))
    assert resumed["sweep"] == straight["sweep"] or all(
        resumed["sweep"][m][k]["val"] == pytest.approx(straight["sweep"][m][k]["val"], abs=1e-6)
        for m in straight["sweep"] for k in straight["sweep"][m])
    for name in straight["runs"]:
        for seed in ("0", "1"):
            for n, e in straight["runs"][name][seed]["eval"].items():
                assert resumed["runs"][name][seed]["eval"][n]["bits_per_byte"] == pytest.approx(e["bits_per_byte"], abs=1e-5)


# --- randomized positions and the attention diagnostic ------------------------------------------


def test_randomized_positions_are_sorted_draws_fixed_at_evaluation():
    from relpos.experiment.model import RandomizedRotary

    plan = dict(models(("rope_randomized",), train_len=16, max_positions=256, **SIZES))
    config = plan["rope_randomized"]
    assert config.encoding == "rope" and config.randomized_positions == 256
    model = TransformerLM(config)
    rope = model.position
    assert isinstance(rope, RandomizedRotary) and all(b.attn.position is rope for b in model.blocks)
    model.train()
    model(torch.randint(0, 256, (2, 16)))
    first = rope._positions.clone()
    model(torch.randint(0, 256, (2, 16)))
    assert not torch.equal(first, rope._positions) and int(rope.draws) == 2  # a new draw per training batch
    for p in (first, rope._positions):
        assert p.numel() == 16 and bool((p[1:] > p[:-1]).all()) and 0 <= int(p.min()) and int(p.max()) < 256
    model.eval()
    model(torch.randint(0, 256, (1, 64)))
    fixed = rope._positions.clone()
    model(torch.randint(0, 256, (1, 64)))
    assert torch.equal(fixed, rope._positions) and int(rope.draws) == 2  # evaluation: one fixed draw per length
    assert model.max_length() == 256
    # the draw counter is saved with the model, so a resumed run continues the same sequence of draws
    again = TransformerLM(config)
    again.load_state_dict(model.state_dict())
    assert int(again.position.draws) == 2
    with pytest.raises(ValueError, match="max_positions"):
        model(torch.randint(0, 256, (1, 300)))
    with pytest.raises(ValueError, match="randomized_positions"):
        LMConfig(encoding="alibi", randomized_positions=8)


def test_attention_by_distance_on_uniform_attention():
    from relpos.experiment.diagnostics import attention_by_distance

    torch.manual_seed(0)
    model = TransformerLM(LMConfig(encoding="none", train_len=8, **SIZES))
    for block in model.blocks:  # zero queries and keys: every query spreads evenly over the keys it sees
        block.attn.qkv.weight.data[: 2 * SIZES["dim"]] = 0
    length = 32
    before = [b.attn.backend for b in model.blocks]
    got = attention_by_distance(model, torch.randint(0, 256, (2, length)), train_len=8)
    i = torch.arange(length, dtype=torch.float64)
    share = torch.stack([(1 / (i[d:] + 1)).sum() / length for d in range(length)])  # fp64 formula
    for (lo, hi), value in zip(got["bins"], got["share"]):
        assert value == pytest.approx(float(share[lo:hi].sum()), abs=1e-6)
    assert got["past_training"] == pytest.approx(float(share[8:].sum()), abs=1e-6)
    assert [b.attn.backend for b in model.blocks] == before  # the eager path was only borrowed


def test_rank_zero_borrows_the_waiting_ranks_threads_and_gives_them_back():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with ex._every_thread(world=1):
            assert torch.get_num_threads() == 1  # alone: nothing to borrow
        with pytest.raises(RuntimeError, match="evaluation failed"):
            with ex._every_thread(world=2):
                assert torch.get_num_threads() == min(os.cpu_count() or 1, 2)
                raise RuntimeError("evaluation failed")
        assert torch.get_num_threads() == 1  # restored on the error too
    finally:
        torch.set_num_threads(before)


def test_fire_normalizer_ablation_changes_only_the_queries_past_the_threshold():
    from relpos.core.bias import OffsetBias
    from relpos.encodings.fire import FIREBias
    from relpos.experiment.diagnostics import fire_normalizer_ablation, fixed_fire_normalizer

    torch.manual_seed(0)
    model = TransformerLM(LMConfig(encoding="fire", train_len=8, **SIZES))
    fires = [m for m in model.modules() if isinstance(m, FIREBias)]
    assert fires
    for fire in fires:
        fire.L_multiplier.data.fill_(8 / float(fire.init_L))  # threshold L = 8
        torch.nn.init.normal_(fire.mlp[2].weight, std=3.0)  # a bias large enough to change the loss
    x = torch.randint(0, 256, (3, 24))
    y = torch.randint(0, 256, (3, 24))
    short = fire_normalizer_ablation(model, x[:, :8], y[:, :8], train_len=8)
    assert short["fixed_normalizer"] == pytest.approx(short["as_trained"], abs=1e-6)  # every query within L: no change
    long = fire_normalizer_ablation(model, x, y, train_len=8)
    assert long["fixed_normalizer"][0] == pytest.approx(long["as_trained"][0], abs=1e-6)  # queries 0..7: within L
    assert abs(long["fixed_normalizer"][2] - long["as_trained"][2]) > 1e-3  # queries 16..23: normalized differently
    assert long["threshold"] == pytest.approx([8.0] * len(fires)) and long["length"] == 24
    with fixed_fire_normalizer(model):
        assert isinstance(fires[0].resolve(24, 24), OffsetBias)  # psi(L) for every query: per offset
    assert "per_offset" not in vars(fires[0])  # the patch is gone
    assert isinstance(fires[0].resolve(24, 24), torch.Tensor)  # past L: the exact dense bias again
    assert model.training  # the ablation restores the mode it found
    plain = TransformerLM(LMConfig(encoding="alibi", train_len=8, **SIZES))
    assert fire_normalizer_ablation(plain, x, y, train_len=8) is None


def test_a_text_run_records_fire_normalizer_ablation_for_fire_only(tmp_path):
    from relpos.experiment.problems import TextProblem

    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(60):
        (folder / f"m{i}.py").write_text(f"value_{i} = {i} * 2\n" * 40)
    problem = TextProblem(load_corpus(folder), train_len=8, multipliers=(1, 2), eval_tokens=256)
    torch.manual_seed(0)
    fire = ex._diagnostics(TransformerLM(LMConfig(encoding="fire", train_len=8, **SIZES)), problem)
    assert fire["fire_normalizer"]["length"] == 16 and len(fire["fire_normalizer"]["as_trained"]) == 2
    alibi = ex._diagnostics(TransformerLM(LMConfig(encoding="alibi", train_len=8, **SIZES)), problem)
    assert "fire_normalizer" not in alibi and "attention" in alibi


def test_the_fire_tool_reproduces_what_the_run_recorded(tmp_path):
    """tools/fire_normalizer.py adds the ablation to runs made before it existed: on a new run it
    must give what the run itself recorded, from the run's own checkpoints."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "tools" / "fire_normalizer.py"
    spec = importlib.util.spec_from_file_location("fire_normalizer", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    report = ex.run(_config(tmp_path, encodings=("fire",), lrs=(), seeds=(0,), rope_scalings=(), eval_every=0))
    recorded = report["runs"]["fire"]["0"]["fire_normalizer"]
    assert tool.main([str(tmp_path), "--windows", str(ex.FIRE_PROBE_WINDOWS)]) == 0
    again = json.loads((tmp_path / "fire-normalizer.json").read_text())["0"]
    assert again["as_trained"] == pytest.approx(recorded["as_trained"], abs=1e-6)
    assert again["fixed_normalizer"] == pytest.approx(recorded["fixed_normalizer"], abs=1e-6)
    ex.run(_config(tmp_path / "t5", encodings=("t5",), lrs=(), seeds=(0,), rope_scalings=(), eval_every=0))
    with pytest.raises(ValueError, match="has no FIRE model"):
        tool.main([str(tmp_path / "t5")])
