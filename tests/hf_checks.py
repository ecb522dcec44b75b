"""Checks shared by the per-family tests of relpos.hf (tests/test_hf*.py): an accelerated copy against
transformers' own unmodified model with the same weights.

Every check takes ``reference`` (transformers' model), ``accelerated`` (``relpos.hf.accelerate`` of a
deep copy) and ``inputs`` (the keyword arguments of one padded batch, labels included).
"""

from __future__ import annotations

import copy

import torch

import relpos.hf as rh

from relpos.backends import dispatch as attention_module


#: a tiny T5-family config (random weights, built from it: nothing is downloaded)
T5_SMALL = dict(
    vocab_size=96, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=2,
    relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
    pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
)


def t5_families() -> dict:
    """family name -> (config class, model class) of the T5 families that share T5's attention (needs transformers)."""
    import transformers

    return {
        "t5": (transformers.T5Config, transformers.T5ForConditionalGeneration),
        "mt5": (transformers.MT5Config, transformers.MT5ForConditionalGeneration),
        "umt5": (transformers.UMT5Config, transformers.UMT5ForConditionalGeneration),
    }


ALIBI_VOCAB = 96
_ALIBI_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)  # attention matters at init


def alibi_families() -> dict:
    """family name -> (config builder taking overrides, causal-LM class) of the ALiBi families (tiny, no dropout)."""
    import transformers

    def build(config_class, **defaults):
        return lambda **o: config_class(**{**defaults, **_ALIBI_TOKENS, **o})

    return {
        "bloom": (build(transformers.BloomConfig, vocab_size=ALIBI_VOCAB, hidden_size=32, n_layer=2, n_head=4,
                        hidden_dropout=0.0, attention_dropout=0.0), transformers.BloomForCausalLM),
        "mpt": (build(transformers.MptConfig, vocab_size=ALIBI_VOCAB, d_model=32, n_layers=2, n_heads=4,
                      max_seq_len=128), transformers.MptForCausalLM),
        "falcon": (build(transformers.FalconConfig, vocab_size=ALIBI_VOCAB, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, alibi=True, hidden_dropout=0.0, attention_dropout=0.0),
                   transformers.FalconForCausalLM),
    }


def zero_alibi(monkeypatch) -> None:
    """transformers' own ALiBi models with their ALiBi builders returning zeros (no relpos involved)."""
    from transformers.models.bloom import modeling_bloom
    from transformers.models.falcon import modeling_falcon
    from transformers.models.mpt import modeling_mpt

    def zeros(mask, heads, dtype):
        return torch.zeros(mask.shape[0] * heads, 1, mask.shape[1], dtype=dtype)

    monkeypatch.setattr(modeling_bloom, "build_alibi_tensor", zeros)
    monkeypatch.setattr(  # transformers 5.15 has no such helper (its builder computes the slopes inline)
        modeling_bloom, "_get_alibi_slopes", lambda heads, device: torch.zeros(heads, device=device), raising=False
    )
    monkeypatch.setattr(modeling_mpt.MptModel, "build_mpt_alibi_tensor",
                        lambda self, heads, length, *a, device=None: torch.zeros(heads, 1, length, device=device))
    monkeypatch.setattr(modeling_falcon, "build_alibi_tensor", zeros)


