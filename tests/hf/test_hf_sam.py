"""relpos.hf.accelerate on transformers' SAM, SAM-HQ and ViTDet, against the unmodified models.

No downloads: tiny configs, random weights. The relative-position tables are drawn with std 1
(SAM initialises them to zero), so they change every output far beyond the tolerance. The patch
grid (8 x 8) is not a multiple of the window (3), so the windowed layers' padding is exercised.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import relpos.hf as rh  # noqa: E402
from relpos.hf import sam as adapter  # noqa: E402

VISION = dict(
    hidden_size=32, output_channels=16, num_hidden_layers=3, num_attention_heads=4, image_size=64, patch_size=8,
    window_size=3, global_attn_indexes=[1], mlp_dim=48, num_pos_feats=8,
)
PROMPT = dict(hidden_size=16, image_size=64, patch_size=8, mask_input_channels=4)
DECODER = dict(hidden_size=16, mlp_dim=32, num_hidden_layers=2, num_attention_heads=2, iou_head_hidden_dim=16)
VITDET = dict(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=4, image_size=64, pretrain_image_size=64, patch_size=8,
    window_block_indices=[0, 2], window_size=3, use_relative_position_embeddings=True, out_features=["stage1", "stage3"],
)


def _unit_weights(model):
    """SAM initialises with std 1e-10 (everything would be ~0): every linear / conv weight N(0, 1 / fan_in)."""
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) / fan_in**0.5)
    return model


def _randomize_tables(model, std=1.0):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("rel_pos_h", "rel_pos_w")):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def _build(kind: str, attn: str = "sdpa"):
    """A tiny model of ``kind`` whose vision attention modules are transformers' ``attn`` classes."""
    torch.manual_seed(0)
    if kind in ("sam", "sam_hq"):
        config_class, model_class = (transformers.SamConfig, transformers.SamModel) if kind == "sam" else (transformers.SamHQConfig, transformers.SamHQModel)
        decoder = DECODER if kind == "sam" else {**DECODER, "vit_dim": VISION["hidden_size"]}
        config = config_class(vision_config=VISION, prompt_encoder_config=PROMPT, mask_decoder_config=decoder)
    elif kind in ("sam_vision", "sam_hq_vision"):
        config_class, model_class = (transformers.SamVisionConfig, transformers.SamVisionModel) if kind == "sam_vision" else (transformers.SamHQVisionConfig, transformers.SamHQVisionModel)
        config = config_class(**VISION)
    else:
        config, model_class = transformers.VitDetConfig(**VITDET), transformers.VitDetBackbone
    model = model_class._from_config(config, attn_implementation="eager" if kind == "vitdet" else attn)  # ViTDet: eager only
    wanted = {"sdpa": "SdpaAttention", "eager": "VisionAttention"}[attn] if kind != "vitdet" else "VitDetAttention"
    assert any(type(m).__name__.endswith(wanted) for m in model.modules())
    return _randomize_tables(_unit_weights(model)).eval()


def _inputs(kind: str):
    g = torch.Generator().manual_seed(3)
    inputs = {"pixel_values": torch.randn(2, 3, 64, 64, generator=g)}
    if kind in ("sam", "sam_hq"):
        inputs["input_points"] = torch.rand(2, 1, 2, 2, generator=g) * 64  # (B, point batch, points, xy)
        inputs["input_labels"] = torch.tensor([[[1, 0]], [[1, 1]]])
    return inputs


def _outputs(kind: str, model, inputs) -> dict:
    if kind in ("sam", "sam_hq"):
        out = model(**inputs, multimask_output=True)
        return {"pred_masks": out.pred_masks, "iou_scores": out.iou_scores}
    if kind == "vitdet":
        return {f"feature_map{i}": f for i, f in enumerate(model(**inputs).feature_maps)}
    out = model(**inputs, output_hidden_states=True)
    return {"last_hidden_state": out.last_hidden_state, **{f"hidden_states{i}": h for i, h in enumerate(out.hidden_states)}}


def _loss(outputs: dict) -> torch.Tensor:
    total = 0.0
    for value in outputs.values():
        total = total + (value * torch.linspace(-1, 1, value.numel()).view_as(value)).sum()
    return total


KINDS = [("sam", "sdpa"), ("sam", "eager"), ("sam_vision", "sdpa"), ("sam_hq", "sdpa"), ("sam_hq_vision", "eager"), ("vitdet", "eager")]


