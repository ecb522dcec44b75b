"""relpos.hf.accelerate on UDOP (text + layout boxes + image), against transformers' own model with the same
weights; small configs, random weights, no downloads. The encoder's 1D + layout bias is built per query tile."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_checks  # noqa: E402
import relpos.hf as rh  # noqa: E402

SMALL = dict(
    vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0, pad_token_id=0,
    eos_token_id=1, decoder_start_token_id=0, image_size=32, patch_size=16, max_2d_position_embeddings=64,
    relative_bias_args=[
        {"type": "1d", "relative_attention_num_buckets": 8, "max_distance": 16},
        {"type": "horizontal", "relative_attention_num_buckets": 8, "max_distance": 20},
        {"type": "vertical", "relative_attention_num_buckets": 8, "max_distance": 20},
    ],
)


def pair(model_class=transformers.UdopForConditionalGeneration):
    torch.manual_seed(0)
    return hf_checks.make_pair(model_class(transformers.UdopConfig(**SMALL)))


def padded(b=3, length=40, target=30, image=False):
    """Tokens with boxes, right padding (example 1), left padding (example 2), padded labels; 40 > 16."""
    g = torch.Generator().manual_seed(2)
    inputs = hf_checks.padded_seq2seq(SMALL["vocab_size"], b, length, target)
    corners = torch.rand(b, length, 2, 2, generator=g).sort(dim=2).values  # x0 <= x1, y0 <= y1
    inputs["bbox"] = corners.transpose(2, 3).reshape(b, length, 4)  # (x0, y0, x1, y1) in [0, 1]
    if image:
        inputs["pixel_values"] = torch.randn(b, 3, SMALL["image_size"], SMALL["image_size"], generator=g)
    return inputs


@pytest.mark.parametrize("image", [False, True])
def test_logits_loss_gradients_and_generate_equal_transformers(image):
    reference, accelerated = pair()
    inputs = padded(image=image)
    assert rh.find_family(reference)[0].name == "udop"
    hf_checks.bias_matters(accelerated, inputs)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    if not image:
        prompt = {k: v for k, v in inputs.items() if k != "labels"}
        hf_checks.generate_equal(reference, accelerated, prompt)


def test_encoder_model_and_layout_bias_matters():
    reference, accelerated = pair(transformers.UdopEncoderModel)
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    with torch.no_grad():
        a, b = reference(**inputs).last_hidden_state, accelerated(**inputs).last_hidden_state
        moved = dict(inputs, bbox=inputs["bbox"].flip(1))  # same tokens, other boxes: the layout bias changes
        c = accelerated(**moved).last_hidden_state
    assert hf_checks.close(a, b, 1e-5)
    assert (c - b).abs().max() > 1e-2


def test_switching_output_attentions_bf16_tiles_and_restore(monkeypatch):
    reference, accelerated = pair()
    inputs = padded()
    assert hf_checks.bias_forms(accelerated, inputs) == {"offsets": 2, "dense": 0, "none": 2}  # decoder per offset; cross-attention none; the encoder: below
    hf_checks.switch_implementations(reference, accelerated, inputs)
    hf_checks.bf16_within_twice_transformers_error(reference, accelerated, inputs)
    hf_checks.tiles_and_fused_paths(monkeypatch, reference, accelerated, inputs)
    hf_checks.restore_gives_transformers_back(reference, accelerated, inputs)
    hf_checks.config_output_attentions(transformers.UdopForConditionalGeneration, transformers.UdopConfig(**SMALL), inputs)


@pytest.mark.parametrize("tile", [None, 7])
def test_the_layout_bias_is_built_per_query_tile_never_dense(monkeypatch, tile):
    """The encoder's attention gets a LayoutBias and runs it tile by tile (tiles of 7 queries: 6 tiles of 40);
    transformers' dense build is never called; outputs and every gradient equal transformers' (the layout
    tables frozen, as in fine-tuning that keeps them: a learning table takes the dense build, next test)."""
    import relpos.hf.udop as udop

    if tile is not None:
        monkeypatch.setattr(udop, "_TILE_ELEMENTS", 3 * SMALL["num_heads"] * 40 * tile)
    reference, accelerated = pair()
    for model in (reference, accelerated):
        model.encoder.relative_bias.requires_grad_(False)  # x, y and the 1D table (tied to layer 0's)
    inputs = padded()
    tiles = []
    real_tile = udop.LayoutBias.tile
    monkeypatch.setattr(udop.LayoutBias, "tile", lambda self, a, b: tiles.append(b - a) or real_tile(self, a, b))
    dense = transformers.models.udop.modeling_udop.RelativePositionBiasAggregated
    real_forward, ours = dense.forward, set(accelerated.modules())

    def forward(self, *args, **kwargs):
        assert self not in ours, "transformers' dense layout bias was built for the accelerated model"
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(dense, "forward", forward)
    hf_checks.forward_loss_and_gradients(reference, accelerated, inputs)
    assert tiles and max(tiles) == (40 if tile is None else tile) and len(tiles) % 2 == 0  # 2 encoder layers
    grads = dict(accelerated.named_parameters())
    assert grads["encoder.block.0.layer.0.SelfAttention.q.weight"].grad.abs().sum() > 0


def test_training_the_layout_tables_takes_transformers_dense_build(monkeypatch):
    """With a layout table learning, the per-tile path would keep more for the backward than the dense build
    (the training grid: 1.37x transformers' memory); the dense build runs there, every gradient equal."""
    import relpos.hf.udop as udop

    reference, accelerated = pair()
    tiles = []
    real_tile = udop.LayoutBias.tile
    monkeypatch.setattr(udop.LayoutBias, "tile", lambda self, a, b: tiles.append(b - a) or real_tile(self, a, b))
    hf_checks.forward_loss_and_gradients(reference, accelerated, padded())
    assert not tiles
    grads = dict(accelerated.named_parameters())
    tables = ["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]  # the 1D table, tied to layer 0's
    tables += [f"encoder.relative_bias.biases.{i}.relative_attention_bias.weight" for i in (1, 2)]  # x and y
    assert all(grads[name].grad.abs().sum() > 0 for name in tables)
    with torch.no_grad():  # inference (no gradient): the per-tile path again
        accelerated(**{k: v for k, v in padded().items()})
    assert tiles


def test_a_layout_bias_that_is_not_per_tile_keeps_transformers_dense_build():
    """augmentation (random rescaling in training) and prefix buckets: transformers' own build, same outputs."""
    torch.manual_seed(0)
    args = [dict(a, prefix_bucket=True) if a["type"] == "horizontal" else a for a in SMALL["relative_bias_args"]]
    config = transformers.UdopConfig(**dict(SMALL, relative_bias_args=args))
    reference, accelerated = hf_checks.make_pair(transformers.UdopEncoderModel(config))
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    with torch.no_grad():
        assert hf_checks.close(reference(**inputs).last_hidden_state, accelerated(**inputs).last_hidden_state, 1e-5)


def test_a_layout_bias_module_that_does_not_fit_is_refused_before_any_change():
    torch.manual_seed(0)
    model = transformers.UdopEncoderModel(transformers.UdopConfig(**SMALL))
    del model.encoder.relative_bias.biases[1].scaling_factor
    with pytest.raises(RuntimeError, match="RelativePositionBiasAggregated.*lacks \\['scaling_factor'\\]"):
        rh.accelerate(model)
    assert not rh.is_accelerated(model) and model.config._attn_implementation != "relpos"


def test_the_per_tile_layout_bias_compiles_fullgraph():
    reference, accelerated = pair(transformers.UdopEncoderModel)
    inputs = {k: v for k, v in padded().items() if k != "labels"}
    with torch.no_grad():
        expected = reference(**inputs).last_hidden_state
        got = torch.compile(accelerated, fullgraph=True)(**inputs).last_hidden_state
    assert hf_checks.close(expected, got, 1e-4)
