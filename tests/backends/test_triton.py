"""The Triton kernel (``backend="triton"``) against fp64 attention built from the formulas.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set
here before the kernels are imported) with 16 x 16 tiles, so these small sizes already cross many
tiles, flat ranges, causal diagonals and padding edges. With a GPU the same tests run on it with the
kernel's real tiles, and tests/backends/test_triton_gpu.py adds real sizes.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before relpos.backends._triton builds its kernels

pytest.importorskip("triton")  # the dev extra installs it (tests/conftest.py: under CI a skip fails)

import relpos  # noqa: E402
from relpos.backends import _triton  # noqa: E402

from oracles import _philox_words, assert_bias_matters, attend, bias_oracle, philox_keep  # noqa: E402
from relpos.backends._dropout import draw_seed_tensor  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, D = 4, 16


def strong(module):
    """Parameters drawn large enough that the position term moves the output far beyond the tolerance."""
    torch.manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 1.5 if p.dim() > 1 or p.numel() > H else p.abs() + 0.3)
    return module


BIASES = {
    "t5": lambda: strong(relpos.T5RelativeBias(H, num_buckets=8, max_distance=8)),
    "t5_causal_buckets": lambda: strong(relpos.T5RelativeBias(H, num_buckets=8, max_distance=12, bidirectional=False)),
    "clipped": lambda: strong(relpos.ClippedRelativeBias(H, max_distance=5)),
    "alibi": lambda: relpos.ALiBi(H, slopes=[0.5, 0.3, 0.2, 0.1]),
    "alibi_symmetric": lambda: relpos.ALiBi(H, mode="symmetric", slopes=[0.5, 0.3, 0.2, 0.1]),
    "kerple": lambda: relpos.KerpleBias(H, r1=[1.0, 2.0, 0.5, 1.5], r2=[0.5, 1.0, 2.0, 0.3]),
    "sandwich": lambda: relpos.SandwichBias(H, dim=16),
    "fire": lambda: strong(relpos.FIREBias(H, mlp_width=8, init_L=512.0)),
    "log_decay": lambda: relpos.LogDecayBias(2.0, num_heads=H),
    "shared_head": lambda: strong(relpos.T5RelativeBias(1, num_buckets=8, max_distance=8)),
    "none": lambda: None,
}
CAUSAL_ONLY = {"alibi"}  # ALiBi's causal form defines no bias for future keys


def qkv(batch, lq, lk, *, kv_heads=H, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, H, lq, D), (batch, kv_heads, lk, D), (batch, kv_heads, lk, D))
    return [(torch.randn(s, generator=g) * 1.5).to(dtype) for s in shapes]


def expected(bias, q, k, v, *, causal, q_offset=0, keep=None, grad=False):
    slopes = bias._slopes if isinstance(bias, relpos.ALiBi) else None  # the oracle's default: the paper's slopes
    dense = None if bias is None else bias_oracle(bias, q.shape[2], k.shape[2], q_offset, slopes=slopes, grad=grad)
    return attend(q, k, v, dense, causal=causal, keep=keep, q_offset=q_offset)


def right_and_left_padded(length: int, end: int, start: int) -> torch.Tensor:
    """(2, length) key mask: example 0 real up to ``end``, example 1 from ``start`` on."""
    keep = torch.ones(2, length, dtype=torch.bool)
    keep[0, end:] = False
    keep[1, :start] = False
    return keep


def assert_table_training_equals_fp64(bias, q, k, v, *, causal, keep):
    """A T5 table's training step (loss ``sum(out ** 2)``) through the kernel: the output and the gradients of q, k, v
    and the table equal fp64 autograd on the formula. Returns fp64's gradients (q, k, v, the table)."""
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want_out = expected(bias, *exact, causal=causal, keep=keep, grad=True)
    want_out.square().sum().backward()
    want = [t.grad for t in exact] + [bias.relative_attention_bias.weight.grad.clone().double()]
    bias.zero_grad()
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), causal=causal,
                           key_mask=None if keep is None else keep.to(DEVICE), backend="triton")
    out.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want_out.detach(), atol=2e-5, rtol=1e-5)
    for a, b in zip([t.grad for t in leaves] + [bias.relative_attention_bias.weight.grad], want):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)
    return want


def run(bias, q, k, v, **kwargs):
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    module = None if bias is None else bias.to(DEVICE)
    out = relpos.attention(to(q), to(k), to(v), bias=module, key_mask=to(kwargs.pop("key_mask", None)), backend="triton", **kwargs)
    return out


@pytest.mark.parametrize("name,causal", [(n, c) for n in sorted(BIASES) for c in (False, True) if c or n not in CAUSAL_ONLY])
def test_every_bias_family_forward_and_gradients(name, causal):
    """Output and the gradients of q, k, v and every parameter of the bias against fp64 autograd."""
    check_forward_and_gradients(name, causal)


@pytest.mark.parametrize("name,causal", [("kerple", False), ("t5", True)])
def test_bias_gradient_with_dq_tiles_taller_than_wide(name, causal, monkeypatch):
    """dq sums each tile's dS along its diagonals as the two halves of a cyclic skew (``_diagonal_sums``): with tiles
    of 32 queries x 16 keys (the GPU's d = 128 shape, 128 x 32, scaled down) every parameter's gradient equals fp64;
    a dq tile wider than tall is refused when the tiles are made, and so are tiles (and gathering steps) that are not
    multiples of 16 (dropout's squares)."""
    monkeypatch.setattr(_triton, "INTERPRETER_BLOCKS", _triton._Blocks((16, 16, 1, 1), (16, 16, 1, 1), (32, 16, 1, 1)))
    check_forward_and_gradients(name, causal)
    with pytest.raises(ValueError, match=r"dq tile \(16, 32\).*at most its BM"):
        _triton._Blocks((16, 16, 1, 1), (16, 16, 1, 1), (16, 32, 1, 1))
    with pytest.raises(ValueError, match=r"dkdv tile \(8, 16\).*multiples of 16"):
        _triton._Blocks((16, 16, 1, 1), (8, 16, 1, 1), (16, 16, 1, 1))
    with pytest.raises(ValueError, match=r"gather_split 4.*multiples of 16, got 32 / 4"):
        _triton._Blocks((16, 16, 1, 1), (16, 16, 1, 1), (16, 16, 1, 1), fwd_offsets=(16, 32, 1, 1), gather_split=4)


