"""relpos.hf.accelerate for the ALiBi families (Bloom, MPT, Falcon with alibi=True), against the unmodified models.

No downloads: small configs, random weights. Every comparison is with transformers' own model holding
the same weights; batches mix left padding (decoder-only generation), right padding and no padding.
"""

import copy
import functools
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402
import relpos.hf.alibi as hf_alibi  # noqa: E402
from relpos import OffsetBias  # noqa: E402
from oracles import paper_slopes  # noqa: E402
from transformers.models.bloom import modeling_bloom  # noqa: E402
from transformers.models.falcon import modeling_falcon  # noqa: E402
from transformers.models.mpt import modeling_mpt  # noqa: E402

from relpos.backends import _head_dim as head_dim  # noqa: E402
from relpos.backends import dispatch as relpos_attention

VOCAB = hf_checks.ALIBI_VOCAB
CONFIGS = {family: build for family, (build, _) in hf_checks.alibi_families().items()}
HEADS = {
    "bloom": ("Bloom", transformers.BloomForCausalLM),
    "mpt": ("Mpt", transformers.MptForCausalLM),
    "falcon": ("Falcon", transformers.FalconForCausalLM),
}
FAMILIES = sorted(CONFIGS)


def pair(family, model_class=None, **overrides):
    """(transformers' model, an accelerated deep copy with the same weights), both in eval mode."""
    torch.manual_seed(0)
    reference = (model_class or HEADS[family][1])(CONFIGS[family](**overrides)).eval()
    return reference, rh.accelerate(copy.deepcopy(reference))


def batch(b=3, length=40):
    """Example 0 left-padded by 9, example 1 right-padded after 31, example 2 unpadded; labels -100 on padding."""
    return hf_checks.padded_decoder_batch(VOCAB, b, length)


def assert_close(ours, theirs, rel=1e-4, what=""):
    """max |ours - theirs| <= rel * max |theirs|: relative to the tensor's scale."""
    scale = theirs.abs().max().clamp_min(1e-12)
    err = (ours - theirs).abs().max()
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel} * {scale:.3g}"


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def train_step(model, ids, mask, labels):
    model.train()  # dropout 0: training mode, deterministic
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out, grads(model)


def compare_training(reference, accelerated, ids, mask, labels):
    # transformers' Falcon runs SDPA; on CPU its flash kernel's backward is off by up to ~30x on the rows a left
    # padding masks entirely (the dtype's minimum swallows log(Lk)), so the reference runs SDPA's math kernel
    with sdpa_kernel(SDPBackend.MATH):
        a, ga = train_step(reference, ids, mask, labels)
    b, gb = train_step(accelerated, ids, mask, labels)
    assert_close(b.logits, a.logits, what="logits")
    assert_close(b.loss, a.loss, what="loss")
    assert ga.keys() == gb.keys() and len(ga) == len(list(reference.parameters()))
    for name in ga:
        assert_close(gb[name], ga[name], what=name)


def _hard_padding(length):
    """A batch of 4: left padding, a hole in the padding (Bloom's positions skip it), an example with no real token
    (with one label, so it has a gradient too), and a full one."""
    ids, mask, labels = hf_checks.padded_decoder_batch(hf_checks.ALIBI_VOCAB, 4, length)
    mask[0, :4] = 0  # left padding
    mask[1, 5:7] = 0  # a hole
    mask[1, 7:] = 1
    mask[3] = 0  # no real token
    ids, labels = ids.masked_fill(mask == 0, 0), labels.masked_fill(mask == 0, -100)
    labels[3, -1] = 5
    return ids, mask, labels


def _assert_alibi_matters(reference, ids, mask, monkeypatch):
    """transformers' own logits move far beyond the tests' tolerance when its ALiBi is zeroed."""
    with monkeypatch.context() as patch, torch.no_grad():
        hf_checks.zero_alibi(patch)
        plain = reference(input_ids=ids, attention_mask=mask).logits
    reference.eval()
    with torch.no_grad():
        assert (reference(input_ids=ids, attention_mask=mask).logits - plain).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_every_gradient_equal_transformers(family):
    reference, accelerated = pair(family)
    compare_training(reference, accelerated, *batch())


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_a_few_rows_train_through_the_per_key_term_like_transformers(family, monkeypatch):
    """A prompt of at most PER_KEY_ROWS tokens takes the model's own per-key ALiBi (PerKey) on the general path when
    gradients are on: logits, loss and every gradient equal transformers' with left padding, a hole in the padding
    and an example with no real token, and the ALiBi changes the logits far beyond the tolerance."""
    reference, accelerated = pair(family)
    ids, mask, labels = _hard_padding(hf_alibi.PER_KEY_ROWS - 2)
    seen = []
    real = hf_alibi.alibi_attention
    monkeypatch.setattr(importlib.import_module(f"relpos.hf.{family}"), "alibi_attention",
                        lambda *a, **kw: seen.append(type(kw["bias"]).__name__) or real(*a, **kw))
    compare_training(reference, accelerated, ids, mask, labels)
    assert seen and set(seen) == {"PerKey"}, seen
    _assert_alibi_matters(reference, ids, mask, monkeypatch)


