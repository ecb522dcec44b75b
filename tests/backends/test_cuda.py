"""relpos attention on a CUDA GPU, against the fp64 oracle on CPU: every backend, dtype and real input.

CI has no GPU: every test here carries the ``gpu`` marker and skips without CUDA (tests/conftest.py
lets exactly those skip under CI=true). docs/testing.md says how to run them and which GPU ran them
last. The sizes reach past 2**21 scores, where relpos cuts padded and causal calls into tiles.
"""

import copy

import pytest
import torch

import relpos
from oracles import attend, bias_oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = "cuda"
HEADS, DIM = 4, 64


def strong_t5(num_heads=HEADS, bidirectional=True):
    """A T5 bias whose table is drawn with std 1 (T5's init is tiny: the bias would not matter)."""
    torch.manual_seed(3)
    bias = relpos.RelativePositionalBias(num_heads, num_buckets=16, max_distance=64, bidirectional=bidirectional)
    with torch.no_grad():
        bias.relative_attention_bias.weight.normal_(0.0, 1.0)
    return bias


BIASES = {
    "t5": strong_t5,
    "alibi": lambda: relpos.ALiBi(HEADS, mode="symmetric"),
    "log_decay": lambda: relpos.LogDecayBias(0.5, num_heads=HEADS),
}
SHAPES = {  # (B, Lq, Lk, causal, q_offset, padded): one SDPA call below 2**21 scores, tiles above
    "small": (2, 40, 40, False, 0, False),
    "small_causal_padded": (2, 40, 40, True, 0, True),
    "tiles_padded": (2, 768, 768, False, 0, True),
    "tiles_causal": (2, 768, 768, True, 0, False),
    "tiles_causal_padded": (2, 768, 768, True, 0, True),
    "decode_row": (2, 1, 768, True, 767, True),
    "ragged_causal_padded": (3, 300, 300, True, 0, True),  # blocks of 128 end inside the sequence
}


def padding(batch, length):
    """(B, Lk) real keys: example 0 full, example 1 right-padded to 60%, a third left-padded by 10%."""
    keep = torch.ones(batch, length, dtype=torch.bool)
    keep[1, int(length * 0.6):] = False
    if batch > 2:
        keep[2, : length // 10] = False
    return keep


def inputs(batch, lq, lk, *, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, HEADS, n, DIM, generator=g).to(dtype) for n in (lq, lk, lk)]  # (B, H, L, d), CPU


def reference(bias, q, k, v, *, causal, q_offset, keep):
    """fp64 attention on CPU with the bias rebuilt from its formula (never from the path under test)."""
    lq, lk = q.shape[2], k.shape[2]
    return attend(q, k, v, bias_oracle(bias, lq, lk, q_offset), causal=causal, keep=keep, q_offset=q_offset,
                  scale=DIM**-0.5)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex", "eager", "triton"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", sorted(BIASES))
def test_fp32_on_cuda_equals_the_fp64_oracle(name, shape, backend):
    batch, lq, lk, causal, q_offset, padded = SHAPES[shape]
    bias = BIASES[name]()
    q, k, v = inputs(batch, lq, lk)
    keep = padding(batch, lk) if padded else None
    expected = reference(bias, q, k, v, causal=causal, q_offset=q_offset, keep=keep)
    with torch.no_grad():
        out = relpos.attention(*(t.to(CUDA) for t in (q, k, v)), bias=copy.deepcopy(bias).to(CUDA), causal=causal,
                               q_offset=q_offset, key_mask=None if keep is None else keep.to(CUDA), backend=backend)
    assert out.device.type == "cuda" and out.dtype == torch.float32
    error = (out.cpu().double() - expected).abs().max().item()
    assert error < 2e-4, error
    plain = attend(q, k, v, causal=causal, keep=keep, q_offset=q_offset, scale=DIM**-0.5)
    assert (plain - expected).abs().max() > 0.05  # the position term moves the output far beyond the tolerance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["small_causal_padded", "tiles_causal_padded", "tiles_padded", "decode_row"])
