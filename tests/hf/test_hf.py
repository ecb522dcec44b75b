"""relpos.hf.accelerate: transformers' T5, mT5 and UMT5 on relpos attention, against the unmodified models.

No downloads: models are built from small configs with random weights (as transformers' own tests
do); relative_attention_max_distance is small so sequences reach past it.
"""

import copy
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

import relpos.hf as rh  # noqa: E402
import hf_checks  # noqa: E402
from operators import LargestTensor  # noqa: E402
from relpos import OffsetBias  # noqa: E402

SMALL = hf_checks.T5_SMALL
FAMILIES = hf_checks.t5_families()


def pair(family="t5", model_class=None, **overrides):
    """(transformers' model, an accelerated deep copy with the same weights)."""
    config_class, default_class = FAMILIES[family]
    torch.manual_seed(0)
    reference = (model_class or default_class)(config_class(**{**SMALL, **overrides})).eval()
    return reference, rh.accelerate(copy.deepcopy(reference))


def batch(b=3, length=40, target=30):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, SMALL["vocab_size"], (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.long)
    mask[1, 25:] = 0  # right padding, as T5 tokenizers pad
    mask[2, 31:] = 0
    ids = ids.masked_fill(mask == 0, SMALL["pad_token_id"])
    labels = torch.randint(2, SMALL["vocab_size"], (b, target), generator=g)
    labels[2, 20:] = -100  # padded labels
    return ids, mask, labels


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_loss_and_every_gradient_equal_transformers(family):
    reference, accelerated = pair(family)
    ids, mask, labels = batch()
    outs = []
    for model in (reference, accelerated):
        model.train()  # dropout_rate = 0: training mode, deterministic
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs.append((out.logits.detach(), out.loss.detach(), grads(model)))
    (l1, loss1, g1), (l2, loss2, g2) = outs
    assert torch.allclose(l2, l1, rtol=1e-4, atol=1e-5)
    assert torch.allclose(loss2, loss1, rtol=1e-5)
    assert g1.keys() == g2.keys() and len(g1) > 10
    for name in g1:
        scale = g1[name].abs().max().clamp(min=1e-6)
        assert (g2[name] - g1[name]).abs().max() <= 1e-4 * scale, name
    tables = [n for n in g1 if "relative_attention_bias" in n]
    assert len(tables) == (4 if family == "umt5" else 2)  # UMT5: a table in every layer; T5: layer 0 of each stack


def padded_both_ways(b=3, length=40, target=30):
    """A batch with right padding (example 1), left padding (example 2) and padded labels; 40 > max_distance 16."""
    ids, mask, labels = batch(b, length, target)
    mask[2] = 0
    mask[2, 9:] = 1  # left padding
    ids = ids.masked_fill(mask == 0, SMALL["pad_token_id"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def strong_pair(family="t5", model_class=None, **overrides):
    config_class, default_class = FAMILIES[family]
    torch.manual_seed(0)
    return hf_checks.make_pair((model_class or default_class)(config_class(**{**SMALL, **overrides})))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_strong_bias_left_and_right_padding_gradients_and_generate_logits(family):
    """Tables with std 1 (removing them changes the logits far beyond tolerance), both paddings:
    logits, loss and every gradient within 1e-4; generate: identical tokens (greedy, beam, sampling)
    and per-step decoder logits with the KV cache within 1e-5."""
    reference, accelerated = strong_pair(family)
    inputs = padded_both_ways()
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    prompt = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    hf_checks.generate_equal(reference, accelerated, prompt, samplers=family == "t5")


def test_tile_and_fused_paths_through_accelerate(monkeypatch):
    reference, accelerated = strong_pair("umt5")
    hf_checks.tiles_and_fused_paths(monkeypatch, reference, accelerated, padded_both_ways())


def test_stacks_holding_their_own_config_copy_are_switched_and_restored():
    """transformers 5.15's T5 stacks keep deep copies of the model's config that its set_attn_implementation misses
    (simulated on any release: the attention layers get a config copy that no sub-model owns, which newer
    releases' switch does not reach either): accelerate switches them too, or every layer would silently run
    transformers' attention; undo puts them back."""
    reference, _ = pair("t5")
    model = copy.deepcopy(reference)
    copies = []
    for stack in (model.encoder, model.decoder):
        copies.append(copy.deepcopy(stack.config))  # the layers' own copy, on transformers' attention
        copies[-1]._attn_implementation = "sdpa"
        for module in stack.modules():
            if hasattr(module, "config") and not hasattr(type(module), "set_attn_implementation"):
                module.config = copies[-1]
    owner = model.encoder.block[0].layer[0].SelfAttention
    rh.accelerate(model)
    assert owner.config is copies[0] and owner.config._attn_implementation == "relpos"
    assert isinstance(owner.compute_bias(4, 4), OffsetBias)
    ids, mask, labels = batch()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids, attention_mask=mask, labels=labels).logits,
                              reference(input_ids=ids, attention_mask=mask, labels=labels).logits, atol=1e-5)
    rh.restore(model)
    assert owner.config._attn_implementation == "sdpa" and "compute_bias" not in vars(owner)


