"""Every position encoding MultiheadAttention accepts x every layer option, against an fp64 oracle.

The matrix is generated: each encoding (one line in ``ENCODINGS``) meets each option (dropout in
training and in eval mode, causal, key padding, decoding with a KV cache, cross-attention). The
oracle recomputes the layer from its weights: projections, the bias from its formula
(tests/oracles.py), rotary and Shaw terms written out, the dropout mask rebuilt from
torch.Generator. A gap such as an encoding whose path skips dropout fails here.
"""

import inspect
import math

import pytest
import torch

import relpos
from relpos import KVCache, MultiheadAttention

from oracles import assert_bias_matters, attend, bias_oracle, dropout_keep, offsets

E, H, HKV, DH = 32, 4, 2, 8  # model width, query heads, key/value heads (grouped), head width
ATOL = 1e-5

ENCODINGS = {  # name -> (factory, causal_only, window_length or None)
    "none": (lambda: None, False, None),
    "t5": (lambda: relpos.RelativePositionalBias(H, num_buckets=8, max_distance=12), False, None),
    "t5_causal": (lambda: relpos.RelativePositionalBias(H, num_buckets=8, max_distance=12, bidirectional=False), False, None),
    "clipped": (lambda: relpos.ClippedRelativeBias(H, 3), False, None),
    "alibi_symmetric": (lambda: relpos.ALiBi(H, mode="symmetric"), False, None),
    "alibi_causal": (lambda: relpos.ALiBi(H), True, None),
    "log_decay": (lambda: relpos.LogDecayBias(0.7), False, None),
    "window_2d": (lambda: relpos.RelativePositionBias(H, (3, 3)), False, 9),
    "window_1d": (lambda: relpos.RelativePositionBias(H, 9, bias_type="1d"), False, 9),
    "window_factorized": (lambda: relpos.FactorizedRelativePositionBias(H, (3, 3)), False, 9),
    "window_swinv2": (lambda: relpos.ContinuousPositionBias(H, (3, 3), hidden_size=16), False, 9),
    "kerple_log": (lambda: relpos.KerpleBias(H), False, None),
    "kerple_power": (lambda: relpos.KerpleBias(H, kind="power"), False, None),
    "sandwich": (lambda: relpos.SandwichBias(H, dim=E), False, None),
    "fire": (lambda: relpos.FIREBias(H, mlp_width=8, init_L=6.0), False, None),
    "rope": (lambda: relpos.RotaryEmbedding(DH), False, None),
    "rope_interleaved": (lambda: relpos.RotaryEmbedding(DH, interleaved=True), False, None),
    "shaw": (lambda: relpos.ShawRelativePosition(DH, 3), False, None),
    "shaw_keys_only": (lambda: relpos.ShawRelativePosition(DH, 3, values=False), False, None),
}
# Encodings whose layer path has no closed-form fp64 oracle here (their own tests pin their formulas:
# tests/encodings/test_xpos.py, test_forgetting.py, test_cope.py): checked by what every option must do.
BY_INVARIANCE = {
    "xpos": lambda: relpos.XPos(DH),
    "forgetting_gate": lambda: relpos.ForgettingGate(E, H),
    "cope": lambda: relpos.CoPE(DH, max_positions=8),
}
OPTIONS = ["plain", "causal", "key_padding", "dropout_train", "dropout_eval", "cache_decode", "cross"]


def position_classes() -> set[type]:
    """Every public relpos class MultiheadAttention can take as ``position``."""
    accepted = (relpos.AdditiveBias, relpos.RotaryEmbedding, relpos.ShawRelativePosition, relpos.XPos,
                relpos.ForgettingGate, relpos.CoPE)
    found = set()
    for name in relpos.__all__:
        obj = getattr(relpos, name)
        if inspect.isclass(obj) and issubclass(obj, accepted) and obj not in (relpos.AdditiveBias, relpos.RelativeBias):
            found.add(obj)
    return found


def test_matrix_covers_every_position_encoding():
    covered = {type(factory()) for factory, _, _ in ENCODINGS.values()} - {type(None)}
    covered |= {type(factory()) for factory in BY_INVARIANCE.values()}
    missing = sorted(c.__name__ for c in position_classes() - covered)
    assert not missing, f"add a line for {missing} to ENCODINGS in tests/layers/test_mha_matrix.py (and its formula to tests/oracles.py)"


def build(name, causal=False, dropout=0.0, backend="eager"):
    factory, _, _ = ENCODINGS[name]
    torch.manual_seed(0)
    position = factory()
    for p in [] if position is None else position.parameters():
        torch.nn.init.normal_(p, std=1.5)  # a position term far above the tolerance
    layer = MultiheadAttention(E, H, position=position, num_kv_heads=HKV, causal=causal, dropout=dropout, backend=backend)
    torch.nn.init.normal_(layer.qkv.weight, std=0.4)
    return layer.eval()


