"""A static cache on the ALiBi families (Bloom, MPT, Falcon), uncompiled and compiled.

A static cache hands attention its whole preallocated keys and its length as a 0-d tensor; relpos
reads that length before the cache update (``relpos.hf.alibi.cache_position``) and builds the ALiBi of
queries at that position, every later key at ``-inf`` (``PositionedOffsets``: no Python number, so a
compiled decoding step is traced once); a few query rows (a decoding step) take the model's own per-key ALiBi
(Bloom, Falcon) with the keys after the position hidden the same way. References, with the same weights:

* Bloom: transformers' own static-cache generation;
* Falcon: transformers' Falcon cannot run a static cache with ALiBi (its ``build_alibi_tensor`` gets
  the 4-D mask generation builds for it; it raises), so its dynamic-cache generation;
* MPT: transformers ignores ``cache_implementation="static"`` for MPT and its generation fails with an
  explicit ``StaticCache`` (in transformers' own code, accelerated or not); forward calls on a
  ``StaticCache`` are compared with transformers' dynamic cache.

No downloads: tiny models from configs with random weights.
"""

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402
import relpos.hf.alibi as hf_alibi  # noqa: E402
from transformers.cache_utils import DynamicCache, StaticCache  # noqa: E402

FAMILIES = hf_checks.alibi_families()
GENERATING = ["bloom", "falcon"]  # MPT: transformers has no static-cache generation for it (module docstring)


def pair(family, **overrides):
    """(transformers' model, an accelerated deep copy), eval mode."""
    build, model_class = FAMILIES[family]
    torch.manual_seed(0)
    reference = model_class(build(**overrides)).eval()
    return reference, rh.accelerate(copy.deepcopy(reference))


def prompts(batch=2, length=9, seed=1):
    """Prompts, the first left-padded by 3 (decoder-only generation pads on the left)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, hf_checks.ALIBI_VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def generate(model, inputs, steps, **kwargs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, **kwargs)


def reference_generate(family, reference, inputs, steps):
    """transformers' static-cache generation where it has one (Bloom), else its dynamic-cache generation."""
    return generate(reference, inputs, steps, **({"cache_implementation": "static"} if family == "bloom" else {}))


def assert_alibi_matters(monkeypatch, family, reference, inputs, steps, out):
    """transformers' model with its ALiBi zeroed generates logits far from ``out`` (so equality is evidence)."""
    with monkeypatch.context() as patch:
        hf_checks.zero_alibi(patch)
        plain = generate(reference, inputs, steps)
    assert max((x - y).abs().max().item() for x, y in zip(out.logits, plain.logits)) > 1e-2


def spy_attention(monkeypatch):
    """Records (bias, causal flag) of every relpos attention call of the ALiBi families."""
    seen = []
    real = hf_alibi.attention

    def spy(query, key, value, **kwargs):
        seen.append((kwargs["bias"], kwargs["causal"]))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(hf_alibi, "attention", spy)
    return seen


def spy_decoding_terms(monkeypatch):
    """Records (bias, position, terms) of every call of the few-rows path's (B, H, Lq, Lk) term."""
    seen = []
    real = hf_alibi._decoding_terms

    def spy(bias, key_mask, query_length, key_length, position, dtype):
        terms = real(bias, key_mask, query_length, key_length, position, dtype)
        seen.append((bias, position, terms))
        return terms

    monkeypatch.setattr(hf_alibi, "_decoding_terms", spy)
    return seen


@pytest.mark.parametrize("family", GENERATING)
def test_static_cache_generate_equals_transformers(family, monkeypatch):
    """20 greedy steps over a 28-key cache: transformers' tokens and per-step logits. Every layer of every step (the
    9-token prompt too: a few rows) took the model's own per-key ALiBi as a dense term at the cache's position (a tensor),
    the unseen tail and the padding at the dtype's minimum, and no relpos attention call."""
    reference, accelerated = pair(family)
    inputs, steps = prompts(), 20
    seen, terms = spy_attention(monkeypatch), spy_decoding_terms(monkeypatch)
    out = generate(accelerated, inputs, steps, cache_implementation="static")
    expected = reference_generate(family, reference, inputs, steps)
    hf_checks.same_generation(expected, out, steps)
    assert_alibi_matters(monkeypatch, family, reference, inputs, steps, expected)
    if family == "bloom":
        layers = accelerated.config.n_layer
        assert not seen and len(terms) == steps * layers  # the prompt and steps - 1 decoding steps, each layer
        assert all(isinstance(bias, hf_alibi.PerKey) for bias, _, _ in terms)
        assert all(isinstance(position, torch.Tensor) for _, position, _ in terms[layers:])  # the prompt's is 0
        keys = inputs["input_ids"].shape[1] + steps - 1  # the cache: the last token is never fed back
        assert {t.shape[-1] for _, _, t in terms} == {keys}
        step = terms[layers][2]  # step 1: the query at position 9 sees keys 0..9, the rest is the unseen tail
        lowest = torch.finfo(step.dtype).min
        assert step.shape[2] == 1 and (step[1, :, 0, :10] > lowest).all() and (step[:, :, 0, 10:] == lowest).all()
        assert (step[0, :, 0, :3] == lowest).all() and (step[0, :, 0, 3:10] > lowest).all()  # the left padding