@pytest.mark.newest_transformers  # transformers 5.15's set_attn_implementation does not reach the stacks' configs
def test_set_attn_implementation_switches_both_ways():
    """model.set_attn_implementation("eager"|"sdpa") gives transformers' dense path; "relpos" gives relpos's again."""
    reference, accelerated = strong_pair("t5")
    inputs = padded_both_ways()
    hf_checks.switch_implementations(reference, accelerated, inputs)
    owner = accelerated.encoder.block[0].layer[0].SelfAttention
    accelerated.set_attn_implementation("eager")
    assert isinstance(owner.compute_bias(4, 4), torch.Tensor)  # transformers' dense form
    accelerated.set_attn_implementation("relpos")
    assert isinstance(owner.compute_bias(4, 4), OffsetBias)
    hf_checks.restore_gives_transformers_back(reference, accelerated, inputs)


def test_config_output_attentions_returns_the_weights():
    hf_checks.config_output_attentions(transformers.T5ForConditionalGeneration, transformers.T5Config(**SMALL), padded_both_ways())


def test_mt5_model_built_from_a_t5_config_is_accelerated():
    torch.manual_seed(0)
    model = transformers.MT5ForConditionalGeneration(transformers.T5Config(**SMALL))
    assert model.config.model_type == "t5"
    reference, accelerated = hf_checks.make_pair(model)
    assert rh.is_accelerated(accelerated)
    hf_checks.forward_loss_and_gradients(reference, accelerated, padded_both_ways())


def test_compile_fullgraph_with_a_padding_mask_and_compiled_generate():
    """torch.compile(fullgraph=True) with padding: no graph break (the mask function and the attention path
    have no data-dependent branch); compiled forward inside generate() gives transformers' tokens."""
    torch._dynamo.reset()
    reference, accelerated = strong_pair("t5", model_class=transformers.T5EncoderModel)
    inputs = {k: v for k, v in padded_both_ways().items() if k != "labels"}
    compiled = torch.compile(accelerated, fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(**inputs).last_hidden_state, reference(**inputs).last_hidden_state, atol=1e-5)
    reference, accelerated = strong_pair("t5", num_layers=1, num_decoder_layers=1)
    accelerated.forward = torch.compile(accelerated.forward, fullgraph=True, backend="eager")  # tracing is the test
    with torch.no_grad():
        a = reference.generate(**inputs, max_new_tokens=6, min_new_tokens=6)
        b = accelerated.generate(**inputs, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(a, b)


def test_generate_with_a_static_cache():
    """cache_implementation="static" (uncompiled): the cache's unseen tail is hidden; transformers' tokens and logits."""
    reference, accelerated = strong_pair("t5")
    inputs = {k: v for k, v in padded_both_ways().items() if k != "labels"}
    common = dict(max_new_tokens=6, min_new_tokens=6, cache_implementation="static", output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        a, b = reference.generate(**inputs, **common), accelerated.generate(**inputs, **common)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.logits, b.logits))


def test_the_bias_is_per_offset_and_never_dense(monkeypatch):
    reference, accelerated = pair("t5")
    ids, mask, labels = batch()
    seen = []
    real = rh._attention.attention

    def spy(query, key, value, **kwargs):
        seen.append(kwargs["bias"])
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(rh._attention, "attention", spy)
    calls = []
    owner = accelerated.encoder.block[0].layer[0].SelfAttention
    monkeypatch.setattr(type(owner), "compute_bias", lambda *a, **k: calls.append(1))  # the dense one: never called
    accelerated(input_ids=ids, attention_mask=mask, labels=labels)
    assert not calls
    self_attention = [b for b in seen if b is not None]
    assert len(self_attention) == 4 and all(isinstance(b, OffsetBias) for b in self_attention)
    assert all(b.values.shape == (4, 2 * b.query_length - 1) for b in self_attention)