def _rotate(x, positions, rope):
    """fp64 rotation of x (B, H, L, d): pair (a, b) by angle pos * base ** (-2c / d) -> (a cos - b sin, a sin + b cos)."""
    d = x.shape[-1]
    inv = rope.base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angle = positions.double()[:, None] * inv[None, :]  # (L, d/2)
    cos, sin = angle.cos(), angle.sin()
    if rope.interleaved:
        a, b = x[..., 0::2], x[..., 1::2]  # (B, H, L, d/2) each
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), -1)


def _shaw_terms(shaw, q, lk, q_offset):
    """(B, H, Lq, Lk) logits term q_i . a^K[clip(j - i)], and the a^V rows (Lq, Lk, d) or None."""
    r = shaw.max_distance
    index = offsets(q.shape[2], lk, q_offset).clamp(-r, r) + r  # (Lq, Lk)
    a_k = shaw.rel_keys.detach().double()[index]  # (Lq, Lk, d)
    logits = torch.einsum("bhid,ijd->bhij", q, a_k)  # (B, H, Lq, Lk)
    a_v = None if shaw.rel_values is None else shaw.rel_values.detach().double()[index]  # (Lq, Lk, d)
    return logits, a_v


def oracle(layer, x, memory=None, *, q_offset=0, keep=None, drop=None, with_position=True):
    """fp64 forward of ``layer`` from its weights; ``x`` queries at ``q_offset ..``, keys at 0 .. Lk - 1."""
    heads, kv_heads, dh = layer.num_heads, layer.num_kv_heads, layer.head_dim
    w = layer.qkv.weight.detach().double()  # (H*dh + 2*Hkv*dh, E)
    qw, kvw = w[: heads * dh], w[heads * dh :]
    src = x if memory is None else memory
    q = (x.double() @ qw.T).unflatten(-1, (heads, dh)).transpose(1, 2)  # (B, H, Lq, dh)
    k, v = (src.double() @ kvw.T).chunk(2, -1)
    k, v = (t.unflatten(-1, (kv_heads, dh)).transpose(1, 2) for t in (k, v))  # (B, Hkv, Lk, dh)
    lq, lk = q.shape[2], k.shape[2]
    position = layer.position if with_position else None
    scale = 1 / math.sqrt(dh)
    bias, a_v = None, None
    if isinstance(position, relpos.RotaryEmbedding):
        q, k = _rotate(q, torch.arange(lq) + q_offset, position), _rotate(k, torch.arange(lk), position)
    elif isinstance(position, relpos.ShawRelativePosition):
        bias, a_v = _shaw_terms(position, q, lk, q_offset)
        bias = bias * scale
    elif position is not None:
        bias = bias_oracle(position, lq, lk, q_offset)
    causal = layer.causal and memory is None
    if a_v is None:
        out = attend(q, k, v, bias, causal=causal, keep=keep, q_offset=q_offset, drop=drop, p=layer.dropout)
    else:  # Shaw's value term: the same (dropped) weights also mix a^V; recover them with an identity "value"
        eye = torch.eye(lk, dtype=torch.float64).expand(q.shape[0], kv_heads, lk, lk)  # (B, Hkv, Lk, Lk)
        weights = attend(q, k, eye, bias, causal=causal, keep=keep, q_offset=q_offset, drop=drop, p=layer.dropout)
        out = weights @ v.repeat_interleave(heads // kv_heads, 1) + torch.einsum("bhij,ijd->bhid", weights, a_v)
    out = out.transpose(1, 2).flatten(-2)  # (B, Lq, H*dh)
    return out @ layer.out.weight.detach().double().T  # (B, Lq, E)


def _length(name):
    return ENCODINGS[name][2] or 11


def _check(got, layer, x, **kw):
    want = oracle(layer, x, **kw)
    assert torch.allclose(got.double(), want, atol=ATOL), float((got.double() - want).abs().max())
    if layer.position is not None:
        assert_bias_matters(want, oracle(layer, x, with_position=False, **kw), ATOL)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", list(ENCODINGS))
def test_encoding_with_option_equals_oracle(name, option):
    causal_only, window = ENCODINGS[name][1], ENCODINGS[name][2]
    length = _length(name)
    x = torch.randn(2, length, E, generator=torch.Generator().manual_seed(1))
    causal = causal_only or option in ("causal", "cache_decode", "cross")  # cross: a causal layer must not mask the memory
    if option == "dropout_train" or option == "dropout_eval":
        layer = build(name, causal=causal, dropout=0.5)
        if option == "dropout_eval":
            with torch.no_grad():
                first, second = layer(x)[0], layer(x)[0]
            assert torch.equal(first, second)  # eval mode: no dropout
            _check(first, layer, x)
            return
        layer.train()
        with torch.no_grad():
            torch.manual_seed(7)
            seed = int(torch.randint(0, 2**62, (1,)).item())  # the one seed a call takes from torch's RNG
            torch.manual_seed(7)
            got = layer(x)[0]
            again = layer(x)[0]
        assert not torch.equal(got, again)  # a fresh mask each call
        drop = dropout_keep(seed, 2, H, length, length, 0.5)
        _check(got, layer, x, drop=drop)
        assert (got.double() - oracle(layer, x)).abs().max() > 10 * ATOL  # dropout changed the output
        return
    layer = build(name, causal=causal)
    if option in ("plain", "causal"):
        with torch.no_grad():
            _check(layer(x)[0], layer, x)
    elif option == "key_padding":
        keep = torch.ones(2, length, dtype=torch.bool)
        keep[1, length - 4 :] = False  # right padding in the second example
        with torch.no_grad():
            got = layer(x, key_mask=keep)[0]
        _check(got, layer, x, keep=keep)
    elif option == "cache_decode":
        if window is not None:  # a window bias covers exactly one window: decoding is refused by name
            with pytest.raises(ValueError, match="covers exactly one window"):
                with torch.no_grad():
                    cache = KVCache()
                    layer(x[:, :3], cache=cache)
            return
        with torch.no_grad():
            full = layer(x)[0]
            cache = KVCache()
            steps = [layer(x[:, :3], cache=cache)[0]] + [layer(x[:, t : t + 1], cache=cache)[0] for t in range(3, length)]
        assert torch.allclose(torch.cat(steps, 1), full, atol=ATOL)
        step_oracle = oracle(layer, x)[:, -1:]  # the last step against the parallel oracle's last row
        assert torch.allclose(steps[-1].double(), step_oracle, atol=ATOL)
    elif option == "cross":
        memory = torch.randn(2, length + 4 if window is None else length, E, generator=torch.Generator().manual_seed(2))
        lq = 5 if window is None else length
        if causal_only:  # causal ALiBi defines no bias for future keys; cross-attention sees them all
            with pytest.raises(ValueError, match="defines no bias for future keys"):
                layer(x[:, :lq], memory=memory)
            return
        with torch.no_grad():
            got = layer(x[:, :lq], memory=memory)[0]
        _check(got, layer, x[:, :lq], memory=memory)


@pytest.mark.parametrize("name", ["t5", "clipped", "alibi_symmetric", "log_decay", "rope"])
def test_fused_backend_dropout_equals_oracle(name):
    """The fused path draws the same documented masks as the eager one (whole layer, training mode)."""
    layer = build(name, dropout=0.3, backend="fused").train()
    x = torch.randn(2, 11, E, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.manual_seed(11)
        seed = int(torch.randint(0, 2**62, (1,)).item())
        torch.manual_seed(11)
        got = layer(x)[0]
    _check(got, layer, x, drop=dropout_keep(seed, 2, H, 11, 11, 0.3))


def _invariance_layer(name, **options):
    torch.manual_seed(0)
    position = BY_INVARIANCE[name]()
    for p in position.parameters():
        torch.nn.init.normal_(p, std=1.5)
    options.setdefault("causal", name == "forgetting_gate")  # forgetting gates are causal-only
    return MultiheadAttention(E, H, position=position, **options)


@pytest.mark.parametrize("name", list(BY_INVARIANCE))
def test_invariance_encodings_honour_every_option(name):
    """Dropout applies in training (or is refused by name), padded keys and future keys change nothing
    they must not, decoding equals the parallel forward, and the position term matters."""
    x = torch.randn(2, 11, E, generator=torch.Generator().manual_seed(1))
    try:
        layer = _invariance_layer(name, dropout=0.5).train()
    except ValueError as exc:
        assert "dropout" in str(exc)  # refused by name, not silently skipped
    else:
        with torch.no_grad():
            assert not torch.equal(layer(x)[0], layer(x)[0])  # a fresh dropout mask each call
            layer.eval()
            assert torch.equal(layer(x)[0], layer(x)[0])
    layer = _invariance_layer(name, causal=True).eval()
    with torch.no_grad():
        full = layer(x)[0]
        changed_future = x.clone()
        changed_future[:, 6:] += 5.0
        assert torch.allclose(layer(changed_future)[0][:, :6], full[:, :6], atol=ATOL)  # causal: the past only
        cache = KVCache()
        steps = [layer(x[:, :3], cache=cache)[0]] + [layer(x[:, t : t + 1], cache=cache)[0] for t in range(3, 11)]
        assert torch.allclose(torch.cat(steps, 1), full, atol=ATOL)
        without = MultiheadAttention(E, H, causal=True).eval()
        without.load_state_dict(layer.state_dict(), strict=False)
        assert (without(x)[0] - full).abs().max() > 10 * ATOL  # the position term matters
    layer = _invariance_layer(name).eval()
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[1, :3] = False  # left padding: every real query of example 1 would see the padded keys
    with torch.no_grad():
        got = layer(x, key_mask=keep)[0]
        changed_pad = x.clone()
        changed_pad[1, :3] += 5.0  # padded keys and values changed: real positions must not see it
        again = layer(changed_pad, key_mask=keep)[0]
        assert torch.allclose(again[1, 3:], got[1, 3:], atol=ATOL) and torch.allclose(again[0], got[0], atol=ATOL)
        assert (layer(x)[0][1, 3:] - got[1, 3:]).abs().max() > 10 * ATOL  # the padding mask was applied
