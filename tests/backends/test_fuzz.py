"""Differential fuzzing of ``relpos.attention`` on every backend against naive fp64 attention from the formulas.

Hypothesis draws the shapes users send and the suite's fixed cases miss: batch 1-3, query and key lengths
from 1, primes and the tile / chunk / size-threshold boundaries plus and minus one, ``Lq != Lk`` (decoding
rows, cross attention), grouped key/value heads, causal or not, every mask layout (none, all real, one
real token, every example padded alike, an all-padding example, left, right, holes), every bias family,
fp32 and bf16, with and without gradients. A crash fails; a refusal is allowed only for an explicit
backend that cannot run the call, and must name the fix.

Profiles: ``ci`` (the default, within the suite's budget) and ``long`` (``RELPOS_FUZZ=long``, at least
5,000 examples over the entry points; docs/testing.md says how to run it).
"""

import importlib.util
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import relpos
from relpos.backends import _tiles
from relpos.backends.dispatch import _FUSED_MIN_SCORES

from fuzz_profiles import examples
from oracles import attend, bias_oracle

CHUNK = _tiles.CAUSAL_CHUNK
LENGTHS = sorted({1, 2, 3, 5, 7, 13, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, CHUNK - 1, CHUNK, CHUNK + 1})
BIASES = ("none", "t5", "t5_causal_buckets", "clipped", "alibi", "alibi_symmetric", "kerple", "log_decay", "dense")
MASKS = ("none", "all_real", "one_real", "alike", "all_padding_example", "right", "left", "holes")


def _bias(name: str, heads: int, seed: int):
    torch.manual_seed(seed)
    if name == "none":
        return None
    if name in ("t5", "t5_causal_buckets"):
        bias = relpos.T5RelativeBias(heads, num_buckets=8, max_distance=16, bidirectional=name == "t5")
    elif name == "clipped":
        bias = relpos.ClippedRelativeBias(heads, max_distance=6)
    elif name == "alibi":
        return relpos.ALiBi(heads)
    elif name == "alibi_symmetric":
        return relpos.ALiBi(heads, mode="symmetric")
    elif name == "kerple":
        return relpos.KerpleBias(heads, r1=[0.5 + h for h in range(heads)], r2=[0.3 + 0.4 * h for h in range(heads)])
    elif name == "log_decay":
        return relpos.LogDecayBias(1.5, num_heads=heads)
    else:
        return name  # "dense": built per call
    with torch.no_grad():
        for p in bias.parameters():
            p.normal_(0.0, 1.5)
    return bias


def _mask(kind: str, batch: int, key_length: int, g: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    keep = torch.ones(batch, key_length, dtype=torch.bool)
    cut = int(torch.randint(0, key_length + 1, (1,), generator=g))
    if kind == "one_real":
        keep[:] = False
        keep[:, min(cut, key_length - 1)] = True
    elif kind == "alike":
        keep[:, max(cut, 1):] = False
    elif kind == "all_padding_example":
        keep[batch - 1] = False
    elif kind == "right":
        keep[0, max(cut, 1):] = False
    elif kind == "left":
        keep[batch - 1, : min(cut, key_length - 1)] = False
    elif kind == "holes":
        keep[0, ::3] = False
    return keep


@st.composite
def calls(draw, backends=("auto", "eager", "sdpa", "fused"), max_scores=1 << 22):
    batch = draw(st.integers(1, 3))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    query_length = draw(st.sampled_from(LENGTHS))
    key_length = draw(st.sampled_from(LENGTHS))
    assume(batch * heads * query_length * key_length <= max_scores)
    return dict(
        batch=batch, heads=heads, kv_heads=kv_heads, query_length=query_length, key_length=key_length,
        dim=draw(st.sampled_from([8, 16, 24])),
        causal=draw(st.booleans()),
        decode=draw(st.booleans()),  # queries are the last Lq positions (q_offset = Lk - Lq) when Lq <= Lk
        bias=draw(st.sampled_from(BIASES)),
        mask=draw(st.sampled_from(MASKS)),
        backend=draw(st.sampled_from(backends)),
        grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _run(case: dict, *, large_batch_scale: int = 1):
    batch, heads, kv_heads = case["batch"], case["heads"], case["kv_heads"]
    lq, lk, dim = case["query_length"], case["key_length"], case["dim"]
    q_offset = lk - lq if case["decode"] and lq <= lk else 0
    causal = case["causal"]
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(batch, heads, lq, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, lk, dim, generator=g) for _ in range(2))
    keep = _mask(case["mask"], batch, lk, g)
    bias = _bias(case["bias"], heads, case["seed"])
    if bias == "dense":
        bias = torch.randn(1, heads, lq, lk, generator=g)
        dense = bias.double()
    elif bias is None:
        dense = None
    else:
        slopes = bias._slopes if isinstance(bias, relpos.ALiBi) else None
        dense = bias_oracle(bias, lq, lk, q_offset, slopes=slopes, grad=case["grad"])  # (1, H, Lq, Lk)
    exact = [t.double().requires_grad_(case["grad"]) for t in (q, k, v)]
    want = attend(*exact, dense, causal=causal, keep=keep, q_offset=q_offset)
    leaves = [t.clone().requires_grad_(case["grad"]) for t in (q, k, v)]
    try:
        with torch.set_grad_enabled(case["grad"]):
            out = relpos.attention(*leaves, bias=bias, causal=causal, key_mask=keep, q_offset=q_offset,
                                   backend=case["backend"])
    except ValueError as error:
        message = str(error)
        if case["backend"] != "auto" and "use backend='auto'" in message:
            return  # an explicit backend that cannot run this call, saying what to do
        future_visible = not causal and lk - 1 > q_offset
        if isinstance(bias, relpos.ALiBi) and bias.mode == "causal" and future_visible:
            assert "pass causal=True" in message, message  # the refusal names the fix
            return
        raise
    assert out.shape == (batch, heads, lq, dim) and out.dtype == q.dtype
    torch.testing.assert_close(out.detach().double(), want.detach(), atol=5e-5, rtol=1e-4)
    if case["grad"]:
        weights = torch.randn(out.shape, generator=g)
        (want * weights.double()).sum().backward()
        (out * weights).sum().backward()
        for name, got, ref in zip("qkv", leaves, exact):
            scale = max(1.0, float(ref.grad.abs().max()))
            torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-4 * scale, rtol=1e-4, msg=name)
        if isinstance(bias, torch.nn.Module):
            for p in bias.parameters():
                if p.requires_grad and p.grad is not None:
                    assert torch.isfinite(p.grad).all()


