"""Context-parallel attention on 2 and 4 gloo processes equals one process's fp64 attention over the whole sequence.

Each world is spawned once per module (tests/distributed/ring_worlds.py) and runs every case; a case's test
reassembles the ranks' rows and sums their parameter-gradient shares, then compares with naive fp64
attention (tests/oracles.py) whose bias is rebuilt from the paper's formula: output, dq, dk, dv and every
parameter gradient within 1e-10 (fp32: 1e-5), with a position term that moves the output far beyond that.
"""

from __future__ import annotations

import pytest
import torch

import relpos
import relpos.distributed as rd
from oracles import assert_bias_matters, attend, bias_oracle
from ring_worlds import BY_NAME, CASES, FOUR, LAYER_LENGTH, inputs, layer_inputs, position_module, run_world


@pytest.fixture(scope="module")
def two():
    jobs = [c.name for c in CASES] + [
        "layer_bidirectional", "layer_causal_zigzag", "mismatch_causal", "mismatch_length", "mismatch_parameters", "mask_holes",
    ]
    return run_world(2, jobs)


@pytest.fixture(scope="module")
def four():
    return run_world(4, FOUR + ["layer_causal_zigzag"])


def _tolerance(case) -> float:
    return 1e-10 if case.dtype == torch.float64 else 1e-5


def _reference(case):
    """Whole-sequence fp64 output, input gradients and parameter gradients from the formulas."""
    q, k, v, keep, grad = inputs(case)
    q, k, v, grad = (t.double() for t in (q, k, v, grad))
    position = position_module(case.position, torch.float64, case.seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bias, qr, kr = None, q, k
    if isinstance(position, relpos.RotaryEmbedding):
        qr, kr = position.rotate(q, 0), position.rotate(k, 0)
    elif isinstance(position, relpos.XPos):
        qr, kr = position.rotate(q, 0), position.rotate(k, 0, downscale=True)
    elif position is not None:
        bias = bias_oracle(position, case.length, case.length, grad=True)  # (1, H, L, L)
        if case.position in ("sandwich", "log_decay"):  # these modules keep fp32 values: round the formula alike
            bias = bias.float().double()
    out = attend(qr, kr, v, bias, causal=case.causal, keep=keep)
    params = [] if position is None else list(position.named_parameters())
    grads = torch.autograd.grad(out, [q, k, v] + [p for _, p in params], grad)
    plain = attend(q.detach(), k.detach(), v.detach(), None, causal=case.causal, keep=keep)
    return out.detach(), dict(zip(("dq", "dk", "dv"), grads[:3])), {n: g for (n, _), g in zip(params, grads[3:])}, plain


def _check_case(results: list[dict], name: str) -> None:
    case = BY_NAME[name]
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank}: {r[name].get('traceback')}"
    out, grads, params, plain = _reference(case)
    tol = _tolerance(case)
    if case.position != "none":
        assert_bias_matters(out, plain, tol)
    got = rd.unshard([r[name]["out"] for r in results], 2, case.layout)
    assert (got.double() - out).abs().max() < tol
    for key, want in grads.items():
        got = rd.unshard([r[name][key] for r in results], 2, case.layout)
        assert (got.double() - want).abs().max() < tol, key
    for key, want in params.items():
        got = sum(r[name]["params"][key].double() for r in results)  # each rank's share
        assert (got - want).abs().max() < tol * max(1.0, float(want.abs().max())), key
    if params:
        assert max(float(g.abs().max()) for g in params.values()) > 100 * tol, "the parameters' gradients are too small to test"


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_two_ranks(two, name):
    _check_case(two, name)


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks(four, name):
    _check_case(four, name)


def _check_layer(results: list[dict], job: str, causal: bool, layout: str) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r[job], f"rank {rank}: {r[job].get('traceback')}"
    stack, x, keep, w = layer_inputs(causal)
    y = stack(x, key_mask=keep)  # the same layer on one process, the whole sequence
    loss = (y * w).sum()
    loss.backward()
    got = rd.unshard([r[job]["out"] for r in results], 1, layout)
    assert (got - y.detach()).abs().max() < 1e-10
    for r in results:
        assert abs(float(r[job]["loss"]) - float(loss.detach())) < 1e-10
        assert r[job]["patched after undo"] == []
        for name, p in stack.named_parameters():
            assert (r[job]["grads"][name] - p.grad).abs().max() < 1e-10, name
    table = stack.relative_bias.relative_attention_bias.weight.grad
    assert float(table.abs().max()) > 1e-3  # the position term is trained through the ring