def check_forward_and_gradients(name, causal):
    bias = BIASES[name]()
    q, k, v = qkv(2, 45, 45)
    keep = torch.ones(2, 45, dtype=torch.bool)
    keep[1, 33:] = False  # one example padded, its length no multiple of 16
    weights = torch.randn(2, H, 45, D, generator=torch.Generator().manual_seed(1))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = expected(bias, *exact, causal=causal, keep=keep, grad=True)
    (want * weights.double()).sum().backward()
    params = [] if bias is None else [p for p in bias.parameters() if p.requires_grad]
    want_grads = [t.grad for t in exact] + [p.grad.double() for p in params]
    if bias is not None:
        assert_bias_matters(want, expected(None, *exact, causal=causal, keep=keep), 1e-4)
        bias.zero_grad()
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=None if bias is None else bias.to(DEVICE), causal=causal,
                           key_mask=keep.to(DEVICE), backend="triton")
    (out * weights.to(DEVICE)).sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    got = [t.grad for t in leaves] + [p.grad for p in params]
    for a, b in zip(got, want_grads):
        assert a is not None
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)


LENGTHS = {  # (Lq, Lk, causal, q_offset)
    "decode_row": (1, 50, True, 49),
    "decode_rows": (3, 50, True, 47),
    "cross": (17, 50, False, 0),
    "cross_causal_offset": (20, 50, True, 30),
    "longer_queries": (50, 19, False, 0),
}


@pytest.mark.parametrize("name,case", [(n, c) for n in ("t5", "alibi", "alibi_symmetric") for c in LENGTHS
                                       if LENGTHS[c][2] or n not in CAUSAL_ONLY])
def test_query_and_key_lengths_differ(name, case):
    """Decoding rows, cross attention and a causal offset: T5's flat ranges and ALiBi's tiles on either side of the
    diagonal ``j = i + q_offset`` (their per-row terms) where the query rows sit at ``q_offset``; outputs and the
    gradients of q, k, v and the bias's parameters (dk/dv and dq place those tiles by ``q_offset`` too) against fp64."""
    lq, lk, causal, q_offset = LENGTHS[case]
    bias = BIASES[name]()
    q, k, v = qkv(2, lq, lk)
    weights = torch.randn(2, H, lq, D, generator=torch.Generator().manual_seed(3))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = expected(bias, *exact, causal=causal, q_offset=q_offset, grad=True)
    (want * weights.double()).sum().backward()
    params = [p for p in bias.parameters() if p.requires_grad]
    want_grads = [t.grad for t in exact] + [p.grad.double() for p in params]
    bias.zero_grad()
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), causal=causal, q_offset=q_offset, backend="triton")
    (out * weights.to(DEVICE)).sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    got = [t.grad for t in leaves] + [p.grad for p in params]
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)


@pytest.mark.parametrize("layout", ["batch_of_one", "all_padding_example", "left", "one_real_token", "alike"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_layouts(layout, causal):
    batch = 1 if layout == "batch_of_one" else 3
    keep = torch.ones(batch, 40, dtype=torch.bool)
    if layout == "batch_of_one":
        keep[0, 24:] = False
    elif layout == "all_padding_example":
        keep[1] = False
        keep[2, 31:] = False
    elif layout == "left":
        keep[1, :7] = False
        keep[2, :20] = False
    elif layout == "one_real_token":
        keep[1] = False
        keep[1, 5] = True
    else:
        keep[:, 29:] = False  # every example padded alike
    bias = BIASES["t5"]()
    q, k, v = qkv(batch, 40, 40)
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), causal=causal, key_mask=keep.to(DEVICE), backend="triton")
    out.square().sum().backward()
    want = expected(bias, q, k, v, causal=causal, keep=keep)
    torch.testing.assert_close(out.detach().cpu().double(), want, atol=2e-5, rtol=1e-5)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    dead = ~keep.any(-1)  # examples with no real key: output 0 and no gradient
    assert (out.detach().cpu()[dead] == 0).all() and (leaves[0].grad.cpu()[dead] == 0).all()


@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_fused_qkv_views_get_their_own_gradients(name):
    """q, k, v as views into one fused (B, L, H, 3, d) projection (Bloom, MPT, Falcon): not dense, so a gradient
    allocated like q would be contiguous while q's strides are three times as wide. dq is written contiguous
    (before: at q's strides, past the end of its buffer; the H100 run of Bloom and MPT training stopped with an
    illegal memory access, and the interpreter corrupts its heap). Causal, right-padded, against fp64."""
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(2, 40, H, 3, D, generator=g) * 1.5  # (B, L, H, 3, d)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1, 29:] = False
    bias = BIASES[name]()
    exact = [fused[..., i, :].transpose(1, 2).double().requires_grad_() for i in range(3)]  # (B, H, L, d)
    want = expected(bias, *exact, causal=True, keep=keep)
    want.square().sum().backward()
    on_device = fused.to(DEVICE).requires_grad_()
    views = [on_device[..., i, :].transpose(1, 2) for i in range(3)]  # (B, H, L, d), strides (3 L H d, 3 d, 3 H d, 1)
    assert not views[0].is_contiguous() and views[0].stride(1) == 3 * D
    out = relpos.attention(*views, bias=bias.to(DEVICE), causal=True, key_mask=keep.to(DEVICE), backend="triton")
    out.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    grads = on_device.grad.cpu().double()  # (B, L, H, 3, d): dq, dk, dv in their slots
    for i, t in enumerate(exact):
        torch.testing.assert_close(grads[..., i, :].transpose(1, 2), t.grad, atol=1e-4 * max(1.0, float(t.grad.abs().max())),
                                   rtol=1e-4)


@pytest.mark.parametrize("name,causal,padded", [("t5", False, False), ("t5", True, True), ("kerple", True, False),
                                                 ("clipped", False, True), ("t5_causal_buckets", True, False)])
