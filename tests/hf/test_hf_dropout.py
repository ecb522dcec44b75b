"""Training with labels and dropout on every T5-bucket family after relpos.hf.accelerate (the families' own
test files compare with transformers at dropout 0, where outputs can be equal; here dropout is on).

With dropout the accelerated model cannot draw transformers' masks (its attention runs other kernels),
so the checks are what a training user relies on: in eval mode the dropout model equals transformers';
in training mode the loss and logits move with the seed and repeat with it, every parameter gets a
finite gradient (the bias tables included), and the loss stays within the spread transformers' own
model shows across the same seeds.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import relpos.hf as rh  # noqa: E402
from relpos.hf import bench  # noqa: E402

FAMILIES = ["t5", "switch_transformers", "pop2piano", "pix2struct", "udop", "longt5"]
CONFIG = bench.ModelBenchConfig(d_model=32, heads=2, layers=1)  # dropout_rate 0.1, max_distance 128


def _inputs(family: str, builder, batch=2, length=160):
    ids, mask = bench._inputs(batch, length, left=builder.decoder_only)
    inputs = builder.generate_inputs(ids, mask, CONFIG) if builder.generate_inputs else {"input_ids": ids, "attention_mask": mask}
    inputs.pop("composer", None)
    if "decoder_input_ids" in inputs:  # Pix2Struct: the prompt becomes the labels
        inputs.pop("decoder_attention_mask")
        inputs["labels"] = inputs.pop("decoder_input_ids")
    else:
        inputs["labels"] = torch.randint(2, bench.VOCAB, (batch, 24), generator=torch.Generator().manual_seed(3))
    extra = builder.extra(batch, length) if builder.extra else {}
    return {**inputs, **extra}


@pytest.mark.parametrize("family", FAMILIES)
def test_training_with_labels_and_dropout(family):
    builder = bench.BUILDERS[family]
    torch.manual_seed(0)
    reference = builder.build("generate", CONFIG)  # the *ForConditionalGeneration model, dropout 0.1
    accelerated = rh.accelerate(copy.deepcopy(reference))
    inputs = _inputs(family, builder)
    reference.eval(), accelerated.eval()
    with torch.no_grad():
        torch.testing.assert_close(accelerated(**inputs).logits, reference(**inputs).logits, rtol=1e-4, atol=1e-4)
    accelerated.train(), reference.train()
    losses, unused = {}, {}
    for name, model in (("transformers", reference), ("relpos", accelerated)):
        losses[name] = []
        for seed in range(4):
            torch.manual_seed(seed)
            model.zero_grad()
            out = model(**inputs)
            out.loss.backward()
            losses[name].append(out.loss.item())
            grads = {n: p.grad for n, p in model.named_parameters()}
            unused[name] = {n for n, g in grads.items() if g is None}  # UDOP's decoder holds layout tables it never reads
            assert all(torch.isfinite(g).all() for g in grads.values() if g is not None), family
    assert unused["relpos"] == unused["transformers"]
    assert any("relative_attention_bias" in n for n, p in accelerated.named_parameters() if n not in unused["relpos"])
    torch.manual_seed(1)
    again = accelerated(**inputs).loss.item()
    assert again == losses["relpos"][1]  # the seed repeats the dropout masks
    assert len(set(losses["relpos"])) == 4  # and another seed draws others
    spread = max(losses["transformers"]) - min(losses["transformers"])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert abs(mean(losses["relpos"]) - mean(losses["transformers"])) <= 3 * spread + 1e-3, losses
