"""Which transformers releases relpos.hf's adapters fit: a tiny model of each family, accelerated, logits against
transformers' own (docs/integrations/index.md, "Which releases").

    pip install --no-deps --target /tmp/tf-5.15.0 transformers==5.15.0        # the release to probe
    pip install --target /tmp/tf-deps transformers==5.0.0                      # an old release's dependencies
    rm -rf /tmp/tf-deps/torch* /tmp/tf-deps/numpy*                             # keep the environment's torch and numpy
    PYTHONPATH=/tmp/tf-5.15.0:/tmp/tf-deps python tools/probe_transformers.py  # prints {family: ok | the refusal}

The same PYTHONPATH runs ``python -m pytest tests/hf`` against that release.
"""

from __future__ import annotations

import copy

import torch
import transformers

import relpos.hf as rh

V = 64


def _seq2seq(config_class, model_class, **extra):
    config = config_class(vocab_size=V, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                          decoder_start_token_id=0, pad_token_id=0, **extra)
    return model_class(config)


FAMILIES = {
    "t5": lambda: _seq2seq(transformers.T5Config, transformers.T5ForConditionalGeneration,
                           relative_attention_num_buckets=8, relative_attention_max_distance=12),
    "umt5": lambda: _seq2seq(transformers.UMT5Config, transformers.UMT5ForConditionalGeneration),
    "longt5": lambda: _seq2seq(transformers.LongT5Config, transformers.LongT5ForConditionalGeneration),
    "switch": lambda: transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=V, d_model=16, d_kv=4, num_heads=4, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=2, decoder_start_token_id=0, pad_token_id=0)),
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=V, hidden_size=16, n_layer=1, n_head=4)),
    "mpt": lambda: transformers.MptForCausalLM(transformers.MptConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=4,
                                                                       max_seq_len=64)),
    "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, alibi=True)),
}


def probe(make) -> str:
    """'ok' when the accelerated copy's logits equal transformers' on a padded batch, else why not."""
    try:
        torch.manual_seed(0)
        reference = make().eval()
        accelerated = rh.accelerate(copy.deepcopy(reference))
        ids = torch.randint(2, V, (2, 9))
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
        inputs = dict(input_ids=ids, attention_mask=mask)
        if hasattr(reference, "encoder"):
            inputs["decoder_input_ids"] = ids[:, :4]
        with torch.no_grad():
            error = float((reference(**inputs).logits - accelerated(**inputs).logits).abs().max())
        return "ok" if error < 1e-4 else f"logits differ by {error:.1e}"
    except Exception as exc:  # noqa: BLE001 - a refusal is the answer for that release
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def main() -> None:
    print(transformers.__version__, {name: probe(make) for name, make in FAMILIES.items()})


if __name__ == "__main__":
    main()