def strong_bias(model: torch.nn.Module, std: float = 1.0, seed: int = 3) -> torch.nn.Module:
    """Every relative-bias table drawn with ``std`` (transformers' init is tiny: the bias would not matter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def make_pair(model: torch.nn.Module):
    """(transformers' model with a strong bias, an accelerated deep copy)."""
    reference = strong_bias(model).eval()
    return reference, rh.accelerate(copy.deepcopy(reference))


def padded_seq2seq(vocab_size: int, b: int = 3, length: int = 40, target: int = 30) -> dict:
    """Token ids with right padding (example 1, from 25) and left padding (example 2, up to 9), and labels
    with padding (-100, example 2 from 20): the batch every seq2seq family's tests use."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab_size, (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.long)
    mask[1, 25:] = 0
    mask[2, :9] = 0
    labels = torch.randint(2, vocab_size, (b, target), generator=g)
    labels[2, 20:] = -100
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}


def padded_decoder_batch(vocab_size: int, b: int = 3, length: int = 40):
    """ids, mask, labels for a decoder-only model: example 0 left-padded by 9, example 1 right-padded after
    31, example 2 unpadded; labels -100 on padding."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab_size, (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.long)
    mask[0, :9] = 0
    mask[1, 31:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def close(a, b, rel):
    """|a - b| <= rel * max|a| (elementwise against the tensor's scale)."""
    scale = a.abs().max().clamp(min=1e-6)
    return bool((b - a).abs().max() <= rel * scale)


def forward_loss_and_gradients(reference, accelerated, inputs, out_key="logits", real=None):
    """Training mode (dropout 0): outputs, loss and every parameter's gradient within 1e-4 relative.

    ``real`` (B, L): compare outputs there only (a left-padded query row that sees no key is zeros in relpos
    and an average of padding in transformers; the loss ignores it either way).
    """
    results = []
    for model in (reference, accelerated):
        model.train()
        model.zero_grad()
        out = model(**inputs)
        out.loss.backward()
        results.append((getattr(out, out_key).detach(), out.loss.detach(), grads(model)))
        model.eval()
    (l1, loss1, g1), (l2, loss2, g2) = results
    if real is not None:
        l1, l2 = l1[real.bool()], l2[real.bool()]
    assert close(l1, l2, 1e-4), (l2 - l1).abs().max()
    assert torch.allclose(loss2, loss1, rtol=1e-5)
    assert g1.keys() == g2.keys() and len(g1) > 5
    for name in g1:
        assert close(g1[name], g2[name], 1e-4), name
    assert any("relative_attention_bias" in n for n in g1), "no bias table got a gradient"


def bias_matters(accelerated, inputs, out_key="logits"):
    """Zeroing the bias tables changes the outputs far beyond the tolerances used here."""
    plain = copy.deepcopy(accelerated)
    strong_bias(plain, std=0.0)
    with torch.no_grad():
        a, b = getattr(accelerated(**inputs), out_key), getattr(plain(**inputs), out_key)
    assert (a - b).abs().max() > 1e-2 * a.abs().max() + 1e-2


def generate_equal(reference, accelerated, inputs, *, steps=12, samplers=True):
    """Greedy with the KV cache: identical tokens and per-step logits within 1e-5; beam and sampling: tokens."""
    common = dict(max_new_tokens=steps, min_new_tokens=steps, output_logits=True, output_scores=True,
                  return_dict_in_generate=True, do_sample=False)
    with torch.no_grad():
        a, b = reference.generate(**inputs, **common), accelerated.generate(**inputs, **common)
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits) == steps
    for x, y in zip(a.logits + a.scores, b.logits + b.scores):
        finite = torch.isfinite(x)
        assert torch.equal(finite, torch.isfinite(y))
        assert (x[finite] - y[finite]).abs().max() <= 1e-5 * max(1.0, x[finite].abs().max().item())
    if not samplers:
        return
    for kwargs in ({"num_beams": 3, "do_sample": False}, {"do_sample": True, "top_k": 10}):
        tokens = []
        for model in (reference, accelerated):
            torch.manual_seed(7)
            tokens.append(model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, return_dict_in_generate=False,
                                         **kwargs))  # Pop2Piano's generate keeps the previous call's settings
        assert torch.equal(tokens[0], tokens[1]), kwargs


def same_generation(a, b, steps: int) -> None:
    """Two ``generate(..., output_logits=True, return_dict_in_generate=True)`` results: identical tokens, every
    step's logits within 1e-5 of the logits' scale."""
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits) == steps
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max() <= 1e-5 * max(1.0, x.abs().max().item())


def bf16_within_twice_transformers_error(reference, accelerated, inputs, out_key="logits"):
    reference, accelerated = copy.deepcopy(reference), copy.deepcopy(accelerated)
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}  # features, patches
    with torch.no_grad():
        exact = getattr(reference(**inputs), out_key)
        theirs = getattr(reference.to(torch.bfloat16)(**low), out_key).float()
        ours = getattr(accelerated.to(torch.bfloat16)(**low), out_key).float()
    assert torch.isfinite(ours).all()
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-3


def restore_gives_transformers_back(reference, accelerated, inputs, out_key="logits"):
    rh.restore(accelerated)
    assert not rh.is_accelerated(accelerated)
    assert accelerated.config._attn_implementation == reference.config._attn_implementation
    for key in accelerated.config.sub_configs:
        assert getattr(accelerated.config, key)._attn_implementation == getattr(reference.config, key)._attn_implementation
    assert not any("compute_bias" in vars(m) for m in accelerated.modules())
    with torch.no_grad():
        assert torch.equal(getattr(accelerated(**inputs), out_key), getattr(reference(**inputs), out_key))