@pytest.mark.parametrize(
    "model_class", [transformers.T5Model, transformers.T5EncoderModel, transformers.T5ForTokenClassification]
)
def test_other_heads_of_the_family(model_class):
    reference, accelerated = pair("t5", model_class=model_class)
    ids, mask, _ = batch()
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if model_class is transformers.T5Model:
        kwargs["decoder_input_ids"] = ids[:, :12]
    with torch.no_grad():
        a, b = reference(**kwargs), accelerated(**kwargs)
    first = "logits" if model_class is transformers.T5ForTokenClassification else "last_hidden_state"
    assert torch.allclose(getattr(b, first), getattr(a, first), atol=1e-5)


def test_state_dict_names_and_round_trips(tmp_path):
    reference, accelerated = pair("t5")
    assert list(accelerated.state_dict()) == list(reference.state_dict())
    assert [n for n, _ in accelerated.named_parameters()] == [n for n, _ in reference.named_parameters()]
    accelerated.save_pretrained(tmp_path)
    plain = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path)  # plain transformers loads it
    assert plain.config._attn_implementation != "relpos"
    assert "compute_bias" not in vars(plain.encoder.block[0].layer[0].SelfAttention)
    ids, mask, labels = batch()
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids, attention_mask=mask, labels=labels).logits,
                              reference(input_ids=ids, attention_mask=mask, labels=labels).logits, atol=1e-5)
    torch.save(accelerated.state_dict(), tmp_path / "sd.pt")
    reference.load_state_dict(torch.load(tmp_path / "sd.pt"))


def test_restore_and_idempotence():
    reference, accelerated = pair("t5")
    assert rh.accelerate(accelerated) is accelerated and rh.is_accelerated(accelerated)
    rh.restore(accelerated)
    assert not rh.is_accelerated(accelerated)
    assert accelerated.config._attn_implementation == reference.config._attn_implementation
    owner = accelerated.encoder.block[0].layer[0].SelfAttention
    assert "compute_bias" not in vars(owner)
    with pytest.raises(ValueError, match="was not accelerated"):
        rh.restore(accelerated)
    # other models in the process are untouched by accelerating one
    other = transformers.T5ForConditionalGeneration(transformers.T5Config(**SMALL))
    rh.accelerate(accelerated)
    assert other.config._attn_implementation != "relpos" and "compute_bias" not in vars(other.encoder.block[0].layer[0].SelfAttention)