def test_layer_trains_as_on_one_process(two):
    _check_layer(two, "layer_bidirectional", False, "contiguous")


def test_causal_layer_zigzag(two):
    _check_layer(two, "layer_causal_zigzag", True, "zigzag")


def test_causal_layer_four_ranks(four):
    _check_layer(four, "layer_causal_zigzag", True, "zigzag")


@pytest.mark.parametrize(
    "job, words",
    [
        ("mismatch_causal", ["causal: rank 0 False, rank 1 True"]),
        ("mismatch_length", ["query shape", "(1, 4, 8, 8)", "(1, 4, 12, 8)"]),
        ("mismatch_parameters", ["position term", "synchronized"]),
        ("mask_holes", ["key_mask problem", "one run per example"]),
    ],
)
def test_disagreeing_ranks_raise_on_every_rank(two, job, words):
    for rank, r in enumerate(two):
        assert r[job]["raised"] == "DistributedMismatchError", (rank, r[job])
        for word in words:
            assert word in r[job]["message"], (rank, word, r[job]["message"])


def test_a_missing_rank_times_out():
    rank0, rank1 = (r["timeout"] for r in run_world(2, ["timeout"]))
    assert rank0["raised"] == "RingTimeoutError" and "timeout=2s" in rank0["message"]
    assert rank0["seconds"] < 30


# --- single-process checks: the boundary refuses before any communication ---


def test_not_initialized_is_named():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        rd.ring_attention(q, q, q)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"layout": "spiral"}, ValueError, "layout must be one of"),
        ({"timeout": 0}, ValueError, "timeout must be a finite number > 0"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"bias": torch.zeros(1, 4, 8, 8)}, TypeError, "cannot be sharded by offset"),
        ({"rotary": relpos.ALiBi(2)}, TypeError, "rotary must be"),
        ({"key_mask": torch.ones(1, 8)}, TypeError, "key_mask must be boolean"),
        ({"key": torch.randn(1, 2, 6, 4)}, ValueError, "self-attention over one sharded sequence"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    q = torch.randn(1, 2, 8, 4)
    args = {"key": q, "value": kwargs.get("key", q), **kwargs}  # Lq != Lk: keys and values alike
    with pytest.raises(error, match=match):
        rd.ring_attention(q, args.pop("key"), args.pop("value"), **args)


def test_uneven_lengths_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="pad the sequence to 12 and mark the padding with key_mask"):
        rd.shard(torch.zeros(10), 0, 0, 3)
    with pytest.raises(ValueError, match="pad the sequence to 16"):
        rd.shard(torch.zeros(10), 0, 0, 4, "zigzag")


@pytest.mark.parametrize("layout", rd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    x = torch.arange(2 * world * 3 * 2).reshape(2, -1)  # (2, 6 world)
    parts = [rd.shard(x, 1, r, world, layout) for r in range(world)]
    assert torch.equal(rd.unshard(parts, 1, layout), x)
    positions = torch.cat([rd.global_positions(r, world, x.shape[1] // world, layout) for r in range(world)])
    assert torch.equal(positions.sort().values, torch.arange(x.shape[1]))  # every position on exactly one rank
    assert torch.equal(torch.cat(parts, 1)[0], x[0, positions])


def test_context_parallel_refuses_before_changing_anything():
    layer = relpos.MultiheadAttention(16, 2, position=relpos.T5RelativeBias(2), dropout=0.1)
    with pytest.raises(ValueError, match="dropout=0.1"):
        rd.context_parallel(layer)
    assert "forward" not in layer.__dict__
    gated = torch.nn.ModuleList([relpos.MultiheadAttention(16, 2), relpos.MultiheadAttention(16, 2, position=relpos.CoPE(8, 8))])
    with pytest.raises(ValueError, match="CoPE"):
        rd.context_parallel(gated)
    assert all("forward" not in m.__dict__ for m in gated)
    with pytest.raises(ValueError, match="no relpos MultiheadAttention"):
        rd.context_parallel(torch.nn.Linear(2, 2))


def test_context_parallel_layer_refuses_a_cache():
    layer = relpos.MultiheadAttention(16, 2, position=relpos.T5RelativeBias(2))
    with rd.context_parallel(layer):
        with pytest.raises(ValueError, match="takes x and key_mask only.*cache"):
            layer(torch.randn(1, 4, 16), cache=relpos.KVCache())
    assert "forward" not in layer.__dict__  # undone on leaving the block
    assert layer(torch.randn(1, 4, 16))[0].shape == (1, 4, 16)