@examples(60, 2500)
@given(calls())
def test_attention_matches_fp64_on_every_cpu_backend(case):
    _run(case)


REAL = sorted({CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1, 511})


@st.composite
def real_sizes(draw):
    """Past the real 2**21-score threshold: tiles, causal chunks and the blockwise backward run as they
    do for users (no lowered constants)."""
    length = draw(st.sampled_from(REAL))
    heads = draw(st.sampled_from([4, 8]))
    batch = max(1, math.ceil(_FUSED_MIN_SCORES / (heads * length * length)))
    return dict(
        batch=min(batch, 4), heads=heads, kv_heads=draw(st.sampled_from([heads, 2])), query_length=length,
        key_length=length, dim=16, causal=draw(st.booleans()), decode=False,
        bias=draw(st.sampled_from(("t5", "alibi", "kerple", "none"))), mask=draw(st.sampled_from(MASKS)),
        backend=draw(st.sampled_from(("auto", "sdpa", "fused"))), grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@examples(12, 300)
@given(real_sizes())
def test_attention_at_real_sizes_matches_fp64(case):
    _run(case)


@examples(40, 400)
@given(calls(backends=("auto", "sdpa", "fused", "eager")), st.integers(2, 4))
def test_repeated_calls_with_growing_lengths_match(case, steps):
    """A bias module called again and again at growing lengths (its caches: T5's buckets, Sandwich's
    distances) gives what a fresh module gives."""
    bias_name = case["bias"]
    assume(bias_name not in ("none", "dense"))
    fresh = _bias(bias_name, case["heads"], case["seed"])
    reused = _bias(bias_name, case["heads"], case["seed"])
    length = case["query_length"]
    for step in range(steps):
        n = length + step
        a = reused.offsets(n, n + step).values
        b = _bias(bias_name, case["heads"], case["seed"]).offsets(n, n + step).values
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(reused.offsets(length, length).values, fresh.offsets(length, length).values)


SMALL = [n for n in LENGTHS if n <= 65]


@st.composite
def small_calls(draw):
    """Sizes the Triton interpreter runs in a second or less (16 x 16 tiles there: many tiles all the same)."""
    case = draw(calls(backends=("triton",)))
    case["query_length"] = draw(st.sampled_from(SMALL))
    case["key_length"] = draw(st.sampled_from(SMALL))
    return case


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the dev extra installs it)")
@examples(10, 200)
@given(small_calls())
def test_triton_kernel_matches_fp64(case):
    """The Triton backend (under the interpreter without a GPU: tests/conftest.py) through the same harness: every
    bias, mask, length and head layout it accepts equals fp64 attention; what it refuses (dense biases, masks with
    holes) says so."""
    _run(case)


@examples(2, 12)
@given(calls(backends=("flex",)).map(lambda case: {**case, "grad": False}))
def test_flex_matches_fp64(case):
    """The flex backend (FlexAttention, compiled per shape: a few examples; CPU has its forward only) through the
    same harness: equal to fp64 attention, or a refusal that names the fix."""
    _run(case)