def test_unsupported_models_are_refused():
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))
    with pytest.raises(TypeError, match=r"supports transformers models of these families: T5.*got BertModel with model_type='bert'"):
        rh.accelerate(bert)
    assert bert.config._attn_implementation != "relpos" and not rh.is_accelerated(bert)
    with pytest.raises(TypeError, match="got Linear"):
        rh.accelerate(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_transformers_own_error(dtype):
    reference, accelerated = pair("t5")
    ids, mask, labels = batch()
    with torch.no_grad():
        exact = reference(input_ids=ids, attention_mask=mask, labels=labels).logits
        theirs = reference.to(dtype)(input_ids=ids, attention_mask=mask, labels=labels).logits.float()
        ours = accelerated.to(dtype)(input_ids=ids, attention_mask=mask, labels=labels).logits.float()
    assert torch.isfinite(ours).all()
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-2


def test_dropout_in_training_mode_only():
    reference, accelerated = pair("t5", dropout_rate=0.3)
    ids, mask, labels = batch()
    accelerated.eval()
    with torch.no_grad():
        a = accelerated(input_ids=ids, attention_mask=mask, labels=labels).logits
        assert torch.equal(a, accelerated(input_ids=ids, attention_mask=mask, labels=labels).logits)
    accelerated.train()
    torch.manual_seed(0)
    b = accelerated(input_ids=ids, attention_mask=mask, labels=labels)
    b.loss.backward()
    assert not torch.allclose(b.logits, a)
    table = accelerated.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert table.grad is not None and torch.isfinite(table.grad).all()


def test_output_attentions_fall_back_to_the_eager_weights():
    reference, accelerated = pair("t5", attn_implementation="eager")  # built eager: every stack's config copy too
    ids, mask, labels = batch()
    with torch.no_grad():
        a = reference(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True)
        b = accelerated(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True)
    assert len(b.encoder_attentions) == 2 and b.encoder_attentions[0].shape == a.encoder_attentions[0].shape
    for x, y in zip(a.encoder_attentions + a.decoder_attentions, b.encoder_attentions + b.decoder_attentions):
        assert torch.allclose(x, y, atol=1e-5)
    assert torch.allclose(a.logits, b.logits, atol=1e-5)


@pytest.mark.newest_transformers  # activation_checkpointing_enable: transformers >= 5.23
def test_gradient_checkpointing():
    reference, accelerated = pair("t5")
    ids, mask, labels = batch()
    results = []
    for model in (reference, accelerated):
        model.train()
        model.activation_checkpointing_enable()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        results.append(grads(model))
    for name in results[0]:
        assert torch.allclose(results[1][name], results[0][name], rtol=1e-4, atol=1e-6), name
    accelerated.zero_grad()
    accelerated.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(RuntimeError, match="use_reentrant=True"):
        accelerated(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()


def test_trainer_example_runs(capsys):
    """examples/t5_trainer.py: Trainer fine-tunes an accelerated T5 (a short smoke run here)."""
    import importlib.util
    import pathlib

    pytest.importorskip("accelerate")
    path = pathlib.Path(__file__).parents[2] / "examples" / "t5_trainer.py"
    spec = importlib.util.spec_from_file_location("t5_trainer", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    accuracy = example.main(["--steps", "20", "--eval-size", "16"])
    assert 0.0 <= accuracy <= 1.0 and "exact match on 16" in capsys.readouterr().out


DDP_SCRIPT = """
import sys
import torch
import torch.distributed as dist
sys.path.insert(0, {examples!r})
import t5_trainer

model = t5_trainer.train(4)
table = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.detach()
world = dist.get_world_size()
gathered = [torch.empty_like(table) for _ in range(world)]
dist.all_gather(gathered, table)
same = all(torch.equal(gathered[0], g) for g in gathered)
sys.stdout.write(f"<world {{world}} tables identical {{same}}>\\n")  # one write: the two ranks share the pipe
import relpos.distributed as rd
rd.exit_process(0)  # a barrier, the group destroyed, no interpreter teardown: a gloo thread can abort it
"""


def test_trainer_ddp_under_torchrun(tmp_path):
    """torchrun --nproc_per_node 2 + Trainer (gloo on CPU): the accelerated model trains and its tables stay in sync."""
    import pathlib
    import socket
    import subprocess
    import sys

    pytest.importorskip("accelerate")
    examples = str(pathlib.Path(__file__).parents[2] / "examples")
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(examples=examples))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("<world 2 tables identical True>") == 2, done.stdout[-2000:]


def test_model_benchmark_runs_at_a_tiny_size(tmp_path, capsys):
    """benchmarks/t5_model.py end to end (no timing assertions): every variant of every mode reported; with
    generate_static, dynamo's recompile limit raised for the run (each variant is a model compiled on its own, but
    transformers' forward wrappers are one code object for all) and restored."""
    from relpos.hf import bench
    from relpos.hf.bench import main

    out = tmp_path / "t5.json"
    modes = ("forward", "train", "generate", "generate_static", "layer")
    assert main(["--lengths", "64", "--batches", "2", "--modes", ",".join(modes), "--rounds", "1",
                 "--json", str(out), "--markdown", str(tmp_path / "t5.md")]) == 0
    import json as _json

    report = _json.loads(out.read_text())
    results = report["results"]
    # compiled static-cache generation: room for each model's own recompiles (4 variants, 1 point), then restored
    assert report["machine"]["recompile_limit"] == 8 * 4 and torch._dynamo.config.recompile_limit == 8
    assert {(r["mode"], r["variant"]) for r in results} == {
        (m, v) for m in modes for v in ("hf_eager", "hf_sdpa", "relpos", "no_bias_floor")
    }
    tables = (tmp_path / "t5.md").read_text()
    assert all(r["ms"] > 0 for r in results) and "### generate" in tables and "### generate_static" in tables
    # the ceiling: transformers' fastest over the floor, per point (only for reports whose floor is relpos's model)
    forward = {r["variant"]: r["ms"] for r in results if r["mode"] == "forward"}
    ceiling = min(forward["hf_eager"], forward["hf_sdpa"]) / forward["no_bias_floor"]
    row = next(line for line in tables.split("### forward")[1].splitlines() if line.startswith("| 2 | 64 |"))
    assert report["floor"] == bench.FLOOR_KIND and row.endswith(f" {ceiling:.2f}x |"), row
    assert "the ceiling" not in bench.markdown({k: v for k, v in report.items() if k != "floor"})  # an old report


@pytest.mark.parametrize("family", ["t5", "bloom"])
def test_model_benchmark_floor_is_attention_without_the_position_term(family):
    """The floor variant is relpos's model with its attention swapped for plain SDPA while it runs: every attention
    call gets no mask, nothing of size (Lq, Lk) is built around it (transformers' dense bias was, before: a floor
    slower than relpos), its output differs from relpos's only by the term and the mask, and the swap is undone."""
    from transformers import AttentionInterface

    from relpos.hf import bench

    config = bench.ModelBenchConfig(family=family, d_model=16, heads=4, layers=2)
    models = bench._models(config, "forward")
    batch, length = 2, 128  # (1, H, L, L) is 4x the largest other tensor (the feed-forward's)
    ids, mask = bench._inputs(batch, length)
    kwargs = {"input_ids": ids, "attention_mask": mask}
    masks, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kw):
        masks.append(kw.get("attn_mask"))
        return sdpa(*args, **kw)

    registered = dict(AttentionInterface._global_mapping)
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy), LargestTensor() as probe:
        bench._step("forward", models["no_bias_floor"], kwargs, 0, floor=True)()
    assert masks and all(m is None for m in masks), masks
    assert probe.largest < batch * config.heads * length * length / 4, probe.largest
    assert AttentionInterface._global_mapping == registered  # the swap is undone
    with torch.no_grad(), bench._floor():
        floor = bench._output(models["no_bias_floor"](**kwargs))
    with torch.no_grad():
        accelerated = bench._output(models["relpos"](**kwargs))
    assert (floor[0] - accelerated[0]).abs().max() > 1e-3  # the full example (fp32 rounding: ~1e-6): the term dropped