def test_gathering_blocks_in_half_steps(name, causal, padded, monkeypatch):
    """``gather_split=2`` (a GPU tile shape to sweep: flat blocks 32 keys wide, gathering and masked blocks as two
    steps of 16): equal to fp64, with flat ranges, padding edges and lengths that are not multiples of a block. The
    first case runs the same call with the default tiles first: the launch follows the tiles changed since (the
    forward's launch arguments are worked out once per kind of call, keyed by the tiles too)."""
    bias = BIASES[name]()
    q, k, v = qkv(2, 75, 75, seed=6)
    keep = right_and_left_padded(75, 61, 9) if padded else None
    splits = []  # the forward kernel's GS per launch
    kernel_type = type(_triton._fwd_kernel)
    real = kernel_type.__getitem__

    def spy(self, grid):
        launch = real(self, grid)
        if self is not _triton._fwd_kernel:
            return launch
        return lambda *args, **kwargs: splits.append(kwargs["GS"]) or launch(*args, **kwargs)

    monkeypatch.setattr(kernel_type, "__getitem__", spy)
    first = name == "t5" and not causal
    with torch.no_grad():
        if first:
            run(bias, q, k, v, causal=causal, key_mask=keep)  # the default tiles
        monkeypatch.setattr(_triton, "INTERPRETER_BLOCKS", _triton._Blocks(
            (16, 32, 1, 1), (16, 16, 1, 1), (16, 16, 1, 1), fwd_offsets=(16, 32, 1, 1), gather_split=2))
        out = run(bias, q, k, v, causal=causal, key_mask=keep)
    assert splits == ([1, 2] if first else [2]), splits
    torch.testing.assert_close(out.cpu().double(), expected(bias, q, k, v, causal=causal, keep=keep), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("causal,mask", [(False, None), (True, "ranges"), (True, "holes"), (False, "holes"),
                                         (True, "empty")])
def test_flat_blocks_and_the_rest_in_two_launches(causal, mask, monkeypatch):
    """``split_flat`` (a GPU tile option to sweep): the flat blocks in one launch compiled without the gathering code,
    then the gathered and masked blocks from its output and log-sum-exp; outputs and gradients (the table's far
    buckets included) equal fp64, with key ranges, a key mask with holes (per key), an example with no key and a
    decoding chunk; one launch with dropout (the two parts would draw twice)."""
    monkeypatch.setattr(_triton, "INTERPRETER_BLOCKS", _triton._Blocks(
        (16, 32, 1, 1), (16, 16, 1, 1), (16, 16, 1, 1), fwd_offsets=(16, 32, 1, 1), gather_split=2, split_flat=True))
    launches = []  # the forward kernel's launches
    kernel_type = type(_triton._fwd_kernel)
    real = kernel_type.__getitem__
    monkeypatch.setattr(kernel_type, "__getitem__",
                        lambda self, grid: (self is _triton._fwd_kernel and launches.append(grid)) or real(self, grid))
    bias = strong(relpos.T5RelativeBias(H, num_buckets=8, max_distance=4))
    q, k, v = qkv(2, 80, 80, seed=5)
    keep = None if mask is None else right_and_left_padded(80, 70, 21)
    if mask == "holes":
        keep[0, 30:34] = False
    if mask == "empty":  # an example with no key at all: zeros, and no gradient
        keep[1] = False
    assert_table_training_equals_fp64(bias, q, k, v, causal=causal, keep=keep)
    assert len(launches) == 2
    if mask is not None:
        return
    with torch.no_grad():  # the last 20 rows over the whole cache
        step = relpos.attention(q[:, :, 60:].to(DEVICE), k.to(DEVICE), v.to(DEVICE), bias=bias, causal=True, q_offset=60,
                                backend="triton")
        torch.testing.assert_close(step.cpu().double(), expected(bias, q[:, :, 60:], k, v, causal=True, q_offset=60),
                                   atol=2e-5, rtol=1e-5)
        launches.clear()
        relpos.attention(*(t.to(DEVICE) for t in (q, k, v)), bias=bias, dropout_p=0.1, backend="triton")
        assert len(launches) == 1


def test_inference_launches_without_autograd_and_equals_the_training_forward(monkeypatch):
    """Nothing to differentiate (no_grad, or no input that requires grad): the kernel launches without
    autograd.Function (no graph, no saved tensors), with the same output, bit for bit, as the forward of a training
    call; with an input that requires grad the call goes through the Function and trains the table."""
    bias = BIASES["t5"]()
    q, k, v = qkv(2, 11, 13)
    applied = []
    real_apply = _triton._TritonAttention.apply
    monkeypatch.setattr(_triton._TritonAttention, "apply", lambda *a: applied.append(1) or real_apply(*a))
    with torch.no_grad():
        fast = run(bias, q, k, v, causal=True)
    frozen = run(bias.requires_grad_(False), q, k, v, causal=True)  # grad enabled, nothing requires it
    assert fast.grad_fn is None and frozen.grad_fn is None and not applied
    trained = run(bias.requires_grad_(True), q, k, v, causal=True)
    assert applied and trained.grad_fn is not None and torch.equal(fast, trained.detach()) and torch.equal(fast, frozen)
    trained.sum().backward()
    assert bias.relative_attention_bias.weight.grad.abs().sum() > 0
    torch.testing.assert_close(fast.double(), expected(bias, q, k, v, causal=True), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", sorted(_triton.GPU_BLOCKS))
def test_the_gpus_tiles_for_each_head_dimension(head_dim, monkeypatch):
    """The tiles a GPU launches for each head dimension (``GPU_BLOCKS``: 64 x 64 forwards, 32 x 128 dk/dv, 128-row
    tiles for larger heads; the tests above run the interpreter's 16 x 16), here under the interpreter on small heads:
    a causal, padded T5 training step with flat ranges (the per-offset forward, dk/dv and dq with the table's
    gradient) and a symmetric ALiBi forward equal fp64."""
    blocks = _triton.GPU_BLOCKS[head_dim]
    monkeypatch.setattr(_triton, "_blocks", lambda dim, device: blocks)
    bias = strong(relpos.T5RelativeBias(H, num_buckets=8, max_distance=16))
    q, k, v = qkv(2, 150, 150, seed=8)
    keep = right_and_left_padded(150, 131, 7)
    assert_table_training_equals_fp64(bias, q, k, v, causal=True, keep=keep)
    alibi = BIASES["alibi_symmetric"]()
    with torch.no_grad():
        torch.testing.assert_close(run(alibi, q, k, v).cpu().double(), expected(alibi, q, k, v, causal=False),
                                   atol=2e-5, rtol=1e-5)


def test_grouped_key_value_heads():
    bias = BIASES["kerple"]()
    q, k, v = qkv(2, 33, 33, kv_heads=2)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = expected(bias, *exact, causal=True)
    want.sum().backward()
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), causal=True, backend="triton")
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    for a, b in zip(leaves, exact):
        torch.testing.assert_close(a.grad.cpu().double(), b.grad, atol=1e-4, rtol=1e-4)


def test_head_dims_that_are_not_powers_of_two_and_an_explicit_scale():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, H, 30, 24, generator=g), torch.randn(2, H, 30, 24, generator=g)
    v = torch.randn(2, H, 30, 40, generator=g)  # dv differs from d
    bias = BIASES["clipped"]()
    with torch.no_grad():
        out = run(bias, q, k, v, scale=1.0)
    want = attend(q, k, v, bias_oracle(bias, 30, 30), scale=1.0)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [-1.0, 0.0, 2.0])