@pytest.mark.parametrize("family", FAMILIES)
def test_tile_and_fused_paths_equal_transformers(family, monkeypatch):
    """Forced past the small-problem shortcut: tiles (padding, causal) and each relpos backend."""
    reference, accelerated = pair(family)
    ids, mask, labels = batch()
    monkeypatch.setattr(relpos_attention, "_FUSED_MIN_SCORES", 0)
    compare_training(reference, accelerated, ids, mask, labels)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        for backend in ("eager", "sdpa", "fused"):
            monkeypatch.setattr(hf_alibi, "attention", functools.partial(relpos_attention.attention, backend=backend))
            assert_close(accelerated(input_ids=ids, attention_mask=mask).logits, expected, what=backend)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_alibi_term_changes_the_logits_far_beyond_the_tolerance(family, monkeypatch):
    reference, _ = pair(family)
    ids, mask, _ = batch()
    with torch.no_grad():
        with_alibi = reference(input_ids=ids, attention_mask=mask).logits
        hf_checks.zero_alibi(monkeypatch)
        without = reference(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (with_alibi - without)[real].abs().max() > 1e3 * 1e-4 * with_alibi.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_identical_tokens_and_step_logits_with_left_padding(family):
    reference, accelerated = pair(family)
    ids, mask, _ = batch(length=24)
    ids, mask = ids[[0, 2]], mask[[0, 2]]  # left padding only, as for decoder-only generation
    for kwargs in ({"do_sample": False}, {"num_beams": 2, "do_sample": False}, {"do_sample": True, "top_k": 10}):
        outs = []
        for model in (reference, accelerated):
            torch.manual_seed(7)
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                       output_logits=True, return_dict_in_generate=True, **kwargs))
        assert torch.equal(outs[0].sequences, outs[1].sequences), kwargs
        assert len(outs[0].logits) == len(outs[1].logits) == 6
        for step, (a, b) in enumerate(zip(outs[0].logits, outs[1].logits)):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, a.abs().max().item()), (kwargs, step)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_matches_one_full_pass(family):
    """Decoding step by step with the KV cache (left padding) gives the logits of one pass over everything."""
    _, accelerated = pair(family)
    assert_cached_decoding_equals_one_pass(accelerated, length=20, prefix=12, what="cached")


