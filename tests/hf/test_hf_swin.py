"""relpos.hf.accelerate on transformers' Swin, Swin V2 and Donut Swin: the same outputs and gradients.

Tiny configs with random weights (nothing downloaded); bias tables drawn with std 1 and Swin V2's
MLP scaled up so the position term moves the outputs far past the tolerance (asserted).
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DonutSwinConfig, DonutSwinModel, SwinConfig, SwinModel, Swinv2Config, Swinv2Model  # noqa: E402

import relpos.hf as rh  # noqa: E402

FAMILIES = {
    "swin": (SwinModel, SwinConfig),
    "swinv2": (Swinv2Model, Swinv2Config),
    "donut": (DonutSwinModel, DonutSwinConfig),
}
# (image size, window): 16x16 patches in windows of 4 (exact), 18x18 (padded to 20), 20x20 in windows of 3 (padded to 21)
GEOMETRIES = [(32, 4), (36, 4), (40, 3)]


def _randomize_position_terms(model: torch.nn.Module) -> None:
    """Tables ~ N(0, 1); Swin V2's MLP large enough that 16 * sigmoid(.) varies over its range."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name:
                p.normal_()
            elif "continuous_position_bias_mlp" in name:
                p.normal_(std=1.0)


def _model(family: str, image_size: int, window: int, **extra) -> torch.nn.Module:
    cls, config_cls = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(image_size=image_size, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                        window_size=window, **extra)
    model = cls(config).double().eval()
    _randomize_position_terms(model)
    return model


def _run(model, pixels):
    out = model(pixels).last_hidden_state
    grads = torch.autograd.grad(out.square().sum(), [p for p in model.parameters()])
    return out.detach(), grads


def _layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Layer")]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("image_size,window", GEOMETRIES)
def test_outputs_and_gradients_equal_transformers(family, image_size, window):
    model = _model(family, image_size, window)
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(2, 3, image_size, image_size, dtype=torch.float64)
    ref, ref_grads = _run(model, pixels)
    out, grads = _run(fast, pixels)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert any(layer.shift_size > 0 for layer in _layers(model))  # shifted windows ran
    grid = image_size // 2
    assert (grid % window != 0) == (image_size != 32)  # the padded geometries pad


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_gpu_sdpa_route_equals_transformers(family, monkeypatch):
    """The route accelerated Swin models take on CUDA (one SDPA call per layer, windows x heads as SDPA's heads, the
    bias and shift mask one mask broadcast over the batch), forced here on the CPU: outputs and every gradient equal
    transformers' (fp64, a padded geometry with shifted windows)."""
    import relpos.layers.window_attention as wa

    monkeypatch.setattr(wa, "SDPA_DEVICES", {"cpu"})
    monkeypatch.setattr(wa, "_fusable", lambda *a: False)
    calls = []
    real = wa._sdpa_windows
    monkeypatch.setattr(wa, "_sdpa_windows", lambda *a: calls.append(1) or real(*a))
    model = _model(family, 36, 4)
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    ref, ref_grads = _run(model, pixels)
    out, grads = _run(fast, pixels)
    assert len(calls) == len(_layers(model))  # every block (SwinLayer) of every stage
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_position_term_matters(family):
    """Zeroing the bias moves the output far beyond the tolerance: the equality above is not vacuous."""
    model = _model(family, 36, 4)
    pixels = torch.randn(1, 3, 36, 36, dtype=torch.float64)
    with torch.no_grad():
        ref = model(pixels).last_hidden_state
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name or "continuous_position_bias_mlp.2" in name:
                p.zero_()
        flat = model(pixels).last_hidden_state
    assert (ref - flat).abs().max() > 1e-2