@pytest.mark.parametrize("name", ["t5", "none"])
def test_any_real_scale_with_scores_far_apart(name, scale):
    """Tiles with no term per score take their row max from q.k's max times the scale, which is the scores' max
    only for a scale >= 0: a negative scale must not use it (scores over 100 apart overflow exp2 if it does)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, H, 40, D, generator=g) * 3 for _ in range(3))  # a tile's q.k spans > 100
    bias = BIASES[name]()
    with torch.no_grad():
        out = run(bias, q, k, v, scale=scale)
    want = attend(q, k, v, None if bias is None else bias_oracle(bias, 40, 40), scale=scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-4, rtol=1e-5)  # fp32 q.k ~ 50: eager and SDPA 6e-5 off too


BF16_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cpu", reason=(
    "Triton's interpreter multiplies bf16 tiles wrongly (tl.dot of two bf16 16x16 tiles is off by 1e10 under "
    "triton 3.9's interpreter); the GPU runs this case"))]


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_ON_GPU), torch.float16])
def test_low_precision_within_the_dtype_error_of_sdpa(dtype):
    """In bf16/fp16 the kernel errs no more than twice what the eager reference errs on the same inputs."""
    bias = BIASES["t5"]()
    q, k, v = qkv(2, 40, 40, dtype=dtype)
    want = expected(bias, q, k, v, causal=True)
    with torch.no_grad():
        ours = run(bias, q, k, v, causal=True)
        eager = relpos.attention(q, k, v, bias=bias.cpu(), causal=True, backend="eager")
    assert ours.dtype == dtype
    our_error = float((ours.cpu().double() - want).abs().max())
    eager_error = float((eager.double() - want).abs().max())
    assert our_error <= 2 * eager_error + 1e-3, (our_error, eager_error)


@pytest.mark.parametrize("causal,padded", [(False, False), (True, False), (False, True), (True, True)])
def test_flat_tiles_add_one_scalar_and_train_the_far_bucket(causal, padded):
    """T5 with max_distance 4 at L = 80: most tiles lie beyond the last bucket on one side or the other
    (the forward, dq and dk/dv loops each split their blocks into flat, gathered and masked runs); every
    output and gradient, the far buckets' included (those tiles send theirs to one entry), equals fp64."""
    bias = strong(relpos.T5RelativeBias(H, num_buckets=8, max_distance=4))
    offsets = bias.offsets(80, 80)
    assert offsets.flat == (-4, 4) and offsets.flat_indices() == (75, 83)
    q, k, v = qkv(2, 80, 80, seed=4)
    keep = right_and_left_padded(80, 70, 21) if padded else None
    want = assert_table_training_equals_fp64(bias, q, k, v, causal=causal, keep=keep)
    assert want[3][3].abs().max() > 1e-2  # the far-past bucket carries real gradient


def test_deterministic_bias_gradient_repeats_bit_for_bit():
    bias = BIASES["kerple"]()
    q, k, v = qkv(2, 40, 40)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            bias.zero_grad()
            run(bias, q, k, v, causal=True).sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in bias.parameters()]).cpu())
    finally:
        torch.use_deterministic_algorithms(False)
    bias.zero_grad()
    run(bias, q, k, v, causal=True).sum().backward()
    atomic = torch.cat([p.grad.flatten() for p in bias.parameters()]).cpu()
    assert torch.equal(grads[0], grads[1])
    torch.testing.assert_close(grads[0], atomic, atol=1e-5, rtol=1e-5)


def test_closed_forms_are_used_for_alibi_and_offsets_for_a_trained_table():
    from relpos.backends.dispatch import _prepare, _triton_spec

    q, k, v = qkv(1, 20, 20)
    alibi = _triton_spec(_prepare(q, k, v, relpos.ALiBi(H), True, None, None, 0.0, None, 0))
    t5 = _triton_spec(_prepare(q, k, v, BIASES["t5"](), False, None, None, 0.0, None, 0))
    assert alibi.bias_kind == _triton.BIAS_CAUSAL_LINEAR and alibi.flat is None
    assert t5.bias_kind == _triton.BIAS_OFFSETS and t5.flat == (11, 27)


def test_layers_sharing_one_bias_pad_its_values_once_and_train_it_through_both(monkeypatch):
    """Two layers of one forward reading the same per-offset values (a model's layers share one T5 bias per forward):
    the values are padded once; both layers' gradients reach the table, equal to the fp64 oracle's. Values changed in
    place are padded again."""
    bias = BIASES["t5"]().to(DEVICE)
    q, k, v = qkv(2, 24, 24)
    q2 = torch.randn_like(q)
    offsets = bias.offsets(24, 24)
    pads = []
    real_pad = torch.nn.functional.pad
    monkeypatch.setattr(torch.nn.functional, "pad", lambda *a, **kw: pads.append(1) or real_pad(*a, **kw))
    first = relpos.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bias=offsets, backend="triton")
    second = relpos.attention(q2.to(DEVICE), first, first, bias=offsets, backend="triton")
    assert len(pads) == 1
    second.square().sum().backward()
    table = bias.relative_attention_bias.weight
    grad, table.grad = table.grad.clone(), None
    dense = bias_oracle(bias.cpu(), 24, 24, grad=True)
    out = attend(q2, attend(q, k, v, dense), attend(q, k, v, dense), dense)
    out.square().sum().backward()
    torch.testing.assert_close(grad.cpu().double(), bias.relative_attention_bias.weight.grad.double(), rtol=1e-4, atol=1e-4)
    assert_bias_matters(out.detach(), attend(q2, attend(q, k, v), attend(q, k, v)), 1e-3)
    with torch.no_grad():
        offsets.values.mul_(2)  # in place: padded again
        relpos.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), bias=offsets, backend="triton")
    assert len(pads) == 2


def test_refusals_name_the_fix():
    q, k, v = qkv(1, 20, 20)
    with pytest.raises(ValueError, match="takes float16, bfloat16 or float32"):
        relpos.attention(*(t.double() for t in (q, k, v)), backend="triton")


def test_auto_never_picks_the_interpreter_on_cpu():
    q, k, v = qkv(2, 600, 600)
    choice = relpos.select_backend(q, k, v, bias=BIASES["t5"]())
    assert choice.backend != "triton" and "CUDA kernel" in choice.rejected["triton"]