@pytest.mark.parametrize("family", GENERATING)
def test_static_cache_generate_with_a_batch_of_one(family, monkeypatch):
    reference, accelerated = pair(family)
    inputs, steps = {name: t[1:] for name, t in prompts().items()}, 12  # the unpadded prompt
    out = generate(accelerated, inputs, steps, cache_implementation="static")
    expected = reference_generate(family, reference, inputs, steps)
    assert out.sequences.shape[0] == 1
    hf_checks.same_generation(expected, out, steps)
    assert_alibi_matters(monkeypatch, family, reference, inputs, steps, expected)


def chunk_logits(model, inputs, cache, sizes=(5, 3, 1, 4), output_attentions=False):
    """Logits (and weights) of the prompt fed in chunks over ``cache``, each with the mask of the tokens so far
    (shorter than a static cache: its unseen tail is hidden)."""
    logits, weights, start = [], [], 0
    cache_name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"  # 5.24
    with torch.no_grad():
        for size in sizes:
            out = model(input_ids=inputs["input_ids"][:, start : start + size],
                        attention_mask=inputs["attention_mask"][:, : start + size], **{cache_name: cache},
                        use_cache=True, output_attentions=output_attentions)
            logits.append(out.logits)
            weights.append(out.attentions)
            start += size
    return logits, weights


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunks_on_a_static_cache_equal_a_dynamic_cache(family):
    """Several tokens at a time on a 16-key StaticCache (the first chunk fills an empty cache, the others start
    at a tensor length): every real token's logits and attention weights equal transformers' model with its
    dynamic cache; the static weights are 0 on the unseen tail. (transformers' own Bloom and Falcon raise
    here: their ALiBi is built from the shorter mask. Falcon's weights are not compared: transformers' Falcon
    adds its ALiBi twice when it returns them, docs/integrations/alibi.md.)"""
    reference, accelerated = pair(family)
    inputs = prompts(length=13)
    expected, _ = chunk_logits(reference, inputs, DynamicCache(config=reference.config))
    _, expected_weights = chunk_logits(reference, inputs, DynamicCache(config=reference.config),
                                       output_attentions=family != "falcon")
    got, got_weights = chunk_logits(accelerated, inputs, StaticCache(config=accelerated.config, max_cache_len=16),
                                    output_attentions=True)
    real = inputs["attention_mask"].bool()
    start = 0
    for x, y, wx, wy in zip(expected, got, expected_weights, got_weights):
        rows = real[:, start : start + x.shape[1]]  # (B, chunk): padding positions' logits are not compared
        assert (x - y)[rows].abs().max() <= 1e-5 * max(1.0, x.abs().max().item())
        for layer_x, layer_y in zip(wx or (), wy):  # (B, H, chunk, seen) and (B, H, chunk, 16)
            seen = layer_x.shape[-1]
            assert (layer_x - layer_y[..., :seen]).abs()[rows[:, None, :, None].expand_as(layer_x)].max() <= 1e-5
            assert (layer_y[..., seen:][rows[:, None, :, None].expand(-1, *layer_y.shape[1:3], 16 - seen)] == 0).all()
        assert len(wy) == 2 and all(w.shape[-1] == 16 for w in wy)
        start += x.shape[1]


@pytest.mark.parametrize("family", GENERATING)
def test_compiled_static_cache_generate(family):
    """transformers' compiled generation (its test_generate_compile_model_forward_fullgraph): the decoding step
    compiled by generate() with the inductor CPU backend, fullgraph=True, dynamic=False. Tokens and per-step
    logits equal the reference for two batches; the step is compiled once (other prompts, then fewer steps,
    under fail_on_recompile: transformers' test_static_cache_no_recompile_with_smaller_length). One layer keeps
    inductor's C++ compile short."""
    from torch._dynamo.utils import counters

    layers = {"n_layer": 1} if family == "bloom" else {"num_hidden_layers": 1}
    reference, accelerated = pair(family, **layers)
    compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default")
    compile_config._compile_all_devices = True  # transformers' test does the same to compile on CPU
    first, second, steps = prompts(seed=1), prompts(seed=2), 8
    torch._dynamo.reset()
    counters.clear()
    out = generate(accelerated, first, steps, cache_implementation="static", compile_config=compile_config)
    assert hasattr(accelerated, "_compiled_call")  # generate() compiled the decoding step
    assert counters["stats"]["unique_graphs"] == 1
    hf_checks.same_generation(reference_generate(family, reference, first, steps), out, steps)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = generate(accelerated, second, steps, cache_implementation="static", compile_config=compile_config)
        shorter = generate(accelerated, first, 4, cache_implementation="static", compile_config=compile_config)
    assert counters["stats"]["unique_graphs"] == 1
    hf_checks.same_generation(reference_generate(family, reference, second, steps), out, steps)
    hf_checks.same_generation(reference_generate(family, reference, first, 4), shorter, 4)
    torch._dynamo.reset()
