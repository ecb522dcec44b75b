"""Padding that every example shares: a batch of one, or several examples padded alike.

Regression: with one kept-key run for the whole batch, the tiled SDPA path took its single-tile
shortcut and handed SDPA every key with a bias view of only the kept ones ("The size of tensor a
(512) must match the size of tensor b (300)"). The sizes here pass the real tile thresholds (no
lowered constants), as a user's single padded sequence does.
"""

import pytest
import torch

import relpos
from relpos.backends.dispatch import _FUSED_MIN_SCORES

from oracles import assert_bias_matters, attend, bias_oracle

H, L, D = 8, 512, 32


def _inputs(batch: int, real: int, *, left: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, H, L, D, generator=g) for _ in range(3))  # (B, H, L, d)
    keep = torch.zeros(batch, L, dtype=torch.bool)
    keep[:, L - real :] = True if left else False
    if not left:
        keep[:, :real] = True
    return q, k, v, keep


@pytest.mark.parametrize("backend", ["auto", "sdpa", "fused", "eager"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_shared_padding_matches_oracle(backend, batch, left, grad):
    assert batch * H * L * L >= _FUSED_MIN_SCORES  # the real size thresholds, not lowered ones
    q, k, v, keep = _inputs(batch, 300, left=left)
    bias = relpos.T5RelativeBias(H, num_buckets=32, max_distance=128)
    with torch.no_grad():
        bias.relative_attention_bias.weight.normal_(0, 2.0)
    expected = attend(q, k, v, bias_oracle(bias, L, L), keep=keep)  # (B, H, L, d) fp64
    with torch.set_grad_enabled(grad):
        out = relpos.attention(q, k, v, bias=bias, key_mask=keep, backend=backend)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    assert_bias_matters(expected, attend(q, k, v, keep=keep), 2e-5)


def test_single_padded_example_gradients_match_eager():
    q, k, v, keep = _inputs(1, 300, left=False, seed=1)
    grads = {}
    for backend in ("eager", "sdpa", "fused"):
        bias = relpos.T5RelativeBias(H)
        torch.manual_seed(0)
        with torch.no_grad():
            bias.relative_attention_bias.weight.normal_(0, 2.0)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = relpos.attention(*leaves, bias=bias, key_mask=keep, backend=backend)
        (out * torch.linspace(-1, 1, D)).sum().backward()
        grads[backend] = [t.grad for t in leaves] + [bias.relative_attention_bias.weight.grad]
    for backend in ("sdpa", "fused"):
        for got, want in zip(grads[backend], grads["eager"]):
            torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "fused", "eager"])
def test_a_batch_of_one_all_padding_example_trains(backend, causal):
    """Found by tests/backends/test_fuzz.py: a batch whose only example is all padding, past the tile threshold,
    returned zeros outside the autograd graph on the sdpa path, so backward() raised (and, causal, NaN from the
    first fix's 0 * -inf). Now zeros with zero gradients on every backend."""
    q, k, v = (torch.randn(1, H, 513, 16, requires_grad=True) for _ in range(3))
    bias = relpos.T5RelativeBias(H)
    out = relpos.attention(q, k, v, bias=bias, key_mask=torch.zeros(1, 513, dtype=torch.bool), causal=causal,
                           backend=backend)
    out.sum().backward()
    assert (out == 0).all()
    for t in (q, k, v, bias.relative_attention_bias.weight):
        assert t.grad is not None and (t.grad == 0).all()
