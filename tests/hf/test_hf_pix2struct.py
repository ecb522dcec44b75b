"""relpos.hf.accelerate on Pix2Struct (its text decoder carries T5 buckets; its vision encoder has no relative
bias), against transformers' own model with the same weights; small configs, random weights, no downloads."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402

TEXT = dict(
    vocab_size=96, hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)
VISION = dict(hidden_size=32, patch_embed_hidden_size=12, d_ff=64, d_kv=8, num_hidden_layers=1, num_attention_heads=4, seq_len=16)


def config():
    return transformers.Pix2StructConfig(text_config=TEXT, vision_config=VISION)


def pair(text_only=False):
    """The image-to-text model, or its text decoder alone (a Pix2StructTextModel: transformers 5.23 cannot build
    one from a bare Pix2StructTextConfig, its init reads initializer_range)."""
    torch.manual_seed(0)
    model = transformers.Pix2StructForConditionalGeneration(config())
    return hf_checks.make_pair(model.decoder if text_only else model)


def patches(b=3, n=20, target=40):
    """Flattened patches (row, column, pixels) with padded patches, and labels past max_distance 16 with a
    right-padded decoder mask."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VISION["seq_len"], (b, n, 2), generator=g).float()
    flat = torch.cat([rows, torch.randn(b, n, VISION["patch_embed_hidden_size"], generator=g)], -1)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, 14:] = 0
    labels = torch.randint(2, TEXT["vocab_size"], (b, target), generator=g)
    decoder_mask = torch.ones(b, target, dtype=torch.long)
    decoder_mask[2, 30:] = 0
    return {"flattened_patches": flat, "attention_mask": mask, "labels": labels, "decoder_attention_mask": decoder_mask}


def text_padded(b=3, length=40):
    """Decoder-only text: left padding (example 1, as for generation), right padding (example 2)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, TEXT["vocab_size"], (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.long)
    mask[1, :11] = 0
    mask[2, 29:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}


def test_image_to_text_logits_loss_gradients_and_generate():
    reference, accelerated = pair()
    inputs = patches()
    assert rh.find_family(reference)[0].name == "pix2struct"
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    prompt = {"flattened_patches": inputs["flattened_patches"], "attention_mask": inputs["attention_mask"]}
    hf_checks.generate_equal(reference, accelerated, prompt, steps=20)


def test_text_model_left_and_right_padding():
    reference, accelerated = pair(text_only=True)
    assert type(reference).__name__ == "Pix2StructTextModel"
    inputs = text_padded()
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs, real=inputs["attention_mask"])


def test_switching_output_attentions_bf16_tiles_and_restore(monkeypatch):
    reference, accelerated = pair()
    inputs = patches()
    assert hf_checks.bias_forms(accelerated, inputs) == {"offsets": 2, "dense": 0, "none": 2}  # decoder self-attention per offset; cross-attention has no bias
    assert accelerated.config.vision_config._attn_implementation == reference.config.vision_config._attn_implementation
    assert accelerated.config.text_config._attn_implementation == "relpos"
    hf_checks.switch_implementations(reference, accelerated, inputs)
    hf_checks.bf16_within_twice_transformers_error(reference, accelerated, inputs)
    hf_checks.tiles_and_fused_paths(monkeypatch, reference, accelerated, inputs)
    hf_checks.restore_gives_transformers_back(reference, accelerated, inputs)
    hf_checks.config_output_attentions(
        transformers.Pix2StructForConditionalGeneration, config(), inputs, names=("decoder_attentions", "cross_attentions")
    )


def test_the_vision_model_alone_is_refused():
    vision = transformers.Pix2StructVisionModel(transformers.Pix2StructVisionConfig(**VISION))
    with pytest.raises(TypeError, match=r"Pix2Struct \(text decoder.*got Pix2StructVisionModel"):
        rh.accelerate(vision)


def test_the_model_benchmark_generates_from_this_familys_inputs():
    hf_checks.benchmark_generate_equal("pix2struct")
