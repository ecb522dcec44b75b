"""Real training inputs on every backend: key padding, causal chunks, dropout, low precision, typed masks.

Each backend is compared with a naive fp64 oracle (outputs) and with the eager reference
(gradients into q, k, v and the bias table). Causal chunks and backward row blocks are made
small here so that short sequences already exercise many tiles and blocks.
"""

import math

import pytest
import torch

import relpos.backends._fused
import relpos.backends._tiles
from relpos import (
    MultiheadAttention,
    RelativePositionalBias,
    ShawRelativePosition,
    T5Attention,
    attention,
    cross_attention_with_bias,
    relative_positions,
    select_backend,
)
from relpos.backends._dropout import keep_dense, keep_rows
from relpos.backends._masks import key_ranges
from relpos.backends._tiles import plan_tiles

from oracles import assert_bias_matters, attend, bias_oracle

from relpos.backends import dispatch as attention_module

B, H, D = 3, 4, 8
LENGTHS = {  # per-example real-token runs (start, end) over Lk = 13 keys
    "right": ((0, 13), (0, 9), (0, 4)),
    "left": ((0, 13), (4, 13), (9, 13)),
    "fully_padded": ((0, 13), (0, 0), (2, 11)),
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(relpos.backends._tiles, "CAUSAL_CHUNK", 3)  # many causal chunks at L = 13
    monkeypatch.setattr(attention_module, "_FUSED_MIN_SCORES", 0)  # tiles even for these small problems
    monkeypatch.setattr(relpos.backends._fused, "_BLOCK_ELEMENTS", 4 * 4 * 13)  # a few rows per backward block


def keep_of(runs, lk=13):
    j = torch.arange(lk)
    return torch.stack([(j >= s) & (j < e) for s, e in runs])  # (B, Lk)


def oracle(q, k, v, bias_dense, keep=None, causal=False, q_offset=0, scale=None):
    """Naive fp64 attention; rows with no visible key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale + bias_dense.double()
    allowed = torch.ones(s.shape, dtype=torch.bool)
    if causal:
        allowed = allowed & (relative_positions(q.shape[2], k.shape[2], q_offset=q_offset) <= 0)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return p @ v


def make(lq=13, lk=13, dtype=torch.float32, causal=False, seed=0):
    torch.manual_seed(seed)
    bias = RelativePositionalBias(H, num_buckets=8, max_distance=10, bidirectional=not causal)
    torch.nn.init.normal_(bias.relative_attention_bias.weight)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(B, H, lq, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, H, lk, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, H, lk, D, generator=g).to(dtype).requires_grad_()
    return bias, q, k, v


def grads_of(out, tensors):
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    (out.double() * weights).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def mask_forms(runs, lq, causal, q_offset):
    """The same padding given four ways: key_mask, bool (B,1,1,Lk), additive, and transformers' 4-D."""
    keep = keep_of(runs)
    minimum = torch.finfo(torch.float32).min
    forms = {
        "key_mask": {"key_mask": keep},
        "bool_4d": {"attn_mask": keep[:, None, None, :]},
        "additive_4d": {"attn_mask": torch.zeros(B, 1, 1, 13).masked_fill(~keep[:, None, None, :], minimum)},
    }
    rows = keep[:, None, None, :].expand(B, 1, lq, 13)
    if causal:
        rows = rows & (relative_positions(lq, 13, q_offset=q_offset) <= 0)
    forms["hf_rows_4d"] = {"attn_mask": torch.zeros(B, 1, lq, 13).masked_fill(~rows, minimum)}
    return forms


CASES = [  # (lq, causal, q_offset): Lk = 13 throughout
    (13, False, 0),
    (13, True, 0),
    (5, False, 0),
    (5, True, 8),
    (1, True, 12),
]


@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
@pytest.mark.parametrize("padding", sorted(LENGTHS))
@pytest.mark.parametrize("lq, causal, q_offset", CASES)
def test_padding_and_causal_equal_oracle_with_gradients(backend, padding, lq, causal, q_offset):
    runs = LENGTHS[padding]
    bias, q, k, v = make(lq=lq, causal=causal)
    table = bias.relative_attention_bias.weight
    expected = oracle(q, k, v, bias_oracle(bias, lq, 13, q_offset), keep_of(runs), causal, q_offset)
    assert_bias_matters(expected, oracle(q, k, v, torch.zeros(()), keep_of(runs), causal, q_offset), 1e-5)
    reference = None
    for form, masks in mask_forms(runs, lq, causal, q_offset).items():
        out = attention(q, k, v, bias=bias, causal=causal, q_offset=q_offset, backend=backend, **masks)
        assert torch.allclose(out.double(), expected, atol=1e-5), form
        grads = grads_of(out, [q, k, v, table])
        assert all(torch.isfinite(g).all() for g in grads), form
        if reference is None:
            eager = attention(q, k, v, bias=bias, causal=causal, q_offset=q_offset, backend="eager", key_mask=keep_of(runs))
            reference = grads_of(eager, [q, k, v, table])
        for got, want in zip(grads, reference):
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), form
    if padding == "fully_padded":  # the example with no real key: zeros, zero gradients into its inputs
        out = attention(q, k, v, bias=bias, causal=causal, q_offset=q_offset, backend=backend, key_mask=keep_of(runs))
        assert out[1].abs().max() == 0
        gq, gk, gv, _ = grads_of(out, [q, k, v, table])
        assert gq[1].abs().max() == 0 and gk[1].abs().max() == 0 and gv[1].abs().max() == 0


