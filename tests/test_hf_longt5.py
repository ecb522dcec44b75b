"""relpos.hf.accelerate on LongT5 (its decoder's T5 bias on relpos; the encoder's local and transient-global
attention stay transformers'), against transformers' own model with the same weights; no downloads."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402

SMALL = dict(
    vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, local_radius=4,
    global_block_size=4, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)


def pair(model_class=transformers.LongT5ForConditionalGeneration, **overrides):
    torch.manual_seed(0)
    return hf_checks.make_pair(model_class(transformers.LongT5Config(**{**SMALL, **overrides})))


def padded(b=3, length=40, target=30):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, SMALL["vocab_size"], (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.long)
    mask[1, 25:] = 0
    mask[2, :9] = 0
    labels = torch.randint(2, SMALL["vocab_size"], (b, target), generator=g)
    labels[2, 20:] = -100
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("attention_type", ["local", "transient-global"])
def test_logits_loss_gradients_and_generate_equal_transformers(attention_type):
    reference, accelerated = pair(encoder_attention_type=attention_type)
    inputs = padded()
    assert rh.find_family(reference)[0].name == "longt5"
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    prompt = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    hf_checks.generate_equal(reference, accelerated, prompt, samplers=False)


def test_switching_output_attentions_bf16_tiles_and_restore(monkeypatch):
    reference, accelerated = pair()
    inputs = padded()
    assert hf_checks.bias_forms(accelerated, inputs) == {"offsets": 2, "dense": 0, "none": 2}  # decoder per offset; the encoder's local attention is transformers' own
    hf_checks.switch_implementations(reference, accelerated, inputs)
    hf_checks.bf16_within_twice_transformers_error(reference, accelerated, inputs)
    hf_checks.tiles_and_fused_paths(monkeypatch, reference, accelerated, inputs)
    hf_checks.restore_gives_transformers_back(reference, accelerated, inputs)
    hf_checks.config_output_attentions(
        transformers.LongT5ForConditionalGeneration, transformers.LongT5Config(**SMALL), inputs,
        names=("decoder_attentions", "cross_attentions"),
    )


def test_the_encoder_model_is_refused_naming_the_families():
    torch.manual_seed(0)
    encoder = transformers.LongT5EncoderModel(transformers.LongT5Config(**SMALL))
    with pytest.raises(TypeError, match="LongT5.*got LongT5EncoderModel with model_type='longt5' holding none"):
        rh.accelerate(encoder)
    assert not rh.is_accelerated(encoder)
