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