@pytest.mark.parametrize("kind,attn", KINDS)
def test_outputs_and_every_gradient_equal_transformers(kind, attn):
    reference = _build(kind, attn)
    accelerated = rh.accelerate(copy.deepcopy(reference))
    assert rh.is_accelerated(accelerated) and rh.find_family(accelerated)[0].name == "sam"
    inputs = _inputs(kind)
    results = []
    for model in (reference, accelerated):
        model.zero_grad()
        outputs = _outputs(kind, model, inputs)
        _loss(outputs).backward()
        results.append((outputs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (ref_out, ref_grads), (our_out, our_grads) = results
    for name in ref_out:
        assert ref_out[name].abs().mean() > 1e-2, name  # not ~0
        torch.testing.assert_close(our_out[name], ref_out[name], rtol=2e-4, atol=2e-4, msg=name)
    assert ref_grads.keys() == our_grads.keys() and any("rel_pos_h" in n for n in ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(our_grads[name], ref_grads[name], rtol=2e-3, atol=2e-3, msg=name)


@pytest.mark.parametrize("kind", ["sam_vision", "vitdet"])
def test_tables_matter(kind):
    model = _build(kind)
    inputs = _inputs(kind)
    with torch.no_grad():
        with_tables = _outputs(kind, model, inputs)
        _randomize_tables(model, std=0.0)
        without = _outputs(kind, model, inputs)
    name = "last_hidden_state" if kind == "sam_vision" else "feature_map1"
    assert (with_tables[name] - without[name]).abs().max() > 0.2  # 1000x the tolerance above
    assert with_tables[name].abs().mean() > 0.1  # and the outputs are not ~0


def test_every_attention_instance_is_switched_and_restore_undoes_it(monkeypatch):
    model = _build("sam")
    modules = [m for m in model.modules() if type(m).__name__ in adapter.ATTENTION_CLASSES]
    assert len(modules) == 3  # 2 windowed + 1 global
    calls = []
    original = adapter.decomposed_attention
    monkeypatch.setattr(adapter, "decomposed_attention", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    inputs = _inputs("sam")
    with torch.no_grad():
        before = model(**inputs).pred_masks
        rh.accelerate(model)
        assert all("forward" in m.__dict__ for m in modules)
        assert "forward" not in type(modules[0]).__dict__ or type(modules[0]).forward is not modules[0].forward.__func__
        model(**inputs)
        assert sorted(c[-2] for c in calls) == [9, 9, 64]  # the windows' 3 x 3 and the 8 x 8 grid
        rh.restore(model)
        assert not any("forward" in m.__dict__ for m in modules) and not rh.is_accelerated(model)
        calls.clear()
        torch.testing.assert_close(model(**inputs).pred_masks, before, rtol=0, atol=0)
        assert calls == []


def test_other_image_size_resizes_tables_like_sam():
    reference = _build("sam_vision")
    accelerated = rh.accelerate(copy.deepcopy(reference))
    reference.config.image_size = accelerated.config.image_size = 80  # a 10 x 10 grid: tables resized
    for model in (reference, accelerated):
        model.vision_encoder.pos_embed = None
        model.vision_encoder.image_size = 80
        model.vision_encoder.patch_embed.image_size = (80, 80)
    pixels = torch.randn(1, 3, 80, 80, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(accelerated(pixels).last_hidden_state, reference(pixels).last_hidden_state, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kind,attn", [("sam_vision", "eager"), ("vitdet", "eager")])
def test_attention_weights_come_from_transformers_forward(kind, attn):
    reference = _build(kind, attn)
    accelerated = rh.accelerate(copy.deepcopy(reference))
    hidden = torch.randn(2, 8, 8, 32, generator=torch.Generator().manual_seed(8))
    get = (lambda m: m.vision_encoder.layers[1].attn) if kind == "sam_vision" else (lambda m: m.encoder.layer[1].attention)
    with torch.no_grad():
        ours, theirs = (get(m)(hidden, output_attentions=True) for m in (accelerated, reference))
    assert ours[1].shape == (8, 64, 64) or ours[1].shape == (2, 4, 64, 64)
    torch.testing.assert_close(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0])


@pytest.mark.parametrize("kind", ["sam_vision", "sam_hq_vision"])
@pytest.mark.parametrize("how", ["config", "per call"])
def test_whole_model_attention_weights_equal_transformers(kind, how):
    """SAM's layers never pass ``output_attentions`` to their attention: transformers records the weights the
    modules return. Accelerated, the model returns the same weights (``config.output_attentions = True`` or per
    call), found by transformers' own test_attention_outputs (docs/integrations/model-tests.md)."""
    reference = _build(kind, "eager")
    accelerated = rh.accelerate(copy.deepcopy(reference))
    pixels = _inputs(kind)["pixel_values"]
    flag = {"output_attentions": True} if how == "per call" else {}
    if how == "config":
        for model in (reference, accelerated):
            model.config.output_attentions = True
    with torch.no_grad():
        theirs, ours = (m(pixel_values=pixels, **flag) for m in (reference, accelerated))
    assert len(theirs.attentions) == len(reference.vision_encoder.layers) and len(ours.attentions) == len(theirs.attentions)
    for a, b in zip(ours.attentions, theirs.attentions):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state)


def test_bad_inputs():
    with pytest.raises(TypeError, match="SAM, SAM-HQ, ViTDet"):
        rh.accelerate(transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8)))
    model = rh.accelerate(_build("sam_vision"))
    layer = model.vision_encoder.layers[1].attn  # the global layer
    with torch.no_grad():
        layer.rel_pos_w = torch.nn.Parameter(torch.zeros(15, 4))  # a table for another head size
    with pytest.raises(ValueError, match="rel_pos_w must be \\(2 S - 1, head_dim=8\\)"):
        model(_inputs("sam_vision")["pixel_values"])


def test_check_refuses_a_module_that_does_not_fit():
    model = _build("sam_vision")
    layer = model.vision_encoder.layers[0].attn
    del layer.qkv
    with pytest.raises(RuntimeError, match="does not fit SamVisionSdpaAttention"):
        rh.accelerate(model)
    assert not rh.is_accelerated(model) and "forward" not in model.vision_encoder.layers[1].attn.__dict__


def test_dropout_follows_the_module():
    hidden = torch.randn(2, 8, 8, 32, generator=torch.Generator().manual_seed(9))
    for attn, applies in (("eager", True), ("sdpa", False)):
        torch.manual_seed(0)
        config = transformers.SamVisionConfig(**{**VISION, "attention_dropout": 0.5})
        reference = _randomize_tables(_unit_weights(transformers.SamVisionModel._from_config(config, attn_implementation=attn)))
        accelerated = rh.accelerate(copy.deepcopy(reference)).train()
        layer = accelerated.vision_encoder.layers[1].attn  # global
        with torch.no_grad():
            first, second = layer(hidden)[0], layer(hidden)[0]
            want = reference.vision_encoder.layers[1].attn.eval()(hidden)[0]
        assert (not torch.allclose(first, second)) == applies, attn  # SAM's eager module drops, its sdpa one never
        if not applies:
            torch.testing.assert_close(first, want, rtol=2e-4, atol=2e-4)
        layer.eval()
        with torch.no_grad():
            torch.testing.assert_close(layer(hidden)[0], want, rtol=2e-4, atol=2e-4)


def test_layers_without_relative_positions():
    torch.manual_seed(0)
    config = transformers.VitDetConfig(**{**VITDET, "use_relative_position_embeddings": False})
    reference = _unit_weights(transformers.VitDetBackbone(config)).eval()
    accelerated = rh.accelerate(copy.deepcopy(reference))
    inputs = _inputs("vitdet")
    with torch.no_grad():
        ours, theirs = (_outputs("vitdet", m, inputs) for m in (accelerated, reference))
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=2e-4, atol=2e-4)


def test_vitdet_non_square_grid_equals_transformers():
    """A 64 x 48 image (an 8 x 6 patch grid): rows and columns differ, so a swapped grid would show."""
    reference = _build("vitdet")
    accelerated = rh.accelerate(copy.deepcopy(reference))
    pixels = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref, ours = reference(pixel_values=pixels).feature_maps, accelerated(pixel_values=pixels).feature_maps
    assert ref[-1].shape[-2:] == (8, 6)
    for r, o in zip(ref, ours):
        assert r.abs().mean() > 1e-2  # not ~0
        torch.testing.assert_close(o, r, rtol=2e-4, atol=2e-4)