def test_positions_as_exact_floats_up_to_their_limit():
    """ALiBi's tiles form positions as floats from their bits (``_exact_float``: no conversion instruction), exact
    for every integer of magnitude below 2**22; calls whose positions reach ``EXACT_POSITIONS`` convert instead."""
    import triton
    import triton.language as tl

    @triton.jit
    def floats(X, OUT, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(OUT + offs, _triton._exact_float(tl.load(X + offs)))

    x = torch.tensor([0, 1, -1, 255, -256, 12345, -54321, (1 << 22) - 1, -(1 << 22) + 1, 3, -3, 7, 1 << 20,
                      -(1 << 20), 99, -99], dtype=torch.int32)
    out = torch.empty(16, dtype=torch.float32)
    floats[(1,)](x.to(DEVICE), out := out.to(DEVICE), 16)
    assert torch.equal(out.cpu(), x.float())
    spec = _triton.TritonSpec(_triton.BIAS_CAUSAL_LINEAR, True, 1.0, _triton.EXACT_POSITIONS - 10, None)
    assert not _triton._wide(spec, 9, 100) and _triton._wide(spec, 10, 100)
    assert _triton._wide(dataclasses.replace(spec, q_offset=0), 1, _triton.EXACT_POSITIONS)
    kinds = _triton._kinds(dataclasses.replace(spec, causal=False), wide=True)
    assert kinds == dict(MAIN=_triton.CAUSAL_LINEAR + _triton.WIDE, LOW=_triton.RAMP + _triton.WIDE, HIGH=_triton.NONE,
                         FLAT=True)


@pytest.mark.parametrize("mode", ["causal", "symmetric"])
def test_alibi_at_positions_past_the_exact_floats(mode):
    """A query row at position 2**23 + 3 (past ``EXACT_POSITIONS``): the kernel converts its positions and is as
    close to fp64 as the eager fp32 route is (fp32 spaces values of m * 2**23 0.5 apart); positions formed from
    bits there would be 12x further off."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 3, D, generator=g), torch.randn(1, 2, 40, D, generator=g)
    bias = relpos.ALiBi(2, mode=mode, slopes=[0.5, 0.25])
    offset = (1 << 23) + 3
    with torch.no_grad():
        out = run(bias, q, k, k, causal=True, q_offset=offset)
        eager = relpos.attention(q, k, k, bias=bias, causal=True, q_offset=offset, backend="eager")
    exact = relpos.attention(q.double(), k.double(), k.double(), bias=bias.double(), causal=True, q_offset=offset,
                             backend="eager")
    fp32_error = (eager.double() - exact).abs().max().item()
    assert (out.cpu().double() - exact).abs().max().item() <= 2 * fp32_error + 1e-4


@pytest.mark.parametrize("radius", [2, 18])
def test_clipped_blocks_on_the_edge_of_the_flat_range(radius):
    """Clipped biases whose flat range starts exactly one offset past a 16-key block's last diagonal
    (R = 2 and 18 with the interpreter's 16 x 16 tiles): that block has a value of its own and must gather."""
    bias = strong(relpos.ClippedRelativeBias(H, max_distance=radius))
    q, k, v = qkv(2, 80, 80, seed=5)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = expected(bias, *exact, causal=False, grad=True)
    want.square().sum().backward()
    table_grad = bias.relative_bias.grad.clone().double()
    bias.zero_grad()
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), backend="triton")
    out.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    for a, b in zip([t.grad for t in leaves] + [bias.relative_bias.grad], [t.grad for t in exact] + [table_grad]):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)


def seeded_call(seed):
    """The dropout seed relpos.attention draws after ``torch.manual_seed(seed)`` (one draw per call, on the device)."""
    torch.manual_seed(seed)
    return int(draw_seed_tensor(DEVICE).item())