def test_swinv2_bias_spans_its_range():
    model = _model("swinv2", 32, 4)
    attn = next(m for m in model.modules() if type(m).__name__ == "Swinv2SelfAttention")
    table = 16 * torch.sigmoid(attn.continuous_position_bias_mlp(attn.relative_coords_table))
    assert table.std() > 1.0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_restore_and_instances_only(family):
    model = _model(family, 32, 4)
    other = _model(family, 32, 4)
    rh.accelerate(model)
    patched = [m for m in model.modules() if "forward" in vars(m)]
    assert patched and all(type(m).__name__ in rh.swin.SWIN_ATTENTION_CLASSES for m in patched)
    assert not any("forward" in vars(m) for m in other.modules())  # another instance is untouched
    assert rh.is_accelerated(model)
    rh.restore(model)
    assert not any("forward" in vars(m) for m in model.modules()) and not rh.is_accelerated(model)
    pixels = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(pixels).last_hidden_state, other(pixels).last_hidden_state)


@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_output_attentions_runs_transformers_forward(family):
    model = _model(family, 32, 4)
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        ref = model(pixels, output_attentions=True)
        out = fast(pixels, output_attentions=True)
    assert ref.attentions is not None and len(out.attentions) == len(ref.attentions)
    for a, b in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_output_attentions_returns_transformers_weights(family):
    """``config.output_attentions = True`` (no per-call flag: Swin's layers then do not pass it down, and
    transformers records the weights the modules return): the same weights as transformers', every family."""
    model = _model(family, 32, 4)
    model.set_attn_implementation("eager")
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    for m in (model, fast):
        m.config.output_attentions = True
    with torch.no_grad():
        ref, out = model(pixels), fast(pixels)
    assert len(ref.attentions) == 2 and len(out.attentions) == 2
    for a, b in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_attention_dropout_draws_the_same_mask(family):
    """Training with attention dropout: the reference path draws the same elements as transformers' eager."""
    extra = {"attention_probs_dropout_prob": 0.3}
    if family == "swin":
        extra["attn_implementation"] = "eager"
    model = _model(family, 36, 4, **extra).train()
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    torch.manual_seed(7)
    ref = model(pixels).last_hidden_state
    torch.manual_seed(7)
    out = fast(pixels).last_hidden_state
    tol = 1e-6 if family == "swin" else 1e-10  # Swin's eager function takes its softmax in fp32, even for fp64
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.manual_seed(8)
    assert (fast(pixels).last_hidden_state - ref).abs().max() > 1e-3  # another mask: dropout really acts


def test_float32_close():
    model = _model("swinv2", 36, 4).float()
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(2, 3, 36, 36)
    with torch.no_grad():
        torch.testing.assert_close(fast(pixels).last_hidden_state, model(pixels).last_hidden_state, rtol=1e-4, atol=1e-4)


def test_check_refuses_a_changed_interface():
    model = _model("swin", 32, 4)
    attn = next(m for m in model.modules() if type(m).__name__ == "SwinAttention")
    del attn.o_proj
    with pytest.raises(RuntimeError, match="o_proj"):
        rh.accelerate(model)
    assert not any("forward" in vars(m) for m in model.modules())  # nothing changed


def test_swinv2_adds_the_shift_mask_twice_like_transformers():
    """Swin V2 adds its -100 shift mask twice (-200). With logit_scale at its cap (100) cosine logits
    reach +-100, so a mask added once would let blocked pairs win: the queries are set to point at
    the keys of the other region (q = -x, k = x), which only the doubled mask keeps out."""
    model = _model("swinv2", 32, 4)
    fast = rh.accelerate(copy.deepcopy(model))
    ref, ours = (next(m for m in net.modules() if type(m).__name__ == "Swinv2SelfAttention") for net in (model, fast))
    for module in (ref, ours):
        with torch.no_grad():
            module.logit_scale.fill_(torch.log(torch.tensor(100.0)).item())
            module.query.weight.copy_(-torch.eye(16))
            module.query.bias.zero_()
            module.key.weight.copy_(torch.eye(16))
    g = torch.Generator().manual_seed(11)
    region = torch.arange(16) >= 8  # (N,): two regions of a shifted window
    sign = torch.where(region, -1.0, 1.0).double()
    hidden = sign[None, :, None] * torch.ones(2, 16, 16, dtype=torch.float64) + 0.1 * torch.randn(2, 16, 16, generator=g, dtype=torch.float64)
    mask = torch.where(region[:, None] != region[None, :], -100.0, 0.0).double()[None]  # (nW=1, N, N)
    with torch.no_grad():
        expected, got = ref(hidden, mask)[0], ours(hidden, mask)[0]
        once = ref(hidden, mask / 2)[0]  # transformers' forward with the mask added once in effect
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert (once - expected).abs().max() > 0.1  # the second -100 matters here (tolerance 1e-10)


