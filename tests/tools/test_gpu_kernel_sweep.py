"""benchmarks/gpu_kernel.py's tile sweep, run on the CPU under Triton's interpreter (tests/conftest.py) at a small
size with the GPU's tiles: every shape it would time on a GPU gives the shipped tiles' output and gradients, which
equal fp64 attention, so the lent minutes time only shapes that are right; a shape whose results differ is reported
and never chosen, however fast it times."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import relpos  # noqa: E402
from relpos.backends import _triton  # noqa: E402

from oracles import assert_bias_matters, attend, bias_oracle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 144  # 64-key tiles: some wholly past the bias's flat range, some across the diagonal, a partial last one
BROKEN = ((64, 64, 4, 2), 4, True)  # the candidate this test breaks (and times fastest)
RUNNER_UP = ((64, 64, 4, 3), 2)  # the candidate it times next: the sweep must choose it


def load_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_kernel", ROOT / "benchmarks" / "gpu_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_t5(heads, *, bidirectional=True, grad=False):
    """The sweep's T5 bias with a flat range short enough for LENGTH, its table drawn large."""
    torch.manual_seed(3)
    bias = relpos.T5RelativeBias(heads, num_buckets=8, max_distance=16, bidirectional=bidirectional)
    with torch.no_grad():
        bias.relative_attention_bias.weight.normal_(0.0, 1.5)
    return bias.requires_grad_(grad)


def test_every_tile_shape_the_sweep_tries_equals_the_shipped_tiles_and_a_wrong_one_is_never_chosen(monkeypatch):
    bench = load_benchmark()
    shipped = _triton.GPU_BLOCKS[64]
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)  # the interpreter's bf16 products are not the GPU's
    monkeypatch.setattr(bench, "t5", small_t5)
    monkeypatch.setattr(_triton, "_blocks", lambda head_dim, device: _triton.GPU_BLOCKS[64])  # the GPU's tiles here
    monkeypatch.setitem(_triton.GPU_BLOCKS, 64, shipped)  # the sweep leaves its choice there: restored after
    offsets_fields = bench.offsets_fields

    def now(option) -> bool:
        blocks = _triton.GPU_BLOCKS[64]
        return all(getattr(blocks, name) == value for name, value in offsets_fields(option).items())

    real_results = bench.results
    seen = []  # every tile configuration whose results the sweep checked
    trained = []  # the reference training step, checked against fp64

    def results(run, leaves):
        seen.append(_triton.GPU_BLOCKS[64])
        got = real_results(run, leaves)
        if leaves and _triton.GPU_BLOCKS[64] == shipped and not trained:  # the first reference training step (no
            trained.append(check_against_fp64(leaves, got))  # dropout; the chosen forward is no longer the shipped one)
        return [got[0] + 1.0, *got[1:]] if now(BROKEN) else got

    monkeypatch.setattr(bench, "results", results)
    monkeypatch.setattr(bench, "measure", lambda variants, train, rounds: {"x": {"ms": (
        0.5 if now(BROKEN) else 0.7 if now(RUNNER_UP) else 1.0)}})
    report = bench.sweep(batch=1, heads=2, length=LENGTH, dim=16, rounds=1)

    assert list(report["wrong"]) == [str(offsets_fields(BROKEN))], report["wrong"]
    assert report["wrong"][str(offsets_fields(BROKEN))] > 0.1
    assert report["fwd_offsets"][str(BROKEN)] is None
    chosen = report["chosen"]
    assert (chosen["fwd_offsets"], chosen["gather_split"], chosen["split_flat"]) == (RUNNER_UP[0], RUNNER_UP[1], False)
    candidates = (len(bench.SWEEP_FWD) + len(bench.SWEEP_FWD_OFFSETS) + len(bench.SWEEP_DKDV) + len(bench.SWEEP_DQ)
                  + len(bench.SWEEP_DKDV_DROPOUT))
    assert trained and len(seen) == candidates + 4  # and the shipped tiles once per kind of call: forward with and without the
    # term, the training step, the training step with dropout
    for name, options in (("fwd", bench.SWEEP_FWD), ("dkdv", bench.SWEEP_DKDV), ("dq", bench.SWEEP_DQ),
                          ("dkdv_dropout", bench.SWEEP_DKDV_DROPOUT)):
        assert set(options) <= {getattr(b, name) for b in seen}, name  # each ran with its own tiles
    assert {(b.fwd_offsets, b.gather_split, b.split_flat) for b in seen} >= {
        tuple(offsets_fields(o).values()) for o in bench.SWEEP_FWD_OFFSETS}
    assert _triton.GPU_BLOCKS[64] == dataclasses.replace(shipped, **chosen)


def check_against_fp64(leaves, got):
    """The shipped tiles' training step against fp64 attention from the formulas (the sweep's own inputs)."""
    q, k, v, weight = leaves
    bias = small_t5(q.shape[1], grad=True)
    with torch.no_grad():
        bias.relative_attention_bias.weight.copy_(weight)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = attend(*exact, bias_oracle(bias, LENGTH, LENGTH, 0, grad=True), causal=False)
    out.sum().backward()
    want = [out.detach(), *(t.grad for t in exact), bias.relative_attention_bias.weight.grad.double()]
    assert_bias_matters(out, attend(*exact, None, causal=False), tol=2e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-4 * max(1.0, float(b.abs().max())), rtol=1e-4)