def test_the_philox_oracle_gives_random123s_known_answers():
    """The numpy Philox4x32 the dropout tests read masks from equals the known-answer vectors Random123 publishes
    (Salmon et al.'s reference implementation, kat_vectors: zero counter and key, and the digits of pi, which set
    every counter and key word) for 7 rounds, the kernel's (as FlashAttention-2's), and 10."""
    pi_counter, pi_key = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0xA4093822 | 0x299F31D0 << 32
    for rounds, counter, key, expected in (
        (7, (0, 0, 0, 0), 0, (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
        (10, (0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        (7, pi_counter, pi_key, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
        (10, pi_counter, pi_key, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ):
        words = _philox_words(key, *counter, rounds=rounds)
        assert tuple(int(w) for w in words) == expected, (rounds, counter)


@pytest.mark.parametrize("p", [0.3, 0.7])
def test_dropout_keeps_the_philox_mask_of_each_score_whatever_the_tiles(p, monkeypatch):
    """Uniform weights (q = 0) over one-hot values read the kept weights out of the output: exactly the Philox
    mask of each (example, head, query, key) position (tests/oracles.py, written from the paper), scaled by
    1 / (1 - p') with p' = round(p * 2**16) / 2**16; the same with other tile sizes; about p of them dropped.
    (p = 0.7: the kernel's 32-bit threshold is above 2**31, its bits an int32 below zero.)"""
    batch, lq, lk = 2, 37, 40
    q = torch.zeros(batch, H, lq, D)
    k = torch.randn(batch, H, lk, D)
    v = torch.eye(lk).expand(batch, H, lk, lk).contiguous()  # (B, H, Lk, dv = Lk): the output is the weights
    keep = philox_keep(seeded_call(11), batch, H, lq, lk, p)
    torch.manual_seed(11)
    with torch.no_grad():
        weights = run(None, q, k, v, dropout_p=p).cpu()  # (B, H, Lq, Lk)
    torch.testing.assert_close(weights.double(), keep.double() / lk / (1 - round(p * 65536) / 65536))
    monkeypatch.setattr(_triton, "INTERPRETER_BLOCKS", _triton._Blocks((32, 16, 1, 1), (16, 32, 1, 1), (32, 16, 1, 1)))
    torch.manual_seed(11)
    with torch.no_grad():
        assert torch.equal(run(None, q, k, v, dropout_p=p).cpu(), weights)
    assert abs(1 - keep.float().mean().item() - p) < 0.02  # 11,840 draws


@pytest.mark.parametrize("case", ["t5_causal_padded", "alibi_grouped", "cross_rows", "dkdv_dropout_tile",
                                  "left_padded", "alibi_left_padded_causal", "left_padded_mask_on_the_device",
                                  "batch_of_one_47", "batch_of_one_49", "an_all_padding_example"])
def test_dropout_forward_and_gradients_equal_the_oracle(case, monkeypatch):
    """With dropout, output and the gradients of q, k, v and the table equal fp64 autograd of the formula with
    the kernel's mask (tests/oracles.py philox_keep): the backward re-draws the forward's mask in both kernels;
    also with dk/dv on its own dropout tile (``_Blocks.dkdv_dropout``, 32 keys a block here against 16), and with
    left padding, where the forward's and dq's key blocks start at an example's first kept key (5 and 21 here: no
    multiple of 16, while dropout draws 16 x 16 squares), its mask read as key ranges or on the device (per key)."""
    launches = []
    if case == "dkdv_dropout_tile":
        monkeypatch.setattr(_triton, "INTERPRETER_BLOCKS", dataclasses.replace(_triton.INTERPRETER_BLOCKS,
                                                                               dkdv_dropout=(16, 32, 1, 1)))
        kernel_type = type(_triton._dkdv_kernel)
        real = kernel_type.__getitem__
        monkeypatch.setattr(kernel_type, "__getitem__",
                            lambda self, grid: (self is _triton._dkdv_kernel and launches.append(grid)) or real(self, grid))
    bias, batch, lq, lk, kv_heads, causal, q_offset = {
        "t5_causal_padded": (BIASES["t5"](), 2, 45, 45, H, True, 0),
        "dkdv_dropout_tile": (BIASES["t5"](), 2, 45, 45, H, True, 0),
        "alibi_grouped": (BIASES["alibi"](), 2, 33, 33, 2, True, 0),
        "cross_rows": (BIASES["clipped"](), 1, 20, 50, H, False, 0),
        "left_padded": (BIASES["t5"](), 2, 45, 45, H, False, 0),
        "left_padded_mask_on_the_device": (BIASES["t5"](), 2, 45, 45, H, True, 0),
        "batch_of_one_47": (BIASES["t5"](), 1, 47, 47, H, True, 0),
        "batch_of_one_49": (BIASES["t5"](), 1, 49, 49, H, False, 0),
        "an_all_padding_example": (BIASES["t5"](), 2, 33, 33, H, False, 0),
        "alibi_left_padded_causal": (BIASES["alibi"](), 2, 45, 45, 2, True, 0),
    }[case]
    q, k, v = qkv(batch, lq, lk, kv_heads=kv_heads)
    keep = torch.ones(batch, lk, dtype=torch.bool)
    keep[-1, 31:] = False  # the last example padded
    if "left_padded" in case:
        keep[0, :5] = False
        keep[-1, :21] = False
    if case == "an_all_padding_example":
        keep[0] = False
    if case == "left_padded_mask_on_the_device":
        from relpos.backends import dispatch

        monkeypatch.setattr(dispatch, "_DEVICE_KEY_MASKS", ("cuda", DEVICE))
    p = 0.25
    drop = philox_keep(seeded_call(5), batch, H, lq, lk, p)
    weights = torch.randn(batch, H, lq, D, generator=torch.Generator().manual_seed(1))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    slopes = bias._slopes if isinstance(bias, relpos.ALiBi) else None
    dense = bias_oracle(bias, lq, lk, q_offset, slopes=slopes, grad=True)
    want = attend(*exact, dense, causal=causal, keep=keep, q_offset=q_offset, drop=drop, p=p)
    (want * weights.double()).sum().backward()
    params = [p for p in bias.parameters() if p.requires_grad]
    want_grads = [t.grad for t in exact] + [t.grad.double() for t in params]
    no_drop = attend(*(t.detach() for t in exact), dense.detach(), causal=causal, keep=keep, q_offset=q_offset)
    assert_bias_matters(want, no_drop, 1e-4)  # the mask moves the output far beyond the tolerance
    bias.zero_grad()
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), causal=causal, key_mask=keep.to(DEVICE), q_offset=q_offset,
                           dropout_p=p, backend="triton")
    (out * weights.to(DEVICE)).sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    got = [t.grad for t in leaves] + [t.grad for t in params]
    assert len(got) == len(want_grads) >= 3
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)
    if case == "dkdv_dropout_tile":
        assert [grid[0] for grid in launches] == [2], launches  # ceil(45 / 32) key blocks: the dropout tile


@pytest.mark.parametrize("layout", ["holes", "holes_and_an_empty_example", "alternate", "loud_holes"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")  # loud_holes: their inf and NaN
def test_key_masks_with_holes_are_applied_per_key(layout, causal):
    """A key padding mask that is no run of kept keys (holes) goes to the kernel as a per-key -inf term on every
    tile's scores (no dense (B, H, Lq, Lk) mask): outputs and the gradients of q, k, v and the table against fp64
    autograd; a query row that sees no key gives 0 and no gradient. ``loud_holes``: the hidden keys' scores are
    thousands of times the others (dk/dv leaves hidden keys unmasked and zeroes their rows at the end: their
    overflowing weights must not reach any other key's gradient)."""
    batch, length = 3, 37
    keep = torch.ones(batch, length, dtype=torch.bool)
    keep[0, 5:9] = False
    keep[2, 20:] = False
    if layout == "holes_and_an_empty_example":
        keep[1] = False
    elif layout == "alternate":
        keep[1, ::2] = False
    else:
        keep[1, 30:33] = False
    bias = BIASES["t5"]()
    q, k, v = qkv(batch, length, length)
    if layout == "loud_holes":
        k = torch.where(keep[:, None, :, None], k, k * 1e4)  # (B, H, Lk, d): exp2 of their scores overflows fp32
    weights = torch.randn(batch, H, length, D, generator=torch.Generator().manual_seed(3))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = attend(*exact, bias_oracle(bias, length, length, grad=True), causal=causal, keep=keep)
    (want * weights.double()).sum().backward()
    want_grads = [t.grad for t in exact] + [bias.relative_attention_bias.weight.grad.double()]
    bias.zero_grad()
    from relpos.backends.dispatch import _prepare, _triton_unavailable

    call = _prepare(q, k, v, bias, causal, None, keep, 0.0, None, 0, backend="triton")
    assert call.ranges is None and call.key_mask is keep and _triton_unavailable(call) is None  # the per-key route
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), causal=causal, key_mask=keep.to(DEVICE), backend="triton")
    (out * weights.to(DEVICE)).sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    got = [t.grad for t in leaves] + [bias.relative_attention_bias.weight.grad]
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)
    contiguous = keep.clone()
    contiguous[0, 5:9] = True
    contiguous[1] = True
    with torch.no_grad():
        assert (run(bias, q, k, v, causal=causal, key_mask=contiguous).cpu().double() - want).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["right_and_left", "holes", "an_empty_example", "batch_of_one"])
@pytest.mark.parametrize("causal", [False, True])
def test_key_masks_on_a_gpu_are_read_on_the_device(layout, causal, monkeypatch):
    """On a CUDA GPU a key padding mask goes to the kernel without being read back to the CPU: per key, with
    each example's first and last kept key computed on the device to skip the blocks outside them (the same
    path, run here on CPU tensors by adding "cpu" to the devices that take it; key_ranges, the read-back,
    raises if called). Outputs and the gradients of q, k, v and the table against fp64."""
    from relpos.backends import dispatch

    monkeypatch.setattr(dispatch, "_DEVICE_KEY_MASKS", ("cuda", DEVICE))
    monkeypatch.setattr(dispatch, "key_ranges", lambda *a, **k: pytest.fail("the key mask was read back to the CPU"))
    batch, length = (1, 48) if layout == "batch_of_one" else (3, 45)
    keep = torch.ones(batch, length, dtype=torch.bool)
    if layout == "batch_of_one":
        keep[0, :16] = False  # left padding ending on a block boundary (three whole 16-key blocks)
    else:
        keep[0, 33:] = False  # right padding: key blocks past 33 skipped
        keep[2, :18] = False  # left padding: blocks before 16 skipped, the one across 18 masked per key
    if layout == "holes":
        keep[1, 7:12] = False
    elif layout == "an_empty_example":
        keep[1] = False
    bias = BIASES["t5"]()
    q, k, v = qkv(batch, length, length, seed=8)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = attend(*exact, bias_oracle(bias, length, length, grad=True), causal=causal, keep=keep)
    want.square().sum().backward()
    want_grads = [t.grad for t in exact] + [bias.relative_attention_bias.weight.grad.double()]
    bias.zero_grad()
    call = dispatch._prepare(q, k, v, bias, causal, None, keep, 0.0, None, 0, backend="triton")
    assert call.ranges is None and call.key_mask is keep and "read on the device" in call.dense_reason
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=bias.to(DEVICE), causal=causal, key_mask=keep.to(DEVICE), backend="triton")
    out.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), atol=2e-5, rtol=1e-5)
    got = [t.grad for t in leaves] + [bias.relative_attention_bias.weight.grad]
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)
    if causal:  # with no position term auto hands SDPA the mask whole (no per-example tiles, nothing read back)
        plain = dispatch._prepare(q, k, v, None, True, None, keep, 0.0, None, 0, backend="auto")
        assert plain.ranges is None and dispatch._choose(plain).backend == "sdpa"
        with torch.no_grad():
            got = relpos.attention(q, k, v, causal=True, key_mask=keep)
        torch.testing.assert_close(got.double(), attend(q, k, v, None, causal=True, keep=keep), atol=2e-5, rtol=1e-5)
    starts, ends = _triton._mask_bounds(keep)
    expected_bounds = {"an_empty_example": ([0, 45, 18], [33, 0, 45]), "batch_of_one": ([16], [48])}.get(
        layout, ([0, 0, 18], [33, 45, 45]))
    assert (starts.tolist(), ends.tolist()) == expected_bounds