def _saved_shapes(fn) -> list[tuple[int, tuple[int, ...]]]:
    """(element count, shape) of every tensor autograd keeps for the backward while ``fn()`` runs forward."""
    kept: list[tuple[int, tuple[int, ...]]] = []

    def pack(t):
        kept.append((t.numel(), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return kept


def _saved_numels(fn) -> list[int]:
    return [numel for numel, _ in _saved_shapes(fn)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recompute_activations_equal_gradients_and_restorable(family):
    """recompute_activations: outputs and every gradient still equal unmodified transformers'; restore removes it."""
    model = _model(family, 36, 4)
    fast = rh.recompute_activations(rh.accelerate(copy.deepcopy(model)))
    modules = [m for m in fast.modules() if type(m).__name__ in rh.swin.SWIN_ATTENTION_CLASSES]
    assert modules and all(vars(m).get("_relpos_recompute") for m in modules)
    mlp = [m for m in fast.modules() if type(m).__name__.endswith(("Intermediate", "Output", "MLP")) and "forward" in vars(m)]
    assert len(mlp) == (1 if family == "swin" else 2) * 4  # every layer's MLP: SwinMLP; V2 / Donut: intermediate + output
    assert list(fast.state_dict()) == list(model.state_dict()) and len(list(fast.modules())) == len(list(model.modules()))
    pixels = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    ref, ref_grads = _run(model, pixels)
    out, grads = _run(fast, pixels)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    rh.restore(fast)
    assert not any("_relpos_recompute" in vars(m) or "forward" in vars(m) for m in fast.modules())


def test_recompute_activations_with_wrapped_projections_checkpoints_the_branch(monkeypatch):
    """Projections that are not plain nn.Linear (an adapter's wrapper) cannot go inside the fused function:
    the branch runs in a checkpoint instead, with the same outputs and gradients."""

    class Wrapped(torch.nn.Linear):  # e.g. a LoRA layer: a Linear subclass with its own forward
        pass

    model = _model("swinv2", 36, 4)
    fast = rh.recompute_activations(rh.accelerate(copy.deepcopy(model)))
    for module in fast.modules():
        if type(module).__name__ == "Swinv2SelfAttention":
            module.value.__class__ = Wrapped
    calls = []
    real = rh.swin.checkpoint
    monkeypatch.setattr(rh.swin, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    pixels = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    ref, ref_grads = _run(model, pixels)
    out, grads = _run(fast, pixels)
    assert len(calls) == 4  # every layer's attention branch
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_recompute_activations_keeps_less_and_can_be_switched_off():
    """Kept for the backward (Swin V2, batch 4): transformers > accelerated > accelerated + recompute."""
    model = _model("swinv2", 32, 4)
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    kept = {}
    for name, net in (("hf", model), ("relpos", fast)):
        kept[name] = sum(_saved_numels(lambda: net(pixels)))
    rh.recompute_activations(fast)
    kept["recompute"] = sum(_saved_numels(lambda: fast(pixels)))
    assert kept["recompute"] < 0.75 * kept["relpos"] and kept["relpos"] < kept["hf"]
    rh.recompute_activations(fast, enabled=False)
    assert sum(_saved_numels(lambda: fast(pixels))) == kept["relpos"]


def test_no_per_example_window_scores_kept_for_backward():
    """No (N, N)-ended tensor of B * nW * H * N * N elements (transformers keeps several) is kept by the
    accelerated model; the per-layer bias (nW * H * N * N) is."""
    batch = 4
    model = _model("swinv2", 32, 4)
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(batch, 3, 32, 32, dtype=torch.float64)
    attn = next(m for m in model.modules() if type(m).__name__ == "Swinv2SelfAttention")
    n = attn.window_size[0] * attn.window_size[1]
    scores = batch * (16 // 4) ** 2 * attn.num_attention_heads * n * n  # stage 1: 16x16 patches, windows of 4

    def window_sized(net) -> list[int]:
        return [numel for numel, shape in _saved_shapes(lambda: net(pixels)) if shape[-2:] == (n, n)]

    assert scores in window_sized(model)  # the check can fail: transformers keeps them
    kept = window_sized(fast)
    assert kept and max(kept) <= scores // batch  # the bias, once per layer


def test_recompute_activations_refuses_bad_models():
    model = _model("swinv2", 32, 4)
    with pytest.raises(ValueError, match="accelerate"):
        rh.recompute_activations(model)  # not accelerated
    with pytest.raises(ValueError, match="no Swin attention"):
        rh.recompute_activations(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="enabled"):
        rh.recompute_activations(rh.accelerate(model), enabled="yes")


def _swin_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "swin.py"
    spec = importlib.util.spec_from_file_location("swin_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _silence_position_bias(model: torch.nn.Module) -> None:
    """transformers' own model with a relative position bias of exactly 0: V1 tables zeroed; Swin V2's MLP made to
    output -51200 everywhere (its hidden units all 1, its output weights -100), so 16 * sigmoid(.) underflows to 0."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "relative_position_bias_table"):
                module.relative_position_bias_table.zero_()
            if hasattr(module, "continuous_position_bias_mlp"):
                first, _, last = module.continuous_position_bias_mlp
                first.weight.zero_()
                first.bias.fill_(1.0)
                last.weight.fill_(-100.0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_benchmarks_floor_is_the_model_without_its_position_bias(family):
    """benchmarks/swin.py's floor (relpos's model with the position bias dropped) equals transformers' model whose
    position bias is 0, shift masks and padding kept, and is far from the model with its bias."""
    bench = _swin_benchmark()
    model = _model(family, 36, 4)
    silent = copy.deepcopy(model)
    _silence_position_bias(silent)
    fast = rh.accelerate(copy.deepcopy(model))
    pixels = torch.randn(2, 3, 36, 36, dtype=torch.float64)
    with torch.no_grad():
        with bench.no_position_term():
            floor = fast(pixels).last_hidden_state
        torch.testing.assert_close(floor, silent(pixels).last_hidden_state, rtol=1e-10, atol=1e-10)
        assert (floor - model(pixels).last_hidden_state).abs().max() > 1e-2
        torch.testing.assert_close(fast(pixels).last_hidden_state, model(pixels).last_hidden_state)  # and undone
    assert any(layer.shift_size > 0 for layer in _layers(model))  # shifted windows ran


def test_swin_benchmark_runs_at_a_tiny_size(tmp_path):
    """benchmarks/swin.py end to end (no timing assertions): every variant of both modes (the floor too), the
    equality checks, the floor's table and the saved-activation table; timm's model joins where timm imports."""
    import json

    bench = _swin_benchmark()
    out, page = tmp_path / "swin.json", tmp_path / "swin.md"
    assert bench.main(["--image", "32", "--windows", "4", "--rounds", "1", "--batch", "1", "--threads", "1",
                       "--json", str(out), "--markdown", str(page)]) == 0
    report = json.loads(out.read_text())
    expected = ({("forward", v) for v in (*bench.VARIANTS, bench.FLOOR)}
                | {("train", v) for v in (*bench.VARIANTS, bench.RECOMPUTE, bench.FLOOR)})
    if bench._timm_class("swinv2") is not None:
        expected |= {(m, bench.TIMM) for m in ("forward", "train")}
    assert {(r["mode"], r["variant"]) for r in report["results"]} == expected
    assert all(r["ms"] > 0 for r in report["results"])
    assert report["checks"]["4"]["max_abs_output_diff_fp64"] < 1e-10
    from relpos._io import generated_begin

    text = page.read_text()
    assert text.startswith(generated_begin(out)) and "relpos_recompute" in text  # the region tools/bench_tables.py checks
    assert "| forward | 4 |" in text.split("Against the floor")[1] and "the ceiling" in text