def test_model_benchmark_profile_says_where_each_variants_time_goes(tmp_path):
    """--profile: every timed variant gets torch.profiler's reading of its call (wall, busy, the top operators; on
    the CPU no syncs and no attention share), and the page a table of them after the others."""
    from relpos.hf.bench import main

    out = tmp_path / "t5.json"
    assert main(["--lengths", "32", "--batches", "2", "--modes", "forward", "--rounds", "1", "--d-model", "32",
                 "--heads", "4", "--profile", "--json", str(out), "--markdown", str(tmp_path / "t5.md")]) == 0
    import json as _json

    results = _json.loads(out.read_text())["results"]
    assert {r["variant"] for r in results} == {"hf_eager", "hf_sdpa", "relpos", "no_bias_floor"}
    for r in results:
        p = r["profile"]
        assert p["calls"] == 3 and p["wall_ms"] > 0 and p["busy_ms"] > 0 and p["top"], r
        assert p["syncs_per_call"] is None and p["attention_ms"] is None  # the CPU's
    page = (tmp_path / "t5.md").read_text()
    section = page.split("### where the time goes")[1]
    assert sum(line.startswith("| forward | 2 | 32 |") for line in section.splitlines()) == 4
    from relpos.hf import bench

    def broken():
        raise RuntimeError("CUPTI said no")

    failed = bench._profiled(broken, False, "forward")  # a failing profile costs its row, not the point
    assert failed == {"error": "RuntimeError: CUPTI said no"}
    row = {"mode": "forward", "batch": 2, "length": 32, "variant": "relpos", "profile": failed}
    assert "| relpos | not profiled: RuntimeError: CUPTI said no |" in "\n".join(bench._profile_lines([row]))