def test_layers_sharing_a_key_mask_build_its_terms_once(monkeypatch):
    """A model's layers pass one padding mask per forward: the kernel's per-key terms and each example's first and
    last kept key are built by the first layer's call and reused by the next (no operator on the mask); the mask
    changed in place is read again. Outputs against fp64 every time."""
    from operators import dispatched

    from relpos.backends import dispatch

    monkeypatch.setattr(dispatch, "_DEVICE_KEY_MASKS", ("cuda", DEVICE))
    bias = BIASES["t5"]().requires_grad_(False)
    q, k, v = qkv(2, 21, 21, seed=3)
    keep = right_and_left_padded(21, 15, 4)
    values = bias.offsets(21, 21)

    def layer():
        with torch.no_grad():
            return relpos.attention(q, k, v, bias=values, key_mask=keep, backend="triton")

    first = layer()
    ops = dispatched(layer)
    assert not any(name.startswith(("amin", "amax", "masked_fill")) for name in ops), ops
    assert torch.equal(first, layer())
    torch.testing.assert_close(first.double(), expected(bias, q, k, v, causal=False, keep=keep), rtol=1e-4, atol=1e-5)
    keep[1, :4] = True  # in place: read again
    torch.testing.assert_close(layer().double(), expected(bias, q, k, v, causal=False, keep=keep), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_under_torch_compile_the_kernel_is_an_opaque_op_with_its_gradients(compiler):
    """Under torch.compile (fullgraph) the kernels run as relpos's custom ops: a padding mask is a per-key term
    (no data-dependent key ranges), outputs and the gradients of q, k, v and the table equal the eager kernel's;
    another mask of the same shape runs the same graph (no recompilation)."""
    bias = BIASES["t5"]()
    q, k, v = qkv(2, 40, 40)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1, 29:] = False
    keep[0, 3:6] = False  # a hole

    def step(q, k, v, keep):
        out = relpos.attention(q, k, v, bias=bias, causal=True, key_mask=keep, backend="triton")
        return out.square().sum()

    results = []
    for run_step in (step, torch.compile(step, backend=compiler, fullgraph=True)):
        bias.zero_grad()
        leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
        loss = run_step(*leaves, keep.to(DEVICE))
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves] + [bias.relative_attention_bias.weight.grad.clone()])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):  # dynamo's graph, then the chosen compiler
        graphs.append(str(gm.graph))
        return torch._dynamo.lookup_backend(compiler)(gm, example_inputs)

    compiled = torch.compile(step, backend=recording, fullgraph=True)
    compiled(q, k, v, keep)
    assert len(graphs) == 1 and "relpos.triton_attention_fwd" in graphs[0]  # one graph, the kernel inside it
    with torch.compiler.set_stance("fail_on_recompile"):
        other = keep.clone()
        other[0] = True
        torch.testing.assert_close(compiled(q, k, v, other), step(q, k, v, other), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_dropout_under_torch_compile():
    """Dropout in the compiled kernel: its seed is a device tensor drawn inside the graph. With aot_eager (which
    draws it as eager does) outputs and gradients equal the eager kernel's under the same torch.manual_seed; with
    inductor (its own random stream) the kept weights, read out through q = 0 and one-hot values, are exactly
    0 or 1 / (Lk (1 - p')) with about 1 - p of them kept, and two calls draw different masks."""
    bias = BIASES["t5"]()
    q, k, v = qkv(2, 40, 40)
    p = 0.3

    def step(q, k, v):
        return relpos.attention(q, k, v, bias=bias, causal=True, dropout_p=p, backend="triton")

    results = []
    for run_step in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        bias.zero_grad()
        leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(4)
        out = run_step(*leaves)
        out.square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves] + [bias.relative_attention_bias.weight.grad.clone()])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()

    lk = 48
    zeros, keys = torch.zeros(2, H, 32, D), torch.randn(2, H, lk, D)
    eye = torch.eye(lk).expand(2, H, lk, lk).contiguous()  # (B, H, Lk, Lk): the output is the weights
    compiled = torch.compile(lambda q, k, v: relpos.attention(q, k, v, dropout_p=p, backend="triton"),  # uniform weights
                             backend="inductor", fullgraph=True)
    with torch.no_grad():
        first, second = compiled(zeros, keys, eye), compiled(zeros, keys, eye)
    kept = 1 / (lk * (1 - round(p * 65536) / 65536))
    for weights in (first, second):
        assert torch.isclose(weights, torch.zeros(()), atol=1e-7).logical_or(torch.isclose(weights, torch.tensor(kept))).all()
        assert abs((weights > 0).float().mean().item() - (1 - p)) < 0.03  # 24,576 weights
    assert not torch.equal(first, second)
    torch._dynamo.reset()


