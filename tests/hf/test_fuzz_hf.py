"""Differential fuzzing of relpos.hf.accelerate at small sizes: transformers' own model against its accelerated copy.

Batch sizes 1-3, lengths from 1 (primes and past the models' max_distance), padding layouts (none, right, left,
one real token, every example alike), T5 (encoder-decoder) and the ALiBi families, forward logits, loss and the
first gradients. Profiles: tests/fuzz_profiles.py.
"""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import relpos.hf as rh  # noqa: E402
import hf_checks  # noqa: E402
from fuzz_profiles import examples  # noqa: E402
from oracles import padding_layout  # noqa: E402

VOCAB = 64
T5 = dict(vocab_size=VOCAB, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2, num_decoder_layers=1,
          relative_attention_num_buckets=8, relative_attention_max_distance=12, decoder_start_token_id=0,
          pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
STRONG = dict(initializer_range=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # attention matters at init
DECODERS = {
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, **STRONG)),
    "mpt": lambda: transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=4, max_seq_len=128, **STRONG)),
    "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, alibi=True,
        hidden_dropout=0.0, attention_dropout=0.0, **STRONG)),
}


def _mask(layout: str, batch: int, length: int) -> torch.Tensor:
    """transformers' 0/1 attention_mask (B, L) of a padding layout (tests/oracles.py)."""
    keep = padding_layout(layout, batch, length)
    return torch.ones(batch, length, dtype=torch.long) if keep is None else keep.long()


def _ids(batch, length, seed):
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@examples(15, 300)
@given(batch=st.integers(1, 3), length=st.sampled_from([1, 2, 7, 13, 29, 40]), target=st.sampled_from([1, 5, 16]),
       layout=st.sampled_from(["none", "right", "left", "one_real_first", "alike"]), seed=st.integers(0, 999))
def test_t5_accelerated_equals_transformers(batch, length, target, layout, seed):
    torch.manual_seed(seed)
    reference, accelerated = hf_checks.make_pair(transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)))
    mask = _mask(layout, batch, length)
    inputs = {"input_ids": _ids(batch, length, seed).masked_fill(mask == 0, 0), "attention_mask": mask,
              "labels": _ids(batch, target, seed + 1)}
    with torch.no_grad():
        want, got = (m(**inputs) for m in (reference, accelerated))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


@examples(15, 300)
@given(family=st.sampled_from(sorted(DECODERS)), batch=st.integers(1, 3), length=st.sampled_from([1, 2, 7, 13, 29]),
       layout=st.sampled_from(["none", "right", "left", "alike"]), seed=st.integers(0, 999))
def test_alibi_families_accelerated_equal_transformers(family, batch, length, layout, seed):
    torch.manual_seed(seed)
    reference = DECODERS[family]().eval()
    accelerated = rh.accelerate(copy.deepcopy(reference))
    mask = _mask(layout, batch, length)
    ids = _ids(batch, length, seed)
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask).logits for m in (reference, accelerated))
    real = mask.bool()  # padded query rows are free in transformers (their values are unused)
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)


# --- vision: the window and decomposed adapters on images of any shape (non-square, padded windows) ---

SWINS = {
    "swin": (transformers.SwinModel, transformers.SwinConfig),
    "swinv2": (transformers.Swinv2Model, transformers.Swinv2Config),
    "donut": (transformers.DonutSwinModel, transformers.DonutSwinConfig),
}


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Position tables (and Swin V2's MLP) ~ N(0, 1), so the position term moves the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(key in name for key in ("relative_position_bias_table", "continuous_position_bias_mlp", "rel_pos_h", "rel_pos_w")):
                p.copy_(torch.randn(p.shape, generator=g))
    return model.eval()


@examples(10, 200)
@given(family=st.sampled_from(sorted(SWINS)), batch=st.integers(1, 3), height=st.sampled_from([8, 12, 20, 26]),
       width=st.sampled_from([8, 14, 20, 24]), window=st.sampled_from([2, 3, 4]), seed=st.integers(0, 999))
def test_swin_families_accelerated_equal_transformers_on_any_image(family, batch, height, width, window, seed):
    """Images of any height and width (patches 2 x 2: grids 4..13 per side, padded to the window where they do
    not divide), shifted windows, batch 1-3: the accelerated model equals transformers' (fp64)."""
    model_class, config_class = SWINS[family]
    torch.manual_seed(seed)
    config = config_class(image_size=max(height, width), patch_size=2, embed_dim=8, depths=[2], num_heads=[2],
                          window_size=window)
    reference = _randomized(model_class(config).double(), seed)
    accelerated = rh.accelerate(copy.deepcopy(reference))
    pixels = torch.randn(batch, 3, height, width, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want, got = (m(pixels).last_hidden_state for m in (reference, accelerated))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


VISION = dict(hidden_size=16, output_channels=8, num_hidden_layers=2, num_attention_heads=2, patch_size=8,
              mlp_dim=32, use_rel_pos=True, global_attn_indexes=[1])


@examples(10, 200)
@given(kind=st.sampled_from(["sam", "vitdet"]), batch=st.integers(1, 3), side=st.sampled_from([24, 40, 56]),
       window=st.sampled_from([0, 2, 3]), seed=st.integers(0, 999))
def test_decomposed_adapters_accelerated_equal_transformers(kind, batch, side, window, seed):
    """SAM's vision encoder (global and windowed layers, grids 3..7 patches a side, windows that pad) and ViTDet
    on a non-square image: the accelerated model equals transformers' (fp64)."""
    torch.manual_seed(seed)
    if kind == "sam":
        config = transformers.SamVisionConfig(**VISION, image_size=side, window_size=window)
        reference = _randomized(transformers.SamVisionModel(config).double(), seed)
        pixels = torch.randn(batch, 3, side, side, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    else:
        config = transformers.VitDetConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=8,
                                           image_size=side, pretrain_image_size=side, use_relative_position_embeddings=True,
                                           window_size=window, window_block_indices=[0] if window else [], mlp_ratio=2)
        reference = _randomized(transformers.VitDetBackbone(config).double(), seed)
        pixels = torch.randn(batch, 3, side, side + 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    accelerated = rh.accelerate(copy.deepcopy(reference))
    with torch.no_grad():
        want, got = reference(pixel_values=pixels), accelerated(pixel_values=pixels)
    key = "last_hidden_state" if kind == "sam" else "feature_maps"
    a, b = getattr(got, key), getattr(want, key)
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)