def tiles_and_fused_paths(monkeypatch, reference, accelerated, inputs, out_key="logits"):
    """A padded batch forced onto relpos's tile (inference) and fused (training) paths: equal outputs and gradients."""
    monkeypatch.setattr(attention_module, "_FUSED_MIN_SCORES", 0)
    seen = []
    real = attention_module._choose

    def spy(call):
        choice = real(call)
        seen.append(choice.backend)
        return choice

    monkeypatch.setattr(attention_module, "_choose", spy)
    with torch.no_grad():
        a, b = getattr(reference(**inputs), out_key), getattr(accelerated(**inputs), out_key)
    assert close(a, b, 1e-4)
    assert "sdpa" in seen
    seen.clear()
    forward_loss_and_gradients(reference, accelerated, inputs, out_key)
    assert "fused" in seen


def under_implementation(reference, implementation: str):
    """A copy of transformers' model whose config names ``implementation`` (read at every call; transformers' own
    ``set_attn_implementation`` ignores the call for families without an attention interface: Bloom, MPT, Falcon)."""
    model = copy.deepcopy(reference)
    model.config._attn_implementation = implementation  # every sub-config too
    return model


def switch_implementations(reference, accelerated, inputs, out_key="logits", name="relpos"):
    """transformers' own set_attn_implementation works both ways on an accelerated model: "eager" and "sdpa" (where
    the model has it) give transformers' outputs under that implementation, ``name`` (relpos's) its default ones."""
    implementations = ("eager", "sdpa") if accelerated._supports_sdpa else ("eager",)
    with torch.no_grad():
        expected = {name: getattr(reference(**inputs), out_key)}
        expected.update({i: getattr(under_implementation(reference, i)(**inputs), out_key) for i in implementations})
        for implementation in ("eager", "sdpa", name, "eager", name):
            if implementation not in expected:
                continue
            accelerated.set_attn_implementation(implementation)
            assert accelerated.config._attn_implementation == implementation
            got = getattr(accelerated(**inputs), out_key)
            assert close(expected[implementation], got, 1e-5), implementation
    assert rh.is_accelerated(accelerated)


def config_output_attentions(model_class, config, inputs, names=("encoder_attentions", "decoder_attentions", "cross_attentions")):
    """A model built with config.output_attentions=True returns every layer's weights, equal to eager's."""
    for sub in [config] + [getattr(config, key) for key in config.sub_configs]:
        sub.output_attentions = True  # (Pix2Struct's text decoder reads its text_config)
    torch.manual_seed(0)
    reference = strong_bias(model_class(config)).eval()
    accelerated = rh.accelerate(copy.deepcopy(reference))
    with torch.no_grad():
        a, b = reference(**inputs), accelerated(**inputs)
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        assert x is not None and y is not None and len(x) == len(y) > 0, name
        for wx, wy in zip(x, y):
            assert wy is not None and torch.allclose(wx, wy, atol=1e-5), name


def bias_forms(accelerated, inputs) -> dict[str, int]:
    """How many attention calls of one forward got a per-offset bias, a dense tensor, or none (cross-attention);
    transformers' dense compute_bias is never called."""
    import pytest

    import relpos.hf._attention as shared
    from relpos import OffsetBias

    forms = {"offsets": 0, "dense": 0, "none": 0}
    real = shared.attention

    def spy(query, key, value, **kwargs):
        bias = kwargs["bias"]
        forms["offsets" if isinstance(bias, OffsetBias) else "dense" if isinstance(bias, torch.Tensor) else "none"] += 1
        return real(query, key, value, **kwargs)

    def dense(*args, **kwargs):
        raise AssertionError("transformers' dense compute_bias was called")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shared, "attention", spy)
        for module in accelerated.modules():
            if "compute_bias" in vars(module):
                patch.setattr(type(module), "compute_bias", dense)
        with torch.no_grad():
            accelerated(**inputs)
    return forms


def benchmark_generate_equal(family: str) -> None:
    """``benchmarks/t5_model.py --family F --modes generate``: its model and inputs (past max_distance,
    padded) give transformers' tokens and per-step logits once accelerated, so the timed variants do
    the same work."""
    from relpos.hf import bench

    config = bench.ModelBenchConfig(d_model=32, heads=2, layers=1)
    builder = bench.BUILDERS[family]
    torch.manual_seed(0)
    reference, accelerated = make_pair(builder.build("generate", config).eval())
    ids, mask = bench._inputs(2, 160, left=builder.decoder_only)
    generate_equal(reference, accelerated, builder.generate_inputs(ids, mask, config), steps=6, samplers=False)
