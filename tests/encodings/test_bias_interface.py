"""The bias interface: a new relative bias writes only bias_at() and gets the rest (docs/encodings/interface.md)."""

import pytest
import torch

import relpos


class LinearDistance(relpos.RelativeBias):
    """The example of docs/encodings/interface.md: b = -slope_h * |j - i|."""

    def __init__(self, slopes):
        super().__init__()
        self.num_heads = len(slopes)
        self.register_buffer("slopes", torch.tensor(slopes))

    def bias_at(self, rel):
        return -self.slopes[:, None] * rel.abs()  # (H, n)


def test_subclass_gets_offsets_dense_and_attention():
    bias = LinearDistance([0.5, 0.25])
    dense = bias.materialize(3, 4, q_offset=1)
    rel = relpos.relative_positions(3, 4, q_offset=1)
    assert torch.allclose(dense[0], -torch.tensor([0.5, 0.25])[:, None, None] * rel.abs())
    assert bias.offsets(3, 4, q_offset=1).values.shape == (2, 6)
    from oracles import assert_bias_matters, attend, offsets

    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    formula = -torch.tensor([0.5, 0.25], dtype=torch.float64)[:, None, None] * offsets(5, 5).abs()  # (H, L, L)
    expected = attend(q, k, v, formula)
    assert_bias_matters(expected, attend(q, k, v), 1e-5)
    for backend in ("eager", "sdpa"):
        assert torch.allclose(relpos.attention(q, k, v, bias=bias, backend=backend).double(), expected, atol=1e-5)


def test_base_classes_refuse_what_they_cannot_do():
    with pytest.raises(NotImplementedError):
        relpos.RelativeBias().bias_at(torch.arange(3))
    with pytest.raises(NotImplementedError):
        relpos.AdditiveBias().materialize(2, 2)
    with pytest.raises(TypeError, match="no per-offset form"):
        relpos.AdditiveBias().offsets(2, 2)


def test_offsets_follow_the_module_device_and_a_requested_one():
    bias = relpos.RelativePositionalBias(2)
    ob = bias.offsets(4, 4, device="cpu")
    assert ob.values.device.type == "cpu" and ob.values.is_contiguous()


def test_every_parameter_gets_a_gradient_in_t5_attention():
    layer = relpos.T5Attention(32, 4)
    out, _ = layer(torch.randn(2, 9, 32))
    out.square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "make",
    [
        lambda: relpos.RelativePositionalBias(4),
        lambda: relpos.ALiBi(4),
        lambda: relpos.ALiBi(4, mode="symmetric"),
        lambda: relpos.ClippedRelativeBias(4, 3),
        lambda: relpos.LogDecayBias(0.3, num_heads=4),
    ],
)
def test_every_relative_bias_is_callable_like_compute_bias(make):
    bias = make()
    assert torch.equal(bias(5, 7), bias.materialize(5, 7))
    assert torch.equal(bias(1, 7, q_offset=6), bias.materialize(1, 7, q_offset=6))
    with pytest.raises(TypeError):
        bias(5, 7, 2)  # an offset given positionally is refused


def test_t5_and_window_biases_have_unmistakable_aliases():
    import relpos

    assert relpos.T5RelativeBias is relpos.RelativePositionalBias
    assert relpos.WindowRelativeBias is relpos.RelativePositionBias
    assert "Not to be confused" in relpos.RelativePositionalBias.__doc__ and "Swin" in relpos.RelativePositionalBias.__doc__
    assert "Not to be confused" in relpos.RelativePositionBias.__doc__ and "T5" in relpos.RelativePositionBias.__doc__