def assert_cached_decoding_equals_one_pass(model, length, prefix, what):
    """A prefix pass, then one token at a time with the KV cache: the logits of one pass over everything."""
    ids, mask, _ = batch(length=length)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        out = model(input_ids=ids[:, :prefix], attention_mask=mask[:, :prefix], use_cache=True)
        steps = [out.logits]
        for t in range(prefix, length):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1],
                        past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    real = mask.bool()  # left-padding rows average over the keys present, which a prefix pass has fewer of
    assert_close(torch.cat(steps, dim=1)[real], full[real], rel=1e-5, what=what)


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_mpt_fits_either_name_of_the_cache_argument(name, monkeypatch):
    """transformers 5.24 renamed MptAttention.forward's ``past_key_values`` to ``cache``: both signatures are
    accepted, the cache reaches relpos's forward under either keyword, and decoding equals one full pass."""
    import inspect

    def old(self, hidden_states, position_bias, past_key_values=None, attention_mask=None, **kwargs):
        raise AssertionError("transformers' forward must not run on the accelerated model")

    def new(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        raise AssertionError("transformers' forward must not run on the accelerated model")

    # the <= 5.23 or the 5.24 signature, whatever transformers is installed
    monkeypatch.setattr(modeling_mpt.MptAttention, "forward", old if name == "past_key_values" else new)
    assert name in inspect.signature(modeling_mpt.MptAttention.forward).parameters
    accelerated = rh.accelerate(HEADS["mpt"][1](CONFIGS["mpt"]()).eval())
    calls = []

    def renamed(relpos_forward):
        """What MptBlock calls: records its keywords, hands relpos's forward the cache under ``name``."""
        def forward(*args, **kwargs):
            calls.append(sorted(kwargs))
            given = [kwargs.pop(k, None) for k in ("cache", "past_key_values")]  # the installed MptBlock's keyword
            cache = given[0] if given[0] is not None else given[1]
            return relpos_forward(*args, **{name: cache}, **kwargs)
        return forward

    for module in accelerated.modules():
        if isinstance(module, modeling_mpt.MptAttention):
            module.forward = renamed(module.forward)
    assert_cached_decoding_equals_one_pass(accelerated, length=16, prefix=10, what=f"decoding with the cache as {name}=")
    assert calls and all("cache" in k or "past_key_values" in k for k in calls)  # MptBlock hands the cache over


HEAD_NAMES = ("ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "Model")


@pytest.mark.parametrize("head", HEAD_NAMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_task_head(family, head):
    model_class = getattr(transformers, HEADS[family][0] + head)
    reference, accelerated = pair(family, model_class=model_class)
    ids, mask, _ = batch()
    with torch.no_grad():
        a, b = reference(input_ids=ids, attention_mask=mask), accelerated(input_ids=ids, attention_mask=mask)
    keys = [k for k in ("logits", "start_logits", "end_logits", "last_hidden_state") if getattr(a, k, None) is not None]
    assert keys
    for key in keys:
        assert_close(getattr(b, key), getattr(a, key), what=key)


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("bloom", {"n_head": 6, "hidden_size": 48}),  # 6 heads: not a power of two
        ("mpt", {"n_heads": 6, "d_model": 48}),
        ("mpt", {"attn_config": {"clip_qkv": 0.05, "softmax_scale": 0.9}}),
        ("falcon", {"multi_query": False}),
        ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
        ("falcon", {"num_attention_heads": 6, "hidden_size": 48}),
    ],
)
def test_variants(family, overrides):
    """Head counts (power of two or not: slopes and their order), MPT's clip_qkv/softmax_scale, Falcon's kv heads."""
    reference, accelerated = pair(family, **overrides)
    compare_training(reference, accelerated, *batch())


def test_bloom_padding_with_holes_counts_positions_as_bloom():
    """Bloom's positions skip masked tokens (cumsum): a mask with holes takes the exact per-key path."""
    reference, accelerated = pair("bloom")
    ids, mask, labels = batch()
    mask[2, 10:14] = 0
    labels[2, 10:14] = -100
    assert not hf_alibi.contiguous(mask.bool())
    compare_training(reference, accelerated, ids, mask, labels)


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_on_the_kernels_device_a_prompt_takes_the_per_key_alibi_in_the_kernel(family, monkeypatch):
    """Where the Triton kernel runs (a GPU; here the CPU under Triton's interpreter, added to the kernel's devices),
    a prompt takes the model's own per-key ALiBi in the kernel (key_bias_attention): no check of the padding read
    back (Bloom's contiguous()), no extra channel (Falcon's fold); logits, loss and every gradient equal
    transformers' with left padding, a hole in the padding (Bloom's positions skip it) and an example with no real
    token; and the per-key term moves the logits far beyond the tolerance."""
    pytest.importorskip("triton")
    monkeypatch.setattr(hf_alibi, "PER_KEY_KERNEL_DEVICES", ("cuda", "cpu"))
    module = importlib.import_module(f"relpos.hf.{family}")
    calls = []
    real = hf_alibi.key_bias_attention
    monkeypatch.setattr(hf_alibi, "key_bias_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    refused = lambda *a, **kw: pytest.fail("the kernel route needs neither the padding check nor the channel")  # noqa: E731
    monkeypatch.setattr(module, "per_key_channel", refused)
    if family == "bloom":
        monkeypatch.setattr(module, "contiguous", refused)
    reference, accelerated = pair(family)
    ids, mask, labels = _hard_padding(24)  # past PER_KEY_ROWS
    compare_training(reference, accelerated, ids, mask, labels)
    assert len(calls) == accelerated.config.num_hidden_layers and all(shape[2] == 24 for shape in calls), calls
    _assert_alibi_matters(reference, ids, mask, monkeypatch)


def test_contiguity_is_read_once_per_mask_and_again_when_it_changes():
    """Every layer of a forward checks the same mask: the second check reads nothing (no operator, no read back to
    the host); the same tensor changed in place, or another mask, is checked again."""
    from operators import dispatched

    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    assert hf_alibi.contiguous(mask)
    answers = []
    assert not dispatched(lambda: answers.append(hf_alibi.contiguous(mask))) and answers == [True]
    mask[0, 5] = False  # a hole, made in place
    assert not hf_alibi.contiguous(mask)
    assert hf_alibi.contiguous(torch.ones(2, 10, dtype=torch.bool))


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_the_per_key_channel_padded_to_a_head_dim_multiple_is_exact(family, monkeypatch):
    """On CUDA the extra per-key channel is padded with zeros to a head dimension of a multiple of 8 (SDPA's fused
    kernels want one); forced here on the CPU: logits, loss and every gradient still equal transformers'."""
    monkeypatch.setitem(head_dim.MULTIPLE, "cpu", 8)
    widths = []
    real = hf_alibi.attention
    monkeypatch.setattr(hf_alibi, "attention", lambda q, k, v, **kw: widths.append(q.shape[-1]) or real(q, k, v, **kw))
    reference, accelerated = pair(family)
    ids, mask, labels = batch()
    mask[2, 10:14] = 0  # Bloom: holes take the per-key path
    labels[2, 10:14] = -100
    compare_training(reference, accelerated, ids, mask, labels)
    assert widths and set(widths) == {16}  # head dim 8 + the channel + 7 zeros


def test_falcon_alibi_past_position_256_is_falcons_bfloat16_rounding():
    """Falcon rounds slope * position to bfloat16: past 256 it is no function of the offset; the result still matches."""
    reference, accelerated = pair("falcon")
    alibi = modeling_falcon.build_alibi_tensor(torch.ones(1, 300, dtype=torch.long), 4, torch.float32)[:, 0]  # (H, L)
    slopes = alibi[:, 1:2]
    assert not torch.equal(alibi, slopes * torch.arange(300.0))  # rounded: not m * position
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 300), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    with torch.no_grad():
        assert_close(accelerated(input_ids=ids, attention_mask=mask).logits,
                     reference(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_the_bias_is_relpos_alibi_per_offset_and_never_dense(family, monkeypatch):
    reference, accelerated = pair(family)
    ids, mask, labels = batch()
    monkeypatch.setattr(relpos_attention, "_FUSED_MIN_SCORES", 0)
    seen = []
    real = hf_alibi.attention

    def spy(query, key, value, **kwargs):
        seen.append(kwargs["bias"])
        return real(query, key, value, **kwargs)

    def dense(self):
        raise AssertionError("a (B, H, Lq, Lk) bias was built")

    monkeypatch.setattr(hf_alibi, "attention", spy)
    monkeypatch.setattr(OffsetBias, "dense", dense)
    accelerated.train()
    accelerated(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert len(seen) == 2 and all(isinstance(b, rh.alibi.ALiBi) for b in seen)
    slopes = seen[0].slopes
    expected = (paper_slopes(4).float() if family == "bloom"
                else -modeling_mpt.build_mpt_alibi_tensor(4, 2)[:, 0, 0])
    assert torch.equal(slopes, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precision_within_transformers_own_error(family, dtype):
    reference, accelerated = pair(family)
    ids, mask, _ = batch()
    real = mask.bool()
    with torch.no_grad():
        exact = reference(input_ids=ids, attention_mask=mask).logits[real]
        theirs = reference.to(dtype)(input_ids=ids, attention_mask=mask).logits.float()[real]
        ours = accelerated.to(dtype)(input_ids=ids, attention_mask=mask).logits.float()[real]
    assert torch.isfinite(theirs).all()
    assert torch.isfinite(ours).all()
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_dropout_in_training_mode_only(family):
    dropout = {"bloom": {"attention_dropout": 0.3}, "mpt": {}, "falcon": {"attention_dropout": 0.3}}
    reference, accelerated = pair(family, **dropout[family])
    if family == "mpt":  # MptAttentionConfig types attn_pdrop as int (refuses 0.3): set the layers' own attribute
        for model in (reference, accelerated):
            for module in model.modules():
                if hasattr(module, "attn_dropout_p"):
                    module.attn_dropout_p = 0.3
    ids, mask, labels = batch()
    with torch.no_grad():
        a = accelerated(input_ids=ids, attention_mask=mask).logits
        assert_close(a, reference(input_ids=ids, attention_mask=mask).logits, what="eval")
    accelerated.train()
    torch.manual_seed(0)
    b = accelerated(input_ids=ids, attention_mask=mask, labels=labels)
    b.loss.backward()
    assert not torch.allclose(b.logits, a, atol=1e-3)
    assert all(torch.isfinite(g).all() for g in grads(accelerated).values())
    torch.manual_seed(0)
    assert torch.equal(accelerated(input_ids=ids, attention_mask=mask, labels=labels).logits, b.logits)  # seeded


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing(family):
    reference, accelerated = pair(family)
    accelerated.gradient_checkpointing_enable()
    compare_training(reference, accelerated, *batch())


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trip(family, tmp_path):
    reference, accelerated = pair(family)
    ids, mask, _ = batch()
    accelerated.save_pretrained(tmp_path)
    assert hf_alibi.MASK_NAME not in (tmp_path / "config.json").read_text()
    loaded = type(reference).from_pretrained(tmp_path).eval()
    assert not rh.is_accelerated(loaded) and loaded.state_dict().keys() == reference.state_dict().keys()
    rh.accelerate(loaded)
    with torch.no_grad():
        assert_close(loaded(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_restore(family):
    reference, accelerated = pair(family)
    ids, mask, _ = batch()
    attentions = [m for m in accelerated.modules() if type(m).__name__ in rh.FAMILIES[family].attention_classes]
    assert attentions and all("forward" in vars(m) for m in attentions)
    assert rh.accelerate(accelerated) is accelerated  # twice: a no-op
    assert "set_attn_implementation" in vars(accelerated)
    rh.restore(accelerated)
    assert not rh.is_accelerated(accelerated) and not any("forward" in vars(m) for m in attentions)
    assert not any("set_attn_implementation" in vars(m) for m in accelerated.modules())
    assert not any(m._forward_pre_hooks for m in accelerated.modules())  # MPT's per-block flag hooks
    assert accelerated.config._attn_implementation == reference.config._attn_implementation
    with torch.no_grad():
        assert torch.equal(accelerated(input_ids=ids, attention_mask=mask).logits,
                           reference(input_ids=ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="was not accelerated"):
        rh.restore(accelerated)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_forward(family):
    """Inductor for Bloom; dynamo's graph capture of the instance forwards (backend "eager") for the others, faster."""
    reference, accelerated = pair(family)
    ids, mask, _ = batch()
    compiled = torch.compile(accelerated, backend="inductor" if family == "bloom" else "eager")
    with torch.no_grad():
        assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                     reference(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions(family):
    reference, accelerated = pair(family)
    ids, mask, _ = batch()
    with torch.no_grad():
        a = reference(input_ids=ids, attention_mask=mask, output_attentions=family != "falcon")
        b = accelerated(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert_close(b.logits, a.logits)
    if family == "falcon":  # transformers' eager Falcon adds ALiBi twice (in the layer and in the merged mask)
        expected = falcon_weights_with_alibi_once(reference, {"input_ids": ids, "attention_mask": mask})
        assert len(b.attentions) == len(expected) == 2
        for w, e in zip(b.attentions, expected):
            assert w.shape == (3, 4, 40, 40) and torch.allclose(w, e, atol=1e-5)
    else:
        for x, y in zip(a.attentions, b.attentions):
            assert_close(y, x, what="weights")


def padded(length=40):
    """The keyword arguments of :func:`batch` (left, right and no padding), labels left out."""
    ids, mask, _ = batch(length=length)
    return {"input_ids": ids, "attention_mask": mask}


def falcon_weights_with_alibi_once(reference, inputs):
    """Each layer's weights from transformers' own eager ``FalconAttention``, given the layer's input (from the sdpa
    model's run) and a causal + padding mask *without* the ALiBi that transformers' model merges into its mask
    (its eager path adds the ALiBi in the layer as well): ``(B, H, L, L)`` per layer, ALiBi added once."""
    seen = []

    def record(module, args, kwargs):
        seen.append((module, args[0], kwargs["alibi"]))

    attentions = [m for m in reference.modules() if isinstance(m, modeling_falcon.FalconAttention)]
    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in attentions]
    with torch.no_grad():
        reference(**inputs, output_attentions=False)  # the sdpa path: ALiBi once
    for hook in hooks:
        hook.remove()
    keep = inputs["attention_mask"].bool()  # (B, L)
    length = keep.shape[1]
    visible = keep[:, None, None, :] & torch.ones(length, length, dtype=torch.bool).tril()  # (B, 1, L, L)
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():  # output_attentions=True: the layer's eager branch, which returns its weights
        return [type(m).forward(m, hidden, alibi, additive, output_attentions=True)[1] for m, hidden, alibi in seen]


@pytest.mark.parametrize("family", FAMILIES)
def test_set_attn_implementation_switches_both_ways(family, monkeypatch):
    """model.set_attn_implementation("eager", or "sdpa" where the family has it: Falcon) runs transformers' own layers
    (its outputs under that implementation, Falcon's eager ALiBi-twice included: transformers' own set_attn_implementation
    ignores the call for these families); "relpos_alibi" gives relpos's path again; other names are refused;
    restore after a switch gives transformers' model back."""
    reference, accelerated = pair(family)
    inputs = padded()
    hf_checks.switch_implementations(reference, accelerated, inputs, name=hf_alibi.MASK_NAME)
    attention_class = type(next(m for m in accelerated.modules() if "forward" in vars(m)))

    def theirs(self, *args, **kwargs):
        raise AssertionError("transformers' attention forward ran")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_class, "forward", theirs)
        with torch.no_grad():
            accelerated(**inputs)  # relpos's path: the class forward never runs
            accelerated.transformer.set_attn_implementation("eager")  # the base model's call switches the model too
            assert accelerated.config._attn_implementation == "eager"
            with pytest.raises(AssertionError, match="transformers' attention forward ran"):
                accelerated(**inputs)
    refused = ["flash_attention_2", "relpos"] + ([] if accelerated._supports_sdpa else ["sdpa"])
    for name in refused:
        with pytest.raises(ValueError, match=f"must be one of .*got '{name}'"):
            accelerated.set_attn_implementation(name)
    assert accelerated.config._attn_implementation == "eager"
    hf_checks.restore_gives_transformers_back(reference, accelerated, inputs)
    assert not any("set_attn_implementation" in vars(m) for m in accelerated.modules())


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_config_output_attentions_returns_transformers_weights(family):
    """A model built with config.output_attentions=True returns every layer's weights, equal to transformers'. MPT:
    transformers' MptBlock passes no flag to its attention (which always computes the weights); the accelerated MPT's
    blocks record the flag they get for their attention."""
    hf_checks.config_output_attentions(HEADS[family][1], CONFIGS[family](), padded(), names=("attentions",))
    if family == "mpt":  # per call, False wins over the config's True (MptModel resolves it, the blocks record it)
        reference, accelerated = pair(family, output_attentions=True)
        with torch.no_grad():
            a, b = reference(**padded(), output_attentions=False), accelerated(**padded(), output_attentions=False)
        assert a.attentions is None and b.attentions is None
        assert_close(b.logits, a.logits)


def test_falcon_config_output_attentions_returns_every_layers_weights():
    """config.output_attentions=True makes transformers build Falcon eager, which adds its ALiBi twice (logits ~2e-2
    off its own sdpa path). The accelerated model returns every layer's weights with the ALiBi once (transformers'
    own eager layer, given a mask without it) and the sdpa path's logits; switched to "eager" it is transformers'
    eager model (weights and logits)."""
    config = CONFIGS["falcon"]()
    config.output_attentions = True
    torch.manual_seed(0)
    eager = HEADS["falcon"][1](config).eval()
    assert eager.config._attn_implementation == "eager"
    accelerated = rh.accelerate(copy.deepcopy(eager))
    sdpa = hf_checks.under_implementation(eager, "sdpa")
    inputs = padded()
    with torch.no_grad():
        ours, theirs = accelerated(**inputs), sdpa(**inputs, output_attentions=False)
    assert_close(ours.logits, theirs.logits, what="logits")
    expected = falcon_weights_with_alibi_once(sdpa, inputs)
    assert len(ours.attentions) == len(expected) == 2
    for w, e in zip(ours.attentions, expected):
        assert w is not None and torch.allclose(w, e, atol=1e-5)
    accelerated.set_attn_implementation("eager")
    with torch.no_grad():
        ours, theirs = accelerated(**inputs), eager(**inputs)
    assert torch.allclose(ours.logits, theirs.logits, atol=1e-6)
    assert all(torch.allclose(w, e, atol=1e-6) for w, e in zip(ours.attentions, theirs.attentions))


@pytest.mark.parametrize("family", FAMILIES)
def test_compile_fullgraph_with_a_padding_mask_and_compiled_generate(family):
    """torch.compile(fullgraph=True) with left and right padding: no graph break (no data-dependent branch: compiled
    Bloom takes its exact per-key path, left-padding rows are always blended in) and transformers' logits; a compiled
    forward inside generate() with left padding and the KV cache gives transformers' tokens."""
    torch._dynamo.reset()
    reference, accelerated = pair(family)
    inputs = padded()
    compiled = torch.compile(accelerated, fullgraph=True, backend="eager")  # the capture is the test (inductor: above)
    with torch.no_grad():
        assert_close(compiled(**inputs).logits, reference(**inputs).logits)
    ids, mask = inputs["input_ids"][[0, 2], :24], inputs["attention_mask"][[0, 2], :24]  # left padding only
    accelerated.forward = torch.compile(accelerated.forward, fullgraph=True, backend="eager")  # tracing is the test
    common = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(reference.generate(ids, **common), accelerated.generate(ids, **common))


def untouched(model):
    return not rh.is_accelerated(model) and not any("forward" in vars(m) for m in model.modules())


def test_falcon_without_alibi_is_refused_before_any_change():
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(CONFIGS["falcon"](alibi=False))
    with pytest.raises(ValueError, match="config.alibi=False.*rotary"):
        rh.accelerate(model)
    assert untouched(model) and model.config._attn_implementation == "sdpa"


def test_bloom_slow_but_exact_is_refused_before_any_change():
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(CONFIGS["bloom"](pretraining_tp=2, slow_but_exact=True))
    with pytest.raises(ValueError, match="slow_but_exact=True with pretraining_tp=2"):
        rh.accelerate(model)
    assert untouched(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unfitting_transformers_is_refused_with_its_version(family, monkeypatch):
    reference, _ = pair(family)
    attention_class = next(type(m) for m in reference.modules() if type(m).__name__ in rh.FAMILIES[family].attention_classes)
    monkeypatch.setattr(attention_class, "forward", lambda self, hidden_states, mask=None: None)  # another signature
    with pytest.raises(RuntimeError, match=rf"does not fit {attention_class.__name__} of the installed transformers "
                                           rf"{transformers.__version__}"):
        rh.accelerate(reference)
    assert untouched(reference)


def test_the_error_for_other_models_names_the_alibi_families():
    with pytest.raises(TypeError) as error:
        rh.accelerate(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    assert all(name in str(error.value) for name in ("Bloom", "MPT", "Falcon (alibi=True)", "gpt2"))


def test_model_benchmark_runs_for_an_alibi_family(tmp_path):
    """benchmarks/t5_model.py --family mpt at a tiny size (no timing assertions): every variant of every mode."""
    import json

    from relpos.hf.bench import main

    out = tmp_path / "mpt.json"
    assert main(["--family", "mpt", "--lengths", "32", "--batches", "2", "--modes", "forward,train,generate",
                 "--rounds", "1", "--d-model", "32", "--heads", "4", "--layers", "1", "--json", str(out),
                 "--markdown", str(tmp_path / "mpt.md")]) == 0
    results = json.loads(out.read_text())["results"]
    assert {(r["mode"], r["variant"]) for r in results} == {
        (m, v) for m in ("forward", "train", "generate") for v in ("hf_eager", "relpos", "no_bias_floor")
    }
    assert all(r["ms"] > 0 for r in results) and "fastest hf / relpos" in (tmp_path / "mpt.md").read_text()


def test_model_benchmark_skips_a_family_accelerate_refuses(tmp_path, monkeypatch):
    from relpos.hf import bench

    gpt2 = bench.Builder(lambda mode, config: transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    monkeypatch.setitem(bench.BUILDERS, "t5", gpt2)
    report = bench.run_model_bench(bench.ModelBenchConfig(lengths=(16,), batches=(1,), modes=("forward",), rounds=1))
    assert report["results"] == [] and "model_type='gpt2'" in report["refused"]
    assert bench.markdown(report).startswith("t5: skipped, relpos.hf.accelerate refuses it here")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_sharing_the_config_object_keeps_transformers_attention(family):
    """Models built from one config object share it: accelerating one must not switch the other's masks."""
    config = CONFIGS[family]()
    torch.manual_seed(0)
    other = HEADS[family][1](config).eval()
    accelerated = rh.accelerate(HEADS[family][1](config).eval())
    accelerated.load_state_dict(other.state_dict())
    assert other.config is config and config._attn_implementation != hf_alibi.MASK_NAME
    ids, mask, _ = batch()
    with torch.no_grad():
        assert_close(accelerated(input_ids=ids, attention_mask=mask).logits, other(input_ids=ids, attention_mask=mask).logits)


def test_every_benchmark_builder_builds_and_runs_a_small_model():
    """The --family table: each builder makes a model that runs on the benchmark's padded inputs."""
    from relpos.hf import bench

    config = bench.ModelBenchConfig(d_model=32, heads=2, layers=1)
    assert {"t5", "bloom", "mpt", "falcon", "switch_transformers", "pop2piano", "pix2struct", "udop",
            "longt5"} <= set(bench.BUILDERS)
    for name, builder in bench.BUILDERS.items():
        model = builder.build("forward", config).eval()
        ids, mask = bench._inputs(2, 16)
        extra = builder.extra(2, 16) if builder.extra else {}
        with torch.no_grad():
            out = bench._output(model(input_ids=ids, attention_mask=mask, **extra))
        assert out.shape[:2] == (2, 16) and torch.isfinite(out).all(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_accelerated_on_the_meta_device_then_loaded(family):
    """As transformers' from_pretrained does: the model is built (and here accelerated) on the meta device,
    then its weights arrive; the ALiBi slopes are real (built on the CPU), the outputs transformers'."""
    reference, _ = pair(family)
    config = copy.deepcopy(reference.config)
    with torch.device("meta"):
        model = rh.accelerate(type(reference)(config))
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    model.eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        assert_close(model(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits,
                     what=family)


def test_decoding_rows_take_one_sdpa_call_and_equal_the_general_path():
    """A few query rows with a dense per-key term and no gradients (Falcon's decoding step) go straight to
    SDPA with the masks folded in; the result equals relpos's general path (grad enabled) on the same call."""
    from relpos.hf.alibi import alibi_attention

    g = torch.Generator().manual_seed(0)
    b, h, hkv, lk, d = 3, 4, 2, 20, 8
    for lq in (1, 3):
        q = torch.randn(b, h, lq, d, generator=g)
        k, v = torch.randn(b, hkv, lk, d, generator=g), torch.randn(b, hkv, lk, d, generator=g)
        bias = torch.randn(b, h, 1, lk, generator=g).expand(-1, -1, lq, -1) * 3  # (B, H, Lq, Lk)
        mask = torch.ones(b, lk, dtype=torch.bool)  # the 2-D key mask the adapters hand over
        mask[0, :5] = False  # left padding
        mask[2, :-lq] = False  # only the newest keys are real
        with torch.no_grad():
            fast, _ = alibi_attention(q, k, v, bias=bias, mask=mask, scale=0.3)
        general, _ = alibi_attention(q, k, v, bias=bias, mask=mask, scale=0.3)  # grad enabled: the general path
        torch.testing.assert_close(fast, general.detach(), rtol=1e-5, atol=1e-6)


def test_a_decoding_steps_per_key_term_is_built_once_for_every_layer():
    """Bloom's and Falcon's decoding rows take the model's own per-key ALiBi (``PerKey``): the term equals the dense
    ``(B, H, Lq, Lk)`` one the caller would build, every layer after the first builds nothing (one SDPA call: the
    model hands each layer the same per-key tensor and mask), and another factor, a mask changed in place or another
    per-key tensor is built again. Under gradients the term goes to the general path, equal too."""
    from operators import dispatched

    g = torch.Generator().manual_seed(1)
    b, h, lk, d = 2, 4, 12, 8
    q, k, v = torch.randn(b, h, 1, d, generator=g), torch.randn(b, h, lk, d, generator=g), torch.randn(b, h, lk, d, generator=g)
    per_key = torch.randn(b, h, lk, generator=g) * 4  # (B, H, Lk): the model's ALiBi
    mask = torch.ones(b, lk, dtype=torch.bool)
    mask[0, :4] = False

    def layer(factor=0.5, values=per_key):
        with torch.no_grad():
            return hf_alibi.alibi_attention(q, k, v, bias=hf_alibi.PerKey(values, factor), mask=mask, scale=0.3)[0]

    dense = (per_key[:, :, None, :] * 0.5).expand(-1, -1, 1, -1)  # (B, H, 1, Lk)
    with torch.no_grad():
        expected, _ = hf_alibi.alibi_attention(q, k, v, bias=dense, mask=mask, scale=0.3)
    torch.testing.assert_close(layer(), expected, rtol=0, atol=0)
    ops = dispatched(layer)
    assert [n for n in ops if "scaled_dot_product" not in n] == [] and torch.equal(layer(), expected), ops
    for changed in (lambda: layer(factor=0.25), lambda: layer(values=per_key * 2)):
        ops = dispatched(changed)
        assert any("masked_fill" in n for n in ops), ops
    mask[1, :2] = False  # in place
    with torch.no_grad():
        expected, _ = hf_alibi.alibi_attention(q, k, v, bias=dense, mask=mask, scale=0.3)
    torch.testing.assert_close(layer(), expected, rtol=0, atol=0)
    trained = q.clone().requires_grad_()
    general, _ = hf_alibi.alibi_attention(trained, k, v, bias=hf_alibi.PerKey(per_key, 0.5), mask=mask, scale=0.3)
    torch.testing.assert_close(general.detach(), expected, rtol=1e-5, atol=1e-6)
    general.sum().backward()
    assert trained.grad is not None and trained.grad.abs().sum() > 0


def test_dead_rows_are_kept_per_mask_rows_and_position():
    """The rows that see no key (left-padding queries) are kept for the next layer's call with the same mask; the same
    mask at another position or with other rows, or changed in place, gives its own answer (oracle: first real key)."""
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :4] = False  # example 0's first real key is 4

    def oracle(rows, position):
        first = torch.tensor([4, 0])
        return (torch.arange(rows)[None, :] + position < first[:, None])[:, None, :, None]  # (B, 1, Lq, 1)

    for rows, position in ((3, 0), (3, 2), (3, 5), (6, 0), (3, 0)):
        dead, any_dead = hf_alibi._dead_rows(mask, rows, position)
        assert torch.equal(dead, oracle(rows, position)) and any_dead == bool(oracle(rows, position).any())
    mask[0, :4] = True  # in place: no dead row any more
    dead, any_dead = hf_alibi._dead_rows(mask, 3, 0)
    assert not dead.any() and not any_dead


def test_bloom_without_the_private_slope_helper(monkeypatch):
    """transformers 5.17 has no modeling_bloom._get_alibi_slopes (its build_alibi_tensor computes the slopes
    inline): relpos takes Bloom's slopes from build_alibi_tensor, so the model accelerates and stays exact."""
    reference, _ = pair("bloom")
    ids, mask, _ = batch()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits

    def inline_build(attention_mask, num_heads, dtype):  # the older form: the slopes computed inside the builder
        batch_size, seq_length = attention_mask.shape
        positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]  # (B, 1, L)
        alibi = paper_slopes(num_heads).float()[..., None] * positions  # (B, H, L)
        return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)

    monkeypatch.setattr(modeling_bloom, "build_alibi_tensor", inline_build)
    monkeypatch.delattr(modeling_bloom, "_get_alibi_slopes", raising=False)  # 5.15 has none already
    accelerated = rh.accelerate(copy.deepcopy(reference))
    with torch.no_grad():
        torch.testing.assert_close(accelerated(input_ids=ids, attention_mask=mask).logits, expected, rtol=1e-4, atol=1e-5)


def test_a_missing_helper_is_named_not_the_forward(monkeypatch):
    reference, _ = pair("bloom")
    monkeypatch.delattr(modeling_bloom, "dropout_add")
    with pytest.raises(RuntimeError) as error:
        rh.accelerate(reference)
    message = str(error.value)
    assert "it lacks transformers.models.bloom.modeling_bloom.dropout_add" in message
    assert "forward" not in message and "tested with transformers" in message
    assert untouched(reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_all_padding_example_gets_transformers_rows(family):
    """An example with no real token: transformers gives each of its rows uniform attention over the keys (every
    score masked alike); relpos's adapters must give the same logits, not the zeros of a row with no key."""
    reference, accelerated = pair(family)
    ids, mask, _ = batch()
    mask[1] = 0  # example 1: all padding
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        got = accelerated(input_ids=ids, attention_mask=mask).logits
    assert_close(got, want, what=f"{family}, every row of every example")
