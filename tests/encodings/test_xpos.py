"""xPos (Sun et al. 2023): rotary with an exponential scale, against the formula of the authors'
torchscale code re-derived here in fp64."""


import pytest
import torch

from relpos import RotaryEmbedding, XPos, attention

from oracles import decode_matches_parallel, oracle, padding_mask, qkv


def torchscale_xpos(x, offset=0, downscale=False, scale_base=512.0):
    """fp64 re-derivation of torchscale's XPOS.forward for x (L, d): positions centred on the call,
    zeta = (2c + 0.4 d) / (1.4 d) per pair, sin/cos of positions offset.., pairs interleaved."""
    length, d = x.shape
    zeta = (torch.arange(0, d, 2, dtype=torch.float64) + 0.4 * d) / (1.4 * d)  # (d/2,)
    min_pos = -(length + offset) // 2
    centred = torch.arange(min_pos, length + offset + min_pos, dtype=torch.float64)  # (L + offset,)
    scale = zeta[None, :] ** (centred[:, None] / scale_base)  # (L + offset, d/2)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d // 2, dtype=torch.float64) / (d // 2))
    angles = torch.arange(length + offset, dtype=torch.float64)[:, None] * inv_freq[None, :]
    sin, cos, scale = angles.sin()[-length:], angles.cos()[-length:], scale[-length:]
    if downscale:
        scale = 1 / scale
    sin, cos = (t.repeat_interleave(2, -1) for t in (sin * scale, cos * scale))
    turned = torch.stack((-x[:, 1::2], x[:, ::2]), -1).flatten(-2)
    return x * cos + turned * sin


def test_logits_equal_torchscale_formula():
    torch.manual_seed(0)
    d, length = 16, 40
    q, k = torch.randn(length, d, dtype=torch.float64), torch.randn(length, d, dtype=torch.float64)
    xpos = XPos(d, scale_base=8.0)  # a small gamma: the scale moves the logits far (the paper's 512 is gentler)
    ours_q, ours_k = xpos(q.float(), k.float())
    expected = torchscale_xpos(q, scale_base=8.0) @ torchscale_xpos(k, downscale=True, scale_base=8.0).T
    assert torch.allclose((ours_q @ ours_k.T).double(), expected, rtol=1e-5, atol=1e-4)
    rope_q, rope_k = RotaryEmbedding(d, interleaved=True)(q.float(), k.float())
    assert ((rope_q @ rope_k.T).double() - expected).abs().max() > 1.0  # the scale matters
    # a decoding step in torchscale: the last query at offset L - 1 against every key
    step = torchscale_xpos(q[-1:], offset=length - 1, scale_base=8.0) @ torchscale_xpos(k, downscale=True, scale_base=8.0).T
    ours_step = xpos.rotate(q[-1:].float(), length - 1) @ ours_k.T
    assert torch.allclose(ours_step.double(), step, rtol=1e-5, atol=1e-4)
    step_q, step_k = xpos(q[-1:].float(), k.float(), q_offset=length - 1)  # forward's q_offset: a KV-cache step
    assert torch.allclose((step_q @ step_k.T).double(), step, rtol=1e-5, atol=1e-4)


def test_relative_shift_invariance():
    torch.manual_seed(1)
    xpos = XPos(8, scale_base=16.0)
    q, k = torch.randn(5, 8, dtype=torch.float64), torch.randn(7, 8, dtype=torch.float64)
    logits = xpos.rotate(q, 2) @ xpos.rotate(k, 0, downscale=True).T
    shifted = xpos.rotate(q, 32) @ xpos.rotate(k, 30, downscale=True).T
    assert torch.allclose(logits, shifted, atol=1e-5)


def test_huge_scale_base_is_interleaved_rope():
    q, k, _ = qkv(lq=6, lk=6, d=8)
    xq, xk = XPos(8, scale_base=1e12)(q, k)
    rq, rk = RotaryEmbedding(8, interleaved=True)(q, k)
    assert torch.allclose(xq, rq, atol=1e-6) and torch.allclose(xk, rk, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
@pytest.mark.parametrize("causal, padded", [(False, False), (True, False), (True, True)])
def test_attention_on_every_backend(backend, causal, padded):
    xpos = XPos(16, scale_base=8.0)
    q, k, v = qkv(lq=12, lk=12, d=16, grad=True)
    key_mask = padding_mask(2, 12) if padded else None
    out = attention(*xpos(q, k), v, causal=causal, key_mask=key_mask, backend=backend)
    qq = torchscale_xpos  # the oracle's rotation, per (batch, head)
    rq = torch.stack([torch.stack([qq(q[b, h].double().detach(), scale_base=8.0) for h in range(4)]) for b in range(2)])
    rk = torch.stack([torch.stack([qq(k[b, h].double().detach(), downscale=True, scale_base=8.0) for h in range(4)]) for b in range(2)])
    expected = oracle(rq, rk, v.detach(), causal=causal, key_mask=key_mask)
    assert torch.allclose(out.double(), expected, atol=1e-4)
    assert (oracle(q.detach(), k.detach(), v.detach(), causal=causal, key_mask=key_mask) - expected).abs().max() > 0.05
    out.sum().backward()
    assert q.grad.abs().max() > 0 and k.grad.abs().max() > 0


def test_gradcheck_fp64():
    xpos = XPos(8, scale_base=4.0)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: xpos.rotate(t, 3, downscale=True), (x,))
    assert torch.autograd.gradcheck(lambda t: xpos.rotate(t, 3), (x,))


def test_decode_equals_parallel():
    decode_matches_parallel(XPos(8, scale_base=4.0))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"head_dim": 7}, ValueError, "head_dim must be even for xPos"),
    ({"head_dim": 8, "scale_base": 0.0}, ValueError, "scale_base must be a finite number > 0"),
    ({"head_dim": 8.0}, TypeError, "head_dim must be an int"),
])
def test_bad_inputs(kwargs, error, match):
    with pytest.raises(error, match=match):
        XPos(**kwargs)


def test_bad_rotate_inputs():
    with pytest.raises(ValueError, match="head_dim=8"):
        XPos(8).rotate(torch.zeros(3, 6))
    with pytest.raises(ValueError, match="start must be non-negative"):
        XPos(8).rotate(torch.zeros(3, 8), -1)


