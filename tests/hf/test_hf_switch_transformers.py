"""relpos.hf.accelerate on SwitchTransformers (T5 attention with mixture-of-experts feed-forwards), against
transformers' own model (eager only in transformers 5.23) with the same weights; small configs, no downloads."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402

SMALL = dict(
    vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1,
    num_sparse_decoder_layers=1, num_experts=2, expert_capacity=64, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=16, router_jitter_noise=0.0, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
    decoder_start_token_id=0,
)


def pair(model_class=transformers.SwitchTransformersForConditionalGeneration, **overrides):
    torch.manual_seed(0)
    return hf_checks.make_pair(model_class(transformers.SwitchTransformersConfig(**{**SMALL, **overrides})))


def padded(b=3, length=40, target=30):
    """Right padding (example 1), left padding (example 2), padded labels; 40 > max_distance 16."""
    return hf_checks.padded_seq2seq(SMALL["vocab_size"], b, length, target)


def test_logits_loss_gradients_and_generate_equal_transformers():
    reference, accelerated = pair()
    inputs = padded()
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    hf_checks.generate_equal(reference, accelerated, {k: inputs[k] for k in ("input_ids", "attention_mask")})


@pytest.mark.parametrize("model_class", [transformers.SwitchTransformersModel, transformers.SwitchTransformersEncoderModel])
def test_other_heads(model_class):
    reference, accelerated = pair(model_class)
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    if model_class is transformers.SwitchTransformersModel:
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :20]
    with torch.no_grad():
        a, b = reference(**inputs).last_hidden_state, accelerated(**inputs).last_hidden_state
    assert hf_checks.close(a, b, 1e-5)


def test_switching_output_attentions_bf16_tiles_and_restore(monkeypatch):
    reference, accelerated = pair()
    inputs = padded()
    assert hf_checks.bias_forms(accelerated, inputs) == {"offsets": 4, "dense": 0, "none": 2}  # encoder and decoder self-attention per offset; cross-attention has no bias
    hf_checks.switch_implementations(reference, accelerated, inputs)
    hf_checks.bf16_within_twice_transformers_error(reference, accelerated, inputs)
    hf_checks.tiles_and_fused_paths(monkeypatch, reference, accelerated, inputs)
    hf_checks.restore_gives_transformers_back(reference, accelerated, inputs)
    hf_checks.config_output_attentions(
        transformers.SwitchTransformersForConditionalGeneration, transformers.SwitchTransformersConfig(**SMALL), inputs
    )


def test_recognised_by_its_attention_modules():
    reference, accelerated = pair()
    family, modules = rh.find_family(reference)
    assert family.name == "switch_transformers" and len(modules) == 2 * 2 + 2  # self-attention per layer + cross
    assert rh.is_accelerated(accelerated) and accelerated.config._attn_implementation == "relpos"
    assert copy.deepcopy(accelerated).config._attn_implementation == "relpos"