def test_flex_padding_and_causal_equal_eager_on_cpu_inference():
    bias, q, k, v = make(lq=64, lk=64, causal=True)
    keep = torch.ones(B, 64, dtype=torch.bool)
    keep[1, 40:] = False  # right padding
    keep[2, :10] = False  # left padding
    with torch.no_grad():
        for causal in (False, True):
            got = attention(q, k, v, bias=bias, causal=causal, key_mask=keep, backend="flex")
            want = attention(q, k, v, bias=bias, causal=causal, key_mask=keep, backend="eager")
            assert torch.allclose(got, want, atol=1e-5)


def test_masks_that_are_not_key_padding_take_the_dense_path_and_say_why():
    bias, q, k, v = make()
    holes = keep_of(LENGTHS["right"]).clone()
    holes[0, 5] = False  # a hole inside the run: no contiguous key range
    choice = select_backend(q, k, v, bias=bias, key_mask=holes)
    assert choice.backend == "sdpa" and "not a key padding mask" in choice.reason
    additive = torch.randn(B, 1, 1, 13)  # a real additive bias, not a mask
    assert "not a key padding mask" in select_backend(q, k, v, bias=bias, attn_mask=additive).reason
    for masks in ({"key_mask": holes}, {"attn_mask": additive}):
        expected = attention(q, k, v, bias=bias, backend="eager", **masks)
        assert torch.allclose(attention(q, k, v, bias=bias, **masks), expected, atol=1e-5)
        with pytest.raises(ValueError, match=r"backend='fused' cannot run this call \(needs a per-offset bias"):
            attention(q, k, v, bias=bias, backend="fused", **masks)


def test_key_ranges_recognition():
    keep = keep_of(LENGTHS["left"])
    assert key_ranges(None, keep, B, 13, 13).starts == (0, 4, 9)
    causal_rows = keep[:, None, None, :] & (relative_positions(13, 13) <= 0)
    ranges = key_ranges(causal_rows, None, B, 13, 13)
    assert ranges.causal and ranges.starts == (0, 4, 9) and ranges.ends == (13, 13, 13)
    holes = keep.clone()
    holes[0, 3] = False
    assert key_ranges(None, holes, B, 13, 13) is None
    per_head = keep[:, None, None, :].expand(B, H, 1, 13)
    assert key_ranges(per_head, None, B, 13, 13) is None
    not_causal = causal_rows.clone()
    not_causal[0, 0, 5, 9] = True  # one row that is neither padding nor causal
    assert key_ranges(not_causal, None, B, 13, 13) is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_offset, lq", [(0, 13), (4, 9), (12, 1)])
def test_tiles_cover_every_visible_score_once(causal, q_offset, lq):
    runs = ((0, 13), (3, 13), (0, 7), (0, 7), (5, 5))
    count = torch.zeros(len(runs), lq, 13, dtype=torch.long)
    for b0, b1, r0, r1, k0, k1 in plan_tiles(len(runs), lq, 13, q_offset=q_offset, causal=causal, key_ranges=runs, chunk=3):
        count[b0:b1, r0:r1, k0:k1] += 1
    visible = keep_of(runs)[:, None, :].expand(-1, lq, -1)
    if causal:
        visible = visible & (relative_positions(lq, 13, q_offset=q_offset) <= 0)
    assert (count <= 1).all()  # nothing computed twice
    assert (count[visible] == 1).all()  # every visible score computed (hidden ones inside a tile get -inf)


