"""The Triton kernel at real sizes on a CUDA GPU (its real 128-row tiles, flat ranges, causal diagonals).

CI has no GPU: these carry the ``gpu`` marker and skip without CUDA; tests/backends/test_triton.py runs the
same kernel under Triton's interpreter in CI. Run with ``PYTHONPATH=src:tests python -m pytest -m gpu``.
"""

import pytest
import torch

import relpos
from oracles import attend, bias_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")

H, D = 4, 64


def strong_t5(bidirectional=True):
    torch.manual_seed(3)
    bias = relpos.T5RelativeBias(H, num_buckets=32, max_distance=128, bidirectional=bidirectional)
    with torch.no_grad():
        bias.relative_attention_bias.weight.normal_(0.0, 1.0)
    return bias


def inputs(batch, lq, lk, kv_heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, n, D, generator=g) for h, n in ((H, lq), (kv_heads, lk), (kv_heads, lk))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_fp32_outputs_and_every_gradient_at_real_size(causal, padded):
    """L = 1000 (no multiple of the tiles), T5 beyond max_distance (flat tiles), against fp64 autograd."""
    batch, length = 2, 1000
    bias = strong_t5(bidirectional=not causal)
    q, k, v = inputs(batch, length, length)
    keep = None
    if padded:
        keep = torch.ones(batch, length, dtype=torch.bool)
        keep[1, 611:] = False
    weights = torch.randn(batch, H, length, D, generator=torch.Generator().manual_seed(5))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = attend(*exact, bias_oracle(bias, length, length, grad=True), causal=causal, keep=keep)
    (want * weights.double()).sum().backward()
    want_grads = [t.grad for t in exact] + [bias.relative_attention_bias.weight.grad.double()]
    ours = strong_t5(bidirectional=not causal).cuda()
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    out = relpos.attention(*leaves, bias=ours, causal=causal, key_mask=None if keep is None else keep.cuda(),
                           backend="triton")
    (out * weights.cuda()).sum().backward()
    assert (out.detach().cpu().double() - want.detach()).abs().max() < 2e-4
    got = [t.grad for t in leaves] + [ours.relative_attention_bias.weight.grad]
    for name, a, b in zip(("q", "k", "v", "table"), got, want_grads):
        assert (a.cpu().double() - b).abs().max() <= 1e-4 * max(1.0, float(b.abs().max())), name


@pytest.mark.parametrize("name", ["t5", "alibi", "kerple"])
def test_bf16_within_twice_sdpa_own_error(name):
    """bf16 at L = 2048, causal: the kernel errs at most twice what SDPA errs given the exact dense bias."""
    bias = {"t5": lambda: strong_t5(False), "alibi": lambda: relpos.ALiBi(H),
            "kerple": lambda: relpos.KerpleBias(H, r1=[1.0, 2.0, 0.5, 1.5])}[name]()
    q, k, v = inputs(1, 2048, 2048, seed=1)
    dense = bias_oracle(bias, 2048, 2048)  # (1, H, L, L) fp64
    want = attend(q, k, v, dense, causal=True)
    low = [t.cuda().bfloat16() for t in (q, k, v)]
    future = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    with torch.no_grad():
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *low, attn_mask=dense.masked_fill(future, float("-inf")).cuda().bfloat16())
        ours = relpos.attention(*low, bias=bias.cuda(), causal=True, backend="triton")
    their_error = float((theirs.cpu().double() - want).abs().max())
    our_error = float((ours.cpu().double() - want).abs().max())
    assert our_error <= 2 * their_error + 1e-3, (our_error, their_error)


def test_decode_rows_and_grouped_heads_at_real_size():
    bias = strong_t5(False).cuda()
    q, k, v = inputs(2, 3, 3000, kv_heads=2)
    with torch.no_grad():
        out = relpos.attention(*(t.cuda() for t in (q, k, v)), bias=bias, causal=True, q_offset=2997, backend="triton")
    want = attend(q, k, v, bias_oracle(bias.cpu(), 3, 3000, 2997), causal=True, q_offset=2997)
    assert (out.cpu().double() - want).abs().max() < 2e-4


