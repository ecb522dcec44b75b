"""relpos.hf.accelerate on Pop2Piano (T5 over audio features writing MIDI tokens), against transformers' own
model with the same weights; small configs, random weights, no downloads."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402

SMALL = dict(
    vocab_size=96, composer_vocab_size=4, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
    eos_token_id=1, decoder_start_token_id=0,
)


def pair():
    torch.manual_seed(0)
    return hf_checks.make_pair(transformers.Pop2PianoForConditionalGeneration(transformers.Pop2PianoConfig(**SMALL)))


def padded(b=3, length=40, target=30):
    """Audio features with right padding (example 1) and left padding (example 2); 40 > max_distance 16."""
    inputs = hf_checks.padded_seq2seq(SMALL["vocab_size"], b, length, target)
    features = torch.randn(b, length, SMALL["d_model"], generator=torch.Generator().manual_seed(2))
    return {"input_features": features, "attention_mask": inputs["attention_mask"], "labels": inputs["labels"]}


def test_logits_loss_gradients_and_generate_equal_transformers():
    reference, accelerated = pair()
    inputs = padded()
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    for model in (reference, accelerated):
        model.generation_config.composer_to_feature_token = {f"composer{i}": 90 + i for i in range(1, 5)}  # from the checkpoint
    prompt = {"input_features": inputs["input_features"], "attention_mask": inputs["attention_mask"]}
    hf_checks.generate_equal(reference, accelerated, prompt)


def test_switching_output_attentions_bf16_tiles_and_restore(monkeypatch):
    reference, accelerated = pair()
    inputs = padded()
    assert rh.find_family(reference)[0].name == "pop2piano"
    assert hf_checks.bias_forms(accelerated, inputs) == {"offsets": 4, "dense": 0, "none": 2}  # encoder and decoder self-attention per offset; cross-attention has no bias
    hf_checks.switch_implementations(reference, accelerated, inputs)
    hf_checks.bf16_within_twice_transformers_error(reference, accelerated, inputs)
    hf_checks.tiles_and_fused_paths(monkeypatch, reference, accelerated, inputs)
    hf_checks.restore_gives_transformers_back(reference, accelerated, inputs)
    hf_checks.config_output_attentions(
        transformers.Pop2PianoForConditionalGeneration, transformers.Pop2PianoConfig(**SMALL), inputs
    )


def test_the_model_benchmark_generates_from_this_familys_inputs():
    hf_checks.benchmark_generate_equal("pop2piano")
