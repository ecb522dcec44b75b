"""relpos.hf.accelerate on LongT5 (the decoder's T5 bias per offset; the encoder's local and transient-global
attention as banded tiles), against transformers' own model with the same weights; no downloads."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402
import relpos.hf.longt5 as longt5  # noqa: E402

SMALL = dict(
    vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, local_radius=4,
    global_block_size=4, relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)


def pair(model_class=transformers.LongT5ForConditionalGeneration, **overrides):
    torch.manual_seed(0)
    return hf_checks.make_pair(model_class(transformers.LongT5Config(**{**SMALL, **overrides})))


def padded(b=3, length=90, target=30):
    return hf_checks.padded_seq2seq(SMALL["vocab_size"], b, length, target)


@pytest.mark.parametrize("attention_type", ["local", "transient-global"])
def test_logits_loss_gradients_and_generate_equal_transformers(attention_type):
    reference, accelerated = pair(encoder_attention_type=attention_type)
    inputs = padded()
    assert rh.find_family(reference)[0].name == "longt5"
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    prompt = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    hf_checks.generate_equal(reference, accelerated, prompt)


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


# block_len 5 and global_block_size 4: 90 tokens are 18 blocks and 22 global tokens, so the global tokens'
# offsets pass max_distance 16 (the window's offsets, at most 4, stay in the exact buckets)


@pytest.mark.parametrize("attention_type", ["local", "transient-global"])
@pytest.mark.parametrize(("chunk", "length"), [(None, 90), (1, 90), (3, 90), (3, 87), (None, 3)])
def test_the_encoder_model_equals_transformers_every_position_and_gradient(monkeypatch, attention_type, chunk, length):
    """87 tokens: the last block and the last global block are partial (orphan tokens join the block before);
    3 tokens: one block, no global token."""
    if chunk is not None:  # chunks of 1 and 3 blocks: clean chunks (one broadcast bias) beside padded ones
        monkeypatch.setattr(longt5, "_CHUNK_ELEMENTS", chunk * 3 * 4 * 5 * (15 + length // 4))
    reference, accelerated = pair(transformers.LongT5EncoderModel, encoder_attention_type=attention_type)
    inputs = {k: v[:, :length] for k, v in padded().items() if k != "labels"}
    inputs["attention_mask"][:, 0] = 1  # 3 tokens: every example keeps a real one
    weight = torch.randn(3, length, SMALL["d_model"], generator=torch.Generator().manual_seed(5))
    real = inputs["attention_mask"].bool()
    outputs = []
    for model in (reference, accelerated):
        model.train()
        model.zero_grad()
        hidden = model(**inputs).last_hidden_state
        (hidden * weight)[real].sum().backward()
        outputs.append((hidden.detach(), hf_checks.grads(model)))
    (h1, g1), (h2, g2) = outputs
    assert hf_checks.close(h1, h2, 1e-4)  # padded positions too: their rows average their window, as in transformers
    for name in g1.keys() ^ g2.keys():  # 3 tokens: transformers' zero-size global tokens give zero gradients
        assert length == 3 and not (g1 if name in g1 else g2)[name].any(), name
    g1 = {n: g for n, g in g1.items() if n in g2}
    assert any("global_relative_attention_bias" in n for n in g1) == (attention_type != "local" and length > 4)
    for name in g1:
        assert hf_checks.close(g1[name], g2[name], 1e-4), name
    assert len(g1) > 10
    if length > 3:
        hf_checks.bias_matters(accelerated, inputs, out_key="last_hidden_state")


@pytest.mark.parametrize("attention_type", ["local", "transient-global"])
def test_the_blocked_attention_never_runs_transformers_code_and_passes_the_bias_per_block(monkeypatch, attention_type):
    reference, accelerated = pair(transformers.LongT5Model, encoder_attention_type=attention_type)
    blocked = [m for m in accelerated.modules() if type(m).__name__ in longt5._LOCAL_CLASSES]
    assert len(blocked) == 2 and all("forward" in vars(m) for m in blocked)
    seen = []

    def spy(module, args, output):
        seen.append(output[1])

    for module in blocked:
        module.register_forward_hook(spy)
        monkeypatch.setattr(type(module), "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("dense")))
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    with torch.no_grad():
        accelerated(**inputs, decoder_input_ids=inputs["input_ids"][:, :7])
    assert len(seen) == 2 and seen[0] is seen[1] and isinstance(seen[0], longt5.BlockBias)
    assert seen[0].local.shape == (SMALL["num_heads"], 5, 15)  # (H, block_len, 3 block_len): no (B, H, L, L)
    assert (seen[0].side_table is None) == (attention_type == "local")


@pytest.mark.parametrize("head", ["LongT5Model", "LongT5EncoderModel"])
def test_every_head_equals_transformers(head):
    reference, accelerated = pair(getattr(transformers, head), encoder_attention_type="transient-global")
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    if head == "LongT5Model":
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :11]
    with torch.no_grad():
        a, b = reference(**inputs).last_hidden_state, accelerated(**inputs).last_hidden_state
    assert hf_checks.close(a, b, 1e-4)
    rh.restore(accelerated)
    assert not any("forward" in vars(m) for m in accelerated.modules())
    with torch.no_grad():
        assert torch.equal(reference(**inputs).last_hidden_state, accelerated(**inputs).last_hidden_state)


def test_encoder_bf16_dropout_and_output_attentions():
    reference, accelerated = pair(transformers.LongT5EncoderModel, encoder_attention_type="transient-global")
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    hf_checks.bf16_within_twice_transformers_error(reference, accelerated, inputs, out_key="last_hidden_state")
    with torch.no_grad():
        a = reference(**inputs, output_attentions=True)
        b = accelerated(**inputs, output_attentions=True)  # transformers' own blocked forward for that call
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.attentions, b.attentions)) and len(b.attentions) == 2
    _, dropped = pair(transformers.LongT5EncoderModel, dropout_rate=0.3)
    dropped.train()
    torch.manual_seed(1)
    hidden = dropped(**inputs).last_hidden_state
    hidden.sum().backward()
    dropped.eval()
    with torch.no_grad():
        assert not torch.allclose(hidden, dropped(**inputs).last_hidden_state)
    assert all(torch.isfinite(p.grad).all() for p in dropped.parameters() if p.grad is not None)


def test_a_blocked_module_that_does_not_fit_is_refused_before_any_change(monkeypatch):
    torch.manual_seed(0)
    model = transformers.LongT5EncoderModel(transformers.LongT5Config(**SMALL))
    module = next(m for m in model.modules() if type(m).__name__ == "LongT5LocalAttention")
    monkeypatch.setattr(type(module), "forward", lambda self, hidden_states, mask=None: hidden_states)
    with pytest.raises(RuntimeError, match="LongT5LocalAttention.*forward\\(hidden_states, mask, position_bias"):
        rh.accelerate(model)
    assert not rh.is_accelerated(model) and model.config._attn_implementation != "relpos"


def test_the_benchmark_measures_both_encoder_types_without_a_floor():
    """LongT5's encoder attention is not transformers' attention interface: swapping it would not remove the bias."""
    from relpos.hf import bench

    for name in ("longt5", "longt5-tglobal"):
        assert bench._variant_names(bench.BUILDERS[name]) == ("hf_eager", "relpos")
    model = bench.BUILDERS["longt5-tglobal"].build("forward", bench.ModelBenchConfig(d_model=32, heads=2, layers=1))
    assert model.config.encoder_attention_type == "transient-global"


def test_gradient_checkpointing_equal_and_reentrant_refused():
    """Non-reentrant checkpointing (transformers' default): gradients equal. A reentrant checkpoint would hand
    layer 1 a bias cut from layer 0's tables: refused (the encoder alone too, which has no decoder to catch it)."""
    reference, accelerated = pair(transformers.LongT5ForConditionalGeneration, encoder_attention_type="transient-global")
    accelerated.gradient_checkpointing_enable()
    hf_checks.forward_loss_and_gradients(reference, accelerated, padded())
    _, encoder = pair(transformers.LongT5EncoderModel)
    encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    encoder.train()
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    with pytest.raises(RuntimeError, match="use_reentrant=True"):
        encoder(**inputs).last_hidden_state.sum().backward()