def test_low_precision_within_twice_sdpa_own_error(shape, dtype):
    """relpos in bf16/fp16 errs at most 2x as much as SDPA in the same dtype given the exact dense bias."""
    batch, lq, lk, causal, q_offset, padded = SHAPES[shape]
    bias = strong_t5()
    q, k, v = inputs(batch, lq, lk)
    keep = padding(batch, lk) if padded else None
    expected = reference(bias, q, k, v, causal=causal, q_offset=q_offset, keep=keep)
    low = [t.to(CUDA, dtype) for t in (q, k, v)]
    dense = bias_oracle(bias, lq, lk, q_offset).expand(batch, -1, -1, -1).clone()  # (B, H, Lq, Lk) fp64
    allowed = torch.ones(batch, 1, lq, lk, dtype=torch.bool)
    if causal:
        allowed &= (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + q_offset)
    if keep is not None:
        allowed &= keep[:, None, None, :]
    dense = dense.masked_fill(~allowed, float("-inf")).to(CUDA, dtype)
    with torch.no_grad():
        theirs = torch.nn.functional.scaled_dot_product_attention(*low, attn_mask=dense)
        ours = relpos.attention(*low, bias=bias.to(CUDA), causal=causal, q_offset=q_offset,
                                key_mask=None if keep is None else keep.to(CUDA))
    assert ours.dtype == dtype
    real = torch.isfinite(theirs.cpu()).all(-1) if keep is not None else slice(None)  # rows SDPA fills with NaN
    their_error = (theirs.cpu().double() - expected)[real].abs().max().item()
    our_error = (ours.cpu().double() - expected)[real].abs().max().item()
    assert our_error <= 2 * their_error + 1e-3, (our_error, their_error)


@pytest.mark.parametrize("backend", ["auto", "flex", "sdpa", "triton"])
@pytest.mark.parametrize("shape", ["small_causal_padded", "tiles_causal_padded", "tiles_padded"])
def test_gradients_into_qkv_and_the_table_on_cuda(shape, backend):
    """Training a learnable T5 table on CUDA (auto takes triton): every gradient equals the fp64 oracle's."""
    batch, lq, lk, causal, q_offset, padded = SHAPES[shape]
    bias = strong_t5()
    q, k, v = inputs(batch, lq, lk)
    keep = padding(batch, lk) if padded else None
    weights = torch.randn(batch, HEADS, lq, DIM, generator=torch.Generator().manual_seed(5))  # (B, H, Lq, d)

    exact = [t.double().requires_grad_() for t in (q, k, v)]
    table = bias.relative_attention_bias.weight
    out = attend(*exact, bias_oracle(bias, lq, lk, q_offset, grad=True), causal=causal, keep=keep,
                 q_offset=q_offset, scale=DIM**-0.5)
    (out * weights.double()).sum().backward()
    expected = [t.grad for t in exact] + [table.grad.double()]

    ours = copy.deepcopy(bias).to(CUDA)
    ours.zero_grad()
    cuda = [t.to(CUDA).requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*cuda, bias=ours, causal=causal, q_offset=q_offset,
                           key_mask=None if keep is None else keep.to(CUDA), backend=backend)
    (out * weights.to(CUDA)).sum().backward()
    got = [t.grad for t in cuda] + [ours.relative_attention_bias.weight.grad]
    for name, a, b in zip(("q", "k", "v", "table"), got, expected):
        assert a is not None, name
        scale = b.abs().max().item()
        assert (a.cpu().double() - b).abs().max().item() <= 1e-4 * max(scale, 1.0), name
    assert expected[3].abs().max() > 1e-2  # the table's gradient is not trivially zero


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["forward", "forward_padded", "forward_causal", "train_padded", "train_causal"])
def test_no_dense_scores_on_cuda(mode, dtype):
    """B=1, H=8, L=8192: one (B, H, L, L) tensor is 1024 MiB in bf16; relpos's peak stays under 1/8 of that.

    ``forward``: a frozen bias; ``train``: a learnable table (auto takes the Triton kernel for both)."""
    batch, heads, length = 1, 8, 8192
    dense_mib = batch * heads * length * length * 2 / 2**20
    bias = relpos.RelativePositionalBias(heads, bidirectional=not mode.endswith("causal")).to(CUDA)
    train = mode.startswith("train")
    bias.requires_grad_(train)
    q, k, v = (torch.randn(batch, heads, length, DIM, device=CUDA, dtype=dtype, requires_grad=train)
               for _ in range(3))
    keep = padding(batch + 1, length)[1:].to(CUDA) if mode.endswith("padded") else None  # right-padded to 60%

    def run():
        out = relpos.attention(q, k, v, bias=bias, causal=mode.endswith("causal"), key_mask=keep)
        if train:
            out.float().square().sum().backward()

    run()  # compile (flex) and warm up
    peak = _peak_mib(run)
    assert peak < dense_mib / 8, f"{mode}: peak {peak:.0f} MiB against {dense_mib:.0f} MiB for one dense bias"