def test_sdpa_receives_views_never_a_dense_mask(monkeypatch):
    import torch.nn.functional as F

    masks = []
    real = F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return real(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    bias, q, k, v = make(causal=True)
    with torch.no_grad():
        attention(q, k, v, bias=bias, causal=True, key_mask=keep_of(LENGTHS["left"]), backend="sdpa")
    assert len(masks) > 3  # tiles: causal chunks per padding group
    values = 2 * 13 - 1
    assert all(m.untyped_storage().nbytes() <= H * values * 4 for m in masks)


# --- dropout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal, padding", [(False, None), (True, None), (True, "left"), (False, "right")])
def test_fused_dropout_equals_eager_with_the_same_seed(causal, padding):
    bias, q, k, v = make(causal=causal)
    table = bias.relative_attention_bias.weight
    masks = {} if padding is None else {"key_mask": keep_of(LENGTHS[padding])}
    results = {}
    for backend in ("eager", "fused"):
        torch.manual_seed(123)
        out = attention(q, k, v, bias=bias, causal=causal, dropout_p=0.3, backend=backend, **masks)
        results[backend] = [out.detach()] + grads_of(out, [q, k, v, table])
    for got, want in zip(results["fused"], results["eager"]):
        assert torch.allclose(got.double(), want.double(), atol=1e-5, rtol=1e-4)
    torch.manual_seed(0)
    no_drop = attention(q, k, v, bias=bias, causal=causal, backend="eager", **masks)
    assert not torch.allclose(results["eager"][0], no_drop.detach(), atol=1e-3)  # dropout did something


@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
def test_dropout_is_seeded_by_torch(backend):
    bias, q, k, v = make()
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(attention(q, k, v, bias=bias, dropout_p=0.2, backend=backend).detach())
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_dropout_is_unbiased():
    bias, q, k, v = make(lq=6, lk=13, causal=True)
    with torch.no_grad():
        expected = attention(q, k, v, bias=bias, causal=True, q_offset=7, backend="eager")
        torch.manual_seed(0)
        draws = torch.stack(
            [attention(q, k, v, bias=bias, causal=True, q_offset=7, dropout_p=0.25, backend="fused") for _ in range(600)]
        )
    stderr = draws.std(0) / math.sqrt(draws.shape[0])
    assert ((draws.mean(0) - expected).abs() <= 6 * stderr + 1e-6).all()


def test_dropout_masks_keep_rate_and_tiling_independence():
    keep = keep_dense(7, 2, 3, 200, 50, 0.1)
    rate = keep.double().mean().item()
    n = keep.numel()
    assert abs(rate - 0.9) < 5 * math.sqrt(0.9 * 0.1 / n)
    # any row window of keep_rows is the same slice of the dense mask, wherever a tile starts
    for r0, r1 in ((0, 1), (63, 65), (100, 200), (5, 130)):
        assert torch.equal(keep_rows(7, 1, r0, r1, 3, 50, 0.1), keep[1, :, r0:r1])


def test_modules_drop_only_in_training():
    torch.manual_seed(0)
    layer = T5Attention(32, 4, dropout=0.5, bidirectional=False)
    x = torch.randn(2, 10, 32)
    layer.eval()
    base = layer(x)[0]
    assert torch.equal(layer(x)[0], base)
    layer.train()
    torch.manual_seed(1)
    dropped = layer(x)[0]
    assert not torch.allclose(dropped, base)
    layer.backend = "eager"
    torch.manual_seed(1)
    assert torch.allclose(layer(x)[0], dropped, atol=1e-5)  # eager draws the same masks
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        MultiheadAttention(32, 4, dropout=1.0)


def test_auto_uses_the_fused_path_for_dropout_on_cpu():
    bias, q, k, v = make()
    choice = select_backend(q, k, v, bias=bias, dropout_p=0.1)
    assert choice.backend == "fused" and "no dropout" in choice.rejected["sdpa"]
    assert "no dropout" in choice.rejected["flex"]
    with pytest.raises(ValueError, match="flex_attention has no dropout"):
        attention(q.detach(), k.detach(), v.detach(), bias=bias, dropout_p=0.1, backend="flex")


# --- low precision ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "fused"])
@pytest.mark.parametrize("causal, padding", [(False, None), (True, "left"), (False, "right")])
def test_low_precision_error_ratio_against_sdpa(dtype, backend, causal, padding):
    """Error vs the fp64 oracle within 2x (+ a floor) of SDPA's own low-precision error: output, dq, dk, dv, d table."""
    import torch.nn.functional as F

    bias, q, k, v = make(lq=40, lk=40, causal=causal)
    bias.relative_attention_bias.weight.data.mul_(3)
    table = bias.relative_attention_bias.weight
    keep = None
    if padding is not None:
        keep = torch.ones(B, 40, dtype=torch.bool)
        keep[1, 30:] = False
        keep[2, :12] = False
    allowed = torch.ones(B, 1, 40, 40, dtype=torch.bool)
    if causal:
        allowed = allowed & (relative_positions(40, 40) <= 0)
    if keep is not None:
        allowed = allowed & keep[:, None, None, :]

    def sdpa_run(dtype_):  # SDPA's own path: the bias and mask rounded to the input dtype, as users pass them
        inputs = [t.detach().to(dtype_).requires_grad_() for t in (q, k, v)]
        mask = bias_oracle(bias, 40, 40, grad=True).to(dtype_).masked_fill(~allowed, float("-inf"))
        out = F.scaled_dot_product_attention(*inputs, attn_mask=mask)
        return [out.detach().double()] + grads_of(out, [*inputs, table])

    exact, reference = sdpa_run(torch.float64), sdpa_run(dtype)
    without = attend(q, k, v, causal=causal, keep=keep)
    floor = {torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert_bias_matters(exact[0], without, 2 * float((reference[0] - exact[0]).abs().max()) + floor)
    lo = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    masks = {} if keep is None else {"key_mask": keep}
    out = attention(*lo, bias=bias, causal=causal, backend=backend, **masks)
    assert out.dtype == dtype
    got = [out.detach().double()] + grads_of(out, [*lo, table])
    for name, g, r, e in zip(("out", "dq", "dk", "dv", "dtable"), got, reference, exact):
        got_err, ref_err = (g.double() - e).abs().max(), (r.double() - e).abs().max()
        scale = 1.0 if name != "dtable" else max(1.0, float(e.abs().max()))  # the table gradient sums many scores
        assert got_err <= 2 * ref_err + floor * scale, (name, float(got_err), float(ref_err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_huge_and_infinite_biases_agree_on_every_backend(dtype):
    torch.manual_seed(0)
    bias = RelativePositionalBias(H, num_buckets=8, max_distance=10)
    with torch.no_grad():
        table = torch.tensor([-1e5, 1e5, 0.0, float("-inf"), 3.0, -1e5, 1e5, float("-inf")])  # one per bucket
        bias.relative_attention_bias.weight.copy_(torch.stack([table.roll(h) for h in range(H)], 1))  # (8, H)
    q, k, v = (torch.randn(B, H, 13, D).to(dtype) for _ in range(3))
    expected = oracle(q, k, v, bias_oracle(bias, 13, 13))
    # logits near 1e5 hold q.k only to fp32's resolution there (1e5 * 2**-23 ~ 0.008): hence 2e-2
    for backend in ("eager", "sdpa", "fused"):
        out = attention(q, k, v, bias=bias, backend=backend)
        assert torch.isfinite(out).all(), backend
        assert torch.allclose(out.double(), expected, atol=2e-2), backend


# --- masks are typed once --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_masks_are_refused_everywhere(dtype):
    bias, q, k, v = make()
    mask = torch.ones(B, 1, 1, 13, dtype=dtype)
    with pytest.raises(TypeError, match=r"refuses integer masks.*\.bool\(\)"):
        attention(q, k, v, bias=bias, attn_mask=mask)
    with pytest.raises(TypeError, match="refuses integer masks"):
        select_backend(q, k, v, bias=bias, attn_mask=mask)
    with pytest.raises(TypeError, match="refuses integer masks"):
        cross_attention_with_bias(q, k, v, bias, mask)
    with pytest.raises(TypeError, match="refuses integer masks"):
        ShawRelativePosition(D, 3).attention(q, k, v, attn_mask=mask)
    x = torch.randn(B, 13, 16)
    with pytest.raises(TypeError, match="refuses integer masks"):
        T5Attention(16, 4)(x, mask)
    with pytest.raises(TypeError, match="key_mask must be boolean"):
        MultiheadAttention(16, 4)(x, key_mask=torch.ones(B, 13, dtype=dtype))
    with pytest.raises(TypeError, match="key_mask must be boolean"):
        attention(q, k, v, key_mask=torch.ones(B, 13, dtype=dtype))


def test_mask_shapes_are_checked_with_a_hint():
    bias, q, k, v = make(lq=5)
    with pytest.raises(ValueError, match=r"a 2-D attn_mask is \(Lq, Lk\).*key_mask="):
        attention(q, k, v, bias=bias, attn_mask=torch.ones(B, 13, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_mask must have shape \(B, Lk\) = \(3, 13\)"):
        attention(q, k, v, key_mask=torch.ones(13, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        attention(q, k, v, dropout_p=-0.1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention(q, k, v, causal="no")
    with pytest.raises(ValueError, match="scale must be finite"):
        attention(q, k, v, scale=float("nan"))


def test_stack_padding_matches_unpadded_sequences():
    """A padded batch through a T5 stack gives each example what it gives alone (right padding)."""
    from relpos import T5Stack

    torch.manual_seed(0)
    stack = T5Stack(2, 32, 4, 64).eval()
    torch.nn.init.normal_(stack.relative_bias.relative_attention_bias.weight, std=1.5)  # a bias that moves the output
    x = torch.randn(2, 12, 32)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 7:] = False
    with torch.no_grad():
        batched = stack(x, key_mask=keep)
        alone = stack(x[1:, :7])
    assert torch.allclose(batched[1, :7], alone[0], atol=1e-5)


def test_tensor_inputs_are_checked_at_the_boundary():
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match="head dimension must be positive"):
        attention(q[..., :0], q[..., :0], q[..., :0])
    with pytest.raises(TypeError, match=r"one floating dtype.*torch.float32, torch.float64"):
        attention(q, q.double(), q)
    with pytest.raises(TypeError, match="one floating dtype"):
        attention(q.long(), q.long(), q.long())
    with pytest.raises(TypeError, match="values must be a floating tensor"):
        relpos.OffsetBias([[0.0] * 6], 3, 4)
    with pytest.raises(TypeError, match="positional"):
        RelativePositionalBias(4)(4, 4, 2)  # an offset given positionally is not taken as a device
    assert attention(q, q[:, :, :0], q[:, :, :0]).abs().max() == 0  # no key at all: zeros, like a fully masked row


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_grouped_query_attention_on_tiles(backend):
    """4 query heads reading 2 key/value heads (sdpa: SDPA's enable_gqa, no k/v copies), padded and causal."""
    torch.manual_seed(0)
    bias = RelativePositionalBias(H, num_buckets=8, max_distance=10, bidirectional=False)
    q = torch.randn(B, H, 13, D, requires_grad=True)
    k = torch.randn(B, 2, 13, D, requires_grad=True)
    v = torch.randn(B, 2, 13, D, requires_grad=True)
    keep = keep_of(LENGTHS["left"])
    torch.nn.init.normal_(bias.relative_attention_bias.weight, std=1.5)
    k2, v2 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    expected = oracle(q, k2, v2, bias_oracle(bias, 13, 13), keep, causal=True)
    out = attention(q, k, v, bias=bias, causal=True, key_mask=keep, backend=backend)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert_bias_matters(expected, oracle(q, k2, v2, torch.zeros(()), keep, causal=True), 1e-5)
    got = grads_of(out, [q, k, v])
    want = grads_of(attention(q, k, v, bias=bias, causal=True, key_mask=keep, backend="eager"), [q, k, v])
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)


def test_masked_softmax_rows_with_nothing_to_attend_to():
    """One pass finds the dead rows (their maximum is -inf): none, it is softmax itself; some, they give
    zeros and zero gradient while every other row is softmax; the branch-free form (used while
    compiling) gives the same."""
    from unittest import mock

    from relpos.backends.dispatch import masked_softmax

    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 7)
    assert torch.equal(masked_softmax(scores), torch.softmax(scores, dim=-1))
    masked = scores.clone()
    masked[0, 1, 2] = float("-inf")  # a padded query row: nothing to attend to
    masked[1, 0, :, 4:] = float("-inf")  # some keys hidden in every row
    masked.requires_grad_(True)
    weights = masked_softmax(masked)
    assert weights[0, 1, 2].abs().sum() == 0
    live = torch.ones(2, 3, 5, dtype=torch.bool)
    live[0, 1, 2] = False
    assert torch.allclose(weights[live], torch.softmax(masked.detach(), dim=-1)[live])
    (weights * torch.randn_like(weights)).sum().backward()
    assert torch.isfinite(masked.grad).all() and masked.grad[0, 1, 2].abs().sum() == 0
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        assert torch.equal(masked_softmax(masked.detach()), weights.detach())