def test_a_padded_training_step_never_waits_for_the_gpu():
    """A padded batch through ``auto`` (the kernel), forward and backward, under torch's sync debug mode "error":
    no operation reads a tensor back to the CPU (the key mask stays on the device; before, its runs were read
    back twice per call, and the model benchmarks' layers waited for the GPU each time)."""
    bias = strong_t5().cuda()
    q, k, v = (t.cuda().requires_grad_() for t in inputs(2, 2048, 2048))
    keep = torch.ones(2, 2048, dtype=torch.bool, device="cuda")
    keep[1, 1500:] = False
    relpos.attention(q, k, v, bias=bias, causal=True, key_mask=keep).sum().backward()  # compile and cache first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        relpos.attention(q, k, v, bias=bias, causal=True, key_mask=keep).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_training_a_table_holds_no_dense_scores():
    """B = 1, H = 8, L = 8192, bf16: one (B, H, L, L) tensor is 1024 MiB; the step's peak stays far below it."""
    bias = relpos.T5RelativeBias(8).cuda()
    q, k, v = (torch.randn(1, 8, 8192, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    relpos.attention(q, k, v, bias=bias, backend="triton").float().sum().backward()  # compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    relpos.attention(q, k, v, bias=bias, backend="triton").float().sum().backward()
    torch.cuda.synchronize()
    assert (torch.cuda.max_memory_allocated() - base) / 2**20 < 1024 / 8


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_outputs_and_gradients_at_real_size(causal):
    """Dropout 0.1 at L = 700 with the kernel's real tiles: the mask is Philox at each score's position
    (tests/oracles.py philox_keep), outputs and gradients (the table's included) against fp64 autograd."""
    from oracles import philox_keep
    from relpos.backends._dropout import draw_seed_tensor

    batch, length, p = 2, 700, 0.1
    bias = strong_t5(bidirectional=not causal)
    q, k, v = inputs(batch, length, length)
    torch.manual_seed(9)
    drop = philox_keep(int(draw_seed_tensor("cuda").item()), batch, H, length, length, p)  # the kernel's draw
    weights = torch.randn(batch, H, length, D, generator=torch.Generator().manual_seed(5))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = attend(*exact, bias_oracle(bias, length, length, grad=True), causal=causal, drop=drop, p=p)
    (want * weights.double()).sum().backward()
    want_grads = [t.grad for t in exact] + [bias.relative_attention_bias.weight.grad.double()]
    ours = strong_t5(bidirectional=not causal).cuda()
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(9)
    out = relpos.attention(*leaves, bias=ours, causal=causal, dropout_p=p, backend="triton")
    (out * weights.cuda()).sum().backward()
    assert (out.detach().cpu().double() - want.detach()).abs().max() < 2e-4
    got = [t.grad for t in leaves] + [ours.relative_attention_bias.weight.grad]
    for name, a, b in zip(("q", "k", "v", "table"), got, want_grads):
        assert (a.cpu().double() - b).abs().max() <= 1e-4 * max(1.0, float(b.abs().max())), name


def test_compiled_with_cuda_graphs_equals_eager():
    """torch.compile(mode="reduce-overhead", fullgraph) around a T5 attention with a padding mask with a hole: the
    kernel runs as relpos's custom ops under CUDA graphs; outputs and gradients (q, k, v, table) equal the eager
    kernel's, and a second mask of the same shape reuses the graph."""
    batch, length = 2, 1000
    keep = torch.ones(batch, length, dtype=torch.bool, device="cuda")
    keep[1, 611:] = False
    keep[0, 100:140] = False
    ours = strong_t5().cuda()

    def step(q, k, v, keep):
        out = relpos.attention(q, k, v, bias=ours, key_mask=keep)  # auto: the kernel on CUDA
        return out.float().square().sum()

    q, k, v = (t.cuda() for t in inputs(batch, length, length))
    results = []
    for run_step in (step, torch.compile(step, mode="reduce-overhead", fullgraph=True)):
        for _ in range(3):  # CUDA graphs record on a later call
            ours.zero_grad()
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            loss = run_step(*leaves, keep)
            loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves] + [ours.relative_attention_bias.weight.grad.clone()])
    for eager, compiled in zip(*results):
        assert (compiled - eager).abs().max() <= 1e-4 * max(1.0, float(eager.abs().max()))
    torch._dynamo.reset()


# --- decomposed 2D positions (SAM, ViTDet) in their own kernel: relpos.backends._triton_decomposed ---


def _decomposed_inputs(grid, heads, dtype, seed=0):
    from relpos.encodings.decomposed import decomposed_terms

    g = torch.Generator().manual_seed(seed)
    n = grid[0] * grid[1]
    q, k, v = (torch.randn(1, heads, n, D, generator=g) for _ in range(3))
    tables = [torch.randn(2 * s - 1, D, generator=g) * 0.2 for s in grid]
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v, *tables)]
    return leaves, decomposed_terms(leaves[0], leaves[3], leaves[4], grid)


def test_decomposed_fp32_outputs_and_every_gradient_at_real_size():
    """A 40 x 40 grid (rows of 40 keys: a partial column block), fp32 against the dense reference on the GPU."""
    from relpos.encodings.decomposed import decomposed_attention

    results = {}
    for impl in ("reference", "triton"):
        leaves, (rel_h, rel_w) = _decomposed_inputs((40, 40), H, torch.float32)
        out = decomposed_attention(*leaves[:3], rel_h, rel_w, impl=impl)
        weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
        results[impl] = (out.detach(), torch.autograd.grad((out * weights).sum(), leaves))
    (ref, ref_grads), (out, grads) = results["reference"], results["triton"]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_decomposed_bf16_at_sam_size_within_twice_the_fold_error():
    """SAM ViT-B's global layer: 64 x 64 tokens, head dim 64, bf16; against the fp32 reference of the same inputs."""
    from relpos.encodings.decomposed import decomposed_attention

    leaves, (rel_h, rel_w) = _decomposed_inputs((64, 64), H, torch.bfloat16)
    with torch.no_grad():
        wide = [t.float() for t in (*leaves[:3], rel_h, rel_w)]
        exact = decomposed_attention(*wide, impl="reference")
        fold = decomposed_attention(*leaves[:3], rel_h, rel_w, impl="fold").float()
        ours = decomposed_attention(*leaves[:3], rel_h, rel_w, impl="triton").float()
    assert torch.isfinite(ours).all()
    assert (ours - exact).abs().max() <= 2 * (fold - exact).abs().max() + 1e-3
