"""A static cache (``cache_implementation="static"``) on relpos's per-offset bias, uncompiled and compiled.

A static cache hands the attention its length as a 0-d tensor and its whole preallocated keys; relpos
builds the per-offset bias from that tensor (``PositionedOffsets``: no Python number, the causal mask and
the unseen tail as ``-inf`` in the values), so a compiled decoding step is traced once. Against
transformers' own unmodified models with the same weights (tables with std 1: the bias matters).
No downloads: tiny models from configs with random weights.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import relpos.hf as rh  # noqa: E402
import hf_checks  # noqa: E402
from relpos.hf._t5like import PositionedOffsets  # noqa: E402
from transformers.cache_utils import EncoderDecoderCache, StaticCache  # noqa: E402

SMALL = hf_checks.T5_SMALL
FAMILIES = hf_checks.t5_families()


def strong_pair(family, **overrides):
    """(transformers' model with tables of std 1, an accelerated deep copy)."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    return hf_checks.make_pair(model_class(config_class(**{**SMALL, **overrides})))


def prompts(length=12, seed=1):
    """Two prompts, the second right-padded from 8 (the cross-attention's padding mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, SMALL["vocab_size"], (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, 8:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def static_generate(model, inputs, steps, **kwargs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              cache_implementation="static", output_logits=True, return_dict_in_generate=True,
                              **kwargs)


assert_same_generation = hf_checks.same_generation


def assert_bias_matters(reference, inputs, steps, out):
    """Zeroing the tables moves the logits far beyond the tolerance above (so equality is evidence)."""
    plain = hf_checks.strong_bias(copy.deepcopy(reference), std=0.0)
    zero = static_generate(plain, inputs, steps)
    assert max((x - y).abs().max().item() for x, y in zip(out.logits, zero.logits)) > 1e-2


def spy_attention(monkeypatch):
    """Records (bias, causal flag) of every relpos attention call."""
    seen = []
    real = rh._attention.attention

    def spy(query, key, value, **kwargs):
        seen.append((kwargs["bias"], kwargs["causal"]))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(rh._attention, "attention", spy)
    return seen


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_cache_generate_equals_transformers(family, monkeypatch):
    """Uncompiled: 20 greedy steps (decoder offsets past max_distance 16) give transformers' tokens and
    per-step logits; every decoding step ran on the tensor-position bias over the whole cache."""
    reference, accelerated = strong_pair(family)
    inputs, steps = prompts(), 20
    seen = spy_attention(monkeypatch)
    a, b = static_generate(reference, inputs, steps), static_generate(accelerated, inputs, steps)
    assert_same_generation(a, b, steps)
    assert_bias_matters(reference, inputs, steps, a)
    positioned = [(bias, causal) for bias, causal in seen
                  if isinstance(bias, PositionedOffsets) and isinstance(bias.position, torch.Tensor)]
    decoder_layers = SMALL["num_decoder_layers"]
    assert len(positioned) == (steps - 1) * decoder_layers  # every self-attention layer of every decoding step
    assert all(not causal and bias.causal_folded and bias.query_length == 1 for bias, causal in positioned)
    assert {bias.key_length for bias, _ in positioned} == {steps}  # the whole cache (the last token is never fed back)
    assert torch.isneginf(positioned[0][0].values[:, 2:]).all()  # step 1: keys 2.. are the unseen tail


def test_static_cache_generate_with_a_batch_of_one():
    """One prompt (no padding anywhere): 20 greedy steps give transformers' tokens and per-step logits."""
    reference, accelerated = strong_pair("t5")
    inputs, steps = {name: t[:1] for name, t in prompts().items()}, 20
    a, b = static_generate(reference, inputs, steps), static_generate(accelerated, inputs, steps)
    assert a.sequences.shape[0] == 1
    assert_same_generation(a, b, steps)
    assert_bias_matters(reference, inputs, steps, a)


@pytest.mark.parametrize("family", [
    "t5",
    # transformers 5.15's UMT5 decoder self-attention is not flagged causal (is_causal=False): its own eager and
    # sdpa paths then disagree (by 2.6 in these logits) for several decoder tokens; 5.24 flags it
    pytest.param("umt5", marks=pytest.mark.newest_transformers),
])
def test_chunks_on_a_filled_static_cache(family):
    """Several decoder tokens at once on a static cache that already holds tokens (the position is a tensor
    and the queries see each other causally): logits of every chunk equal transformers'."""
    reference, accelerated = strong_pair(family)
    inputs = prompts()
    g = torch.Generator().manual_seed(5)
    decoder_ids = torch.randint(2, SMALL["vocab_size"], (2, 13), generator=g)
    logits = []
    for model in (reference, accelerated):
        config = model.config
        cache = EncoderDecoderCache(StaticCache(config=config, max_cache_len=16),
                                    StaticCache(config=config, max_cache_len=inputs["input_ids"].shape[1]))
        with torch.no_grad():
            encoded = model.get_encoder()(**inputs)
            chunks, start = [], 0
            for size in (5, 3, 1, 4):  # the first fills an empty cache; the others start at a tensor length
                out = model(encoder_outputs=encoded, attention_mask=inputs["attention_mask"],
                            decoder_input_ids=decoder_ids[:, start : start + size], past_key_values=cache, use_cache=True)
                chunks.append(out.logits)
                start += size
        assert int(cache.self_attention_cache.get_seq_length()) == 13
        logits.append(chunks)
    for x, y in zip(*logits):
        assert (x - y).abs().max() <= 1e-5 * max(1.0, x.abs().max().item())


@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_compiled_static_cache_generate(family):
    """transformers' compiled generation (its test_generate_compile_model_forward_fullgraph): the decoding step
    compiled by generate() with the inductor CPU backend, fullgraph=True, dynamic=False. Tokens and per-step
    logits equal transformers' for two prompts; the step is compiled once and never again (generate() with other
    prompts, then with fewer steps, under fail_on_recompile: transformers' test_static_cache_no_recompile_with_smaller_length).
    One layer per stack keeps inductor's C++ compile short (about 20 s cold on 2 cores, 6 s with inductor's cache)."""
    from torch._dynamo.utils import counters

    reference, accelerated = strong_pair(family, num_layers=1, num_decoder_layers=1)
    compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default")
    compile_config._compile_all_devices = True  # transformers' test does the same to compile on CPU
    first, second, steps = prompts(10, seed=1), prompts(10, seed=2), 8
    torch._dynamo.reset()
    counters.clear()
    out = static_generate(accelerated, first, steps, compile_config=compile_config)
    assert hasattr(accelerated, "_compiled_call")  # generate() compiled the decoding step
    assert counters["stats"]["unique_graphs"] == 1  # 7 decoding steps, one graph
    expected = static_generate(reference, first, steps)
    assert_same_generation(expected, out, steps)
    with torch.compiler.set_stance("fail_on_recompile"):  # other prompts; then fewer steps (the cache keeps its size)
        out = static_generate(accelerated, second, steps, compile_config=compile_config)
        shorter = static_generate(accelerated, first, 4, compile_config=compile_config)
    assert counters["stats"]["unique_graphs"] == 1
    expected = static_generate(reference, second, steps)
    assert_same_generation(expected, out, steps)
    assert_same_generation(static_generate(reference, first, 4), shorter, 4)
    assert_bias_matters(reference, second, steps, expected)
    torch._dynamo.reset()