def test_dropout_on_cuda_averages_to_the_undropped_output():
    """Attention dropout on CUDA: each call differs, the mean of many calls approaches the plain output."""
    bias = strong_t5().to(CUDA)
    q, k, v = (t.to(CUDA) for t in inputs(1, 64, 64))
    keep = padding(2, 64)[1:].to(CUDA)
    with torch.no_grad():
        plain = relpos.attention(q, k, v, bias=bias, key_mask=keep)
        draws = torch.stack([relpos.attention(q, k, v, bias=bias, key_mask=keep, dropout_p=0.2) for _ in range(400)])
    assert (draws[0] - draws[1]).abs().max() > 0.1
    assert (draws[0] - plain).abs().max() > 0.1
    assert (draws.mean(0) - plain).abs().max() < 0.15  # a 400-draw mean: its noise is about 0.05 here
    assert (draws.mean(0) - plain).abs().mean() < 0.03


@pytest.mark.parametrize("dtype,grad,dim,expected", [
    (torch.bfloat16, False, 64, "triton"),  # the position term inside each tile (docs/benchmarks/gpu/kernel.md)
    (torch.float32, False, 64, "triton"),
    (torch.bfloat16, True, 64, "triton"),  # a learnable table
    (torch.bfloat16, True, 8, "triton"),  # the kernel pads head dims below 16 (flex cannot)
])
def test_auto_on_cuda_says_what_it_picks(dtype, grad, dim, expected):
    bias = strong_t5().to(CUDA).requires_grad_(grad)
    q, k, v = (torch.randn(2, HEADS, 1024, dim, device=CUDA, dtype=dtype) for _ in range(3))
    choice = relpos.select_backend(q, k, v, bias=bias)
    assert choice.backend == expected, str(choice)
    if dim < 16:
        assert "at least 16" in choice.rejected["flex"]
    small = relpos.select_backend(*(t[:, :, :64] for t in (q, k, v)), bias=bias)
    assert small.backend == "sdpa"  # below 2**21 scores: one SDPA call, no per-shape compile


@pytest.mark.parametrize("case", ["decode_row", "small_padded"])
def test_small_padded_calls_never_wait_for_the_gpu(case):
    """A decoding row over a padded cache and a small padded batch (one SDPA call with a dense mask) under torch's
    sync debug mode "error": nothing is read back to the CPU (before, whether a row saw no key was checked on the
    CPU every call, which on the H100 made each decoding step's attention wait for the GPU)."""
    batch, query_length, key_length, q_offset = (2, 1, 300, 299) if case == "decode_row" else (2, 40, 40, 0)
    bias = strong_t5(bidirectional=False).to(CUDA)
    q = torch.randn(batch, HEADS, query_length, DIM, device=CUDA)
    k, v = (torch.randn(batch, HEADS, key_length, DIM, device=CUDA) for _ in range(2))
    keep = torch.ones(batch, key_length, dtype=torch.bool, device=CUDA)
    keep[1, :7] = False  # left padding
    call = dict(bias=bias, causal=True, key_mask=keep, q_offset=q_offset)
    with torch.no_grad():
        want = relpos.attention(q, k, v, **call)  # warm up (caches, kernels)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = relpos.attention(q, k, v, **call)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, want)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_a_captured_cuda_graph_follows_its_inputs_whatever_relpos_kept(backend):
    """What relpos keeps between calls (ALiBi's last offsets, T5's buckets, the kernel's padded values) is neither
    read nor kept while a CUDA graph is captured (relpos._reuse.may_reuse): after the warm-up calls that fill those
    memos, a captured call replays with slopes and a table changed in place and equals a fresh call."""
    torch.manual_seed(0)
    alibi, t5 = relpos.ALiBi(HEADS, mode="symmetric").to(CUDA), strong_t5().to(CUDA)
    q, k, v = (torch.randn(1, HEADS, 256, DIM, device=CUDA, dtype=torch.bfloat16) for _ in range(3))

    def layer():
        return relpos.attention(relpos.attention(q, k, v, bias=alibi, backend=backend), k, v, bias=t5, backend=backend)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = layer()
    before = out.clone()
    with torch.no_grad():
        alibi.slopes.mul_(4.0)
        t5.relative_attention_bias.weight.mul_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        fresh = layer()
    torch.testing.assert_close(out, fresh, rtol=1e-2, atol=1e-2)
    assert (out.float() - before.float()).abs().max() > 0.1  # the changes moved the output


def test_profile_call_on_a_gpu_counts_host_syncs_and_attention_kernels():
    """On CUDA: one .item() per call is one sync per call (the profile's closing synchronize not counted), and
    SDPA's kernel is counted as attention, the matrix product beside it is not."""
    from relpos._measure import profile_call

    q = torch.randn(2, 4, 1024, 64, device=CUDA, dtype=torch.bfloat16)
    m = torch.randn(2048, 2048, device=CUDA)

    def work():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        (m @ m).sum().item()

    p = profile_call(work, cuda=True, calls=3)
    assert p["syncs_per_call"] == 1.0, p
    assert 0 < p["attention_ms"] < p["busy_ms"] <= p["wall_ms"], p