def test_model_benchmark_compiles_static_generation_on_the_cpu_only_when_asked():
    """--compile-cpu: generate_static hands generate() an inductor CompileConfig forced onto the CPU (fullgraph, static
    shapes, as transformers' compiled-generation test); without it, or for another mode, generate() gets only its cache
    option; on CUDA generate() compiles by itself. (The compiled run is timed in docs/benchmarks/t5-family, not here.)"""
    from relpos.hf.bench import ModelBenchConfig, _generate_options, _step

    compiled = _generate_options("generate_static", ModelBenchConfig(compile_cpu=True))
    config = compiled["compile_config"]
    assert compiled["cache_implementation"] == "static" and config._compile_all_devices is True
    assert (config.backend, config.fullgraph, config.dynamic, config.mode) == ("inductor", True, False, "default")
    assert _generate_options("generate_static", ModelBenchConfig()) == {"cache_implementation": "static"}
    assert _generate_options("generate", ModelBenchConfig(compile_cpu=True)) == {}
    seen = []

    class Model:
        def generate(self, **kwargs):
            seen.append(kwargs)

    _step("generate_static", Model(), {"input_ids": 1}, 3, False, compiled)()
    assert seen == [{"input_ids": 1, "max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False, **compiled}]


def test_model_benchmark_generates_the_tokens_asked_and_refuses_none(tmp_path, capsys, monkeypatch):
    from relpos.hf import bench

    seen = []
    monkeypatch.setattr(bench, "run_model_bench", lambda config, on_point=None: seen.append(config) or (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--new-tokens", "64", "--modes", "generate"])
    assert seen[0].new_tokens == 64
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--new-tokens", "0", "--json", str(tmp_path / "x.json")])
    assert exit_.value.code == 2 and "--new-tokens must be a positive number of tokens, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [(["--modes", "generate"], "--modes generate"),
                                         (["--modes", "generate_static", "--device", "cuda"], "--device cuda")])
def test_model_benchmark_refuses_compile_cpu_where_it_does_nothing(argv, named, tmp_path, capsys, monkeypatch):
    from relpos.hf.bench import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device check passes; the option is refused
    with pytest.raises(SystemExit) as exit_:
        main(["--compile-cpu", *argv, "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and not (tmp_path / "x.json").exists()
    assert "--compile-cpu" in err and named in err and "add generate_static to --modes and run on the CPU" in err


def test_model_benchmark_refuses_static_generation_for_a_family_without_it(tmp_path, capsys):
    """transformers' MPT has no static-cache generation: the benchmark refuses the mode before any work."""
    from relpos.hf.bench import main

    with pytest.raises(SystemExit) as exit_:
        main(["--family", "mpt", "--modes", "generate_static", "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and not (tmp_path / "x.json").exists()
    assert "generate_static needs a family" in err and "(t5, umt5, bloom)" in err and "'mpt'" in err


def test_an_unfitting_transformers_is_refused_with_its_version(monkeypatch):
    """If the installed T5Attention lacks the interface relpos.hf relies on, accelerate refuses before touching anything."""
    reference, _ = pair("t5")
    attention_class = type(reference.encoder.block[0].layer[0].SelfAttention)

    def old_compute_bias(self, query_length, key_length, device=None, cache_position=None):  # an older signature
        raise AssertionError("never called")

    monkeypatch.setattr(attention_class, "compute_bias", old_compute_bias)
    with pytest.raises(RuntimeError, match=rf"does not fit T5Attention of the installed transformers {transformers.__version__}"):
        rh.accelerate(reference)
    assert not rh.is_accelerated(reference) and reference.config._attn_implementation != "relpos"


def test_model_benchmark_saves_every_point(tmp_path):
    """A long grid stopped early keeps its points: the report is handed over (and main writes it) after each."""
    from relpos.hf.bench import ModelBenchConfig, _save, run_model_bench

    seen = []
    config = ModelBenchConfig(lengths=(16, 24), batches=(1,), modes=("forward",), rounds=1, d_model=32, heads=2, layers=1)
    report = run_model_bench(config, on_point=lambda r: seen.append((len(r["results"]), r["complete"])))
    assert seen == [(4, False), (8, False)]  # four variants per point
    assert report["complete"] is True
    partial = dict(report, complete=False, results=report["results"][:4])
    text = _save(partial, str(tmp_path / "p.json"), str(tmp_path / "p.md"))
    assert "**Partial**" in text and "| 1 | 24 | skipped |" in text and (tmp_path / "p.json").exists()


@pytest.mark.parametrize("grad", [False, True])
def test_one_padded_sequence_at_real_size(grad):
    """Inference (and training) on a single padded example, the most common call: batch of one, 1024
    tokens of which 700 are real, past the real tile thresholds (regression: the shared kept-key run
    sent every key to SDPA with a bias view of only the kept ones, a size-mismatch crash)."""
    reference, accelerated = strong_pair("t5")
    ids = torch.randint(2, SMALL["vocab_size"], (1, 1024), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(1, 1024, dtype=torch.long)
    mask[0, :700] = 1
    encoders = (reference.get_encoder(), accelerated.get_encoder())
    with torch.set_grad_enabled(grad):
        want, got = (e(input_ids=ids, attention_mask=mask).last_hidden_state for e in encoders)
    assert torch.allclose(got[0, :700], want[0, :700], rtol=1e-4, atol=1e-5)