# ------------------------------------------------------------------ a real-valued term per key (key_bias_attention)
KEY_BIAS_MASKS = {
    "none": None,
    "holes": lambda b, lk: (torch.arange(lk)[None, :] % 7 != 3) & (torch.arange(b)[:, None] >= 0),
    "left_and_holes": lambda b, lk: torch.stack([torch.arange(lk) >= 9, (torch.arange(lk) % 5 != 1) & (torch.arange(lk) < lk - 6)]),
}


@pytest.mark.parametrize("shape", ["per_head", "shared_by_heads", "shared_by_batch"])
@pytest.mark.parametrize("mask", sorted(KEY_BIAS_MASKS))
def test_key_bias_forward_and_gradients_equal_the_fp64_oracle(shape, mask):
    """key_bias_attention (Bloom's and Falcon's per-key ALiBi on the GPU): softmax(q k^T s + b[b, h, j] + mask) v,
    causal, every gradient into q, k and v against fp64 attention with the term written out; dk and dv add the term
    too (a mask alone is zeroed in dk/dv, a real term is not). The term moves the output far beyond the tolerance."""
    from relpos.backends.dispatch import key_bias_attention

    batch, length = 2, 45
    q, k, v = (t.to(DEVICE).requires_grad_() for t in qkv(batch, length, length, kv_heads=2))  # grouped heads
    sizes = {"per_head": (batch, H), "shared_by_heads": (batch, 1), "shared_by_batch": (1, H)}[shape]
    term = torch.randn(*sizes, length, generator=torch.Generator().manual_seed(3)) * 3
    keep = None if KEY_BIAS_MASKS[mask] is None else KEY_BIAS_MASKS[mask](batch, length).to(DEVICE)
    out = key_bias_attention(q, k, v, key_bias=term.to(DEVICE), key_mask=keep, causal=True)
    cpu = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want = attend(*cpu, term.double()[:, :, None, :].expand(batch, H, length, length), causal=True,
                  keep=None if keep is None else keep.cpu())
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=1e-5)
    assert_bias_matters(out.cpu().double(), attend(*cpu, causal=True, keep=None if keep is None else keep.cpu()), 2e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, cpu, grad.cpu().double())
    for name, g, e in zip("qkv", got, expected):
        torch.testing.assert_close(g.cpu().double(), e, atol=5e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("batch,lq,lk,q_offset,empty", [
    (1, 16, 16, 0, False), (1, 17, 17, 0, False), (1, 15, 15, 0, False),  # one example; a block's length +-1
    (3, 31, 31, 0, True),  # an example with no real key (its rows: zeros, no gradient)
    (2, 20, 33, 13, False),  # Lq != Lk: the queries the last 20 of 33 keys
])
def test_key_bias_shapes_users_send(batch, lq, lk, q_offset, empty):
    """Batch size 1, lengths at a tile's boundary (the interpreter's 16-key tiles) and one past it, an all-padding
    example, Lq != Lk: forward and every gradient equal the fp64 oracle."""
    from relpos.backends.dispatch import key_bias_attention

    q, k, v = (t.to(DEVICE).requires_grad_() for t in qkv(batch, lq, lk))
    term = torch.randn(batch, H, lk, generator=torch.Generator().manual_seed(6)) * 3
    keep = torch.ones(batch, lk, dtype=torch.bool)
    keep[0, :2] = False  # left padding
    if empty:
        keep[-1] = False
    out = key_bias_attention(q, k, v, key_bias=term.to(DEVICE), key_mask=keep.to(DEVICE), causal=True, q_offset=q_offset)
    cpu = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want = attend(*cpu, term.double()[:, :, None, :].expand(batch, H, lq, lk), causal=True, keep=keep, q_offset=q_offset)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=1e-5)
    if empty:
        assert out[-1].abs().max() == 0
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    for name, g, e in zip("qkv", torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, cpu, grad.cpu().double())):
        torch.testing.assert_close(g.cpu().double(), e, atol=5e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_ON_GPU), torch.float16])
def test_key_bias_decoding_rows_in_low_precision(dtype):
    """A few query rows at the end of the keys (q_offset, not causal past their position) and 16-bit inputs within
    their rounding of the fp64 oracle on the same rounded inputs."""
    from relpos.backends.dispatch import key_bias_attention

    q, k, v = (t.to(DEVICE, dtype) for t in qkv(2, 3, 70))
    term = (torch.randn(2, H, 70, generator=torch.Generator().manual_seed(5)) * 3).to(DEVICE)
    keep = (torch.arange(70)[None, :] >= torch.tensor([[0], [11]])).to(DEVICE)  # left padding on the second
    out = key_bias_attention(q, k, v, key_bias=term, key_mask=keep, causal=True, q_offset=67)
    want = attend(*(t.cpu() for t in (q, k, v)), term.cpu().double()[:, :, None, :].expand(2, H, 3, 70), causal=True,
                  keep=keep.cpu(), q_offset=67)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-2, rtol=2e-2)


def test_key_bias_refuses_bad_inputs_before_any_launch():
    from relpos.backends.dispatch import key_bias_attention

    q, k, v = (t.to(DEVICE) for t in qkv(2, 8, 8))
    good = torch.zeros(2, H, 8, device=DEVICE)
    cases = [
        (dict(key_bias=torch.zeros(2, H, 7, device=DEVICE)), ValueError, r"key_bias must be a floating \(B\|1, H\|1, Lk\)"),
        (dict(key_bias=torch.zeros(2, H, 8, dtype=torch.long, device=DEVICE)), ValueError, "torch.int64"),
        (dict(key_bias=[0.0] * 8), TypeError, "key_bias must be a torch.Tensor"),
        (dict(key_bias=good.clone().requires_grad_()), ValueError, "key_bias gets no gradient here"),
        (dict(key_bias=good, key_mask=torch.ones(2, 8, device=DEVICE)), TypeError, "key_mask must be boolean"),
        (dict(key_bias=good, dropout_p=1.5), ValueError, "dropout_p"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            key_bias_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="the Triton kernel takes float16, bfloat16 or float32, got torch.float64"):
        key_bias_attention(q.double(), k.double(), v.double(), key_bias=good)
