"""Spawned gloo worlds for the context-parallel tests: each world runs many cases, so processes start once.

A case builds the whole sequence's inputs and its position module from fixed seeds (every rank and the
parent build the same ones), runs :func:`relpos.distributed.ring_attention` on its shard with gradients and
saves its rows and its share of every gradient; the parent compares the reassembled result with naive fp64
attention over the whole sequence (tests/oracles.py) whose bias comes from the paper's formula.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import relpos
import relpos.distributed as rd
import relpos.distributed.ring as ring_module

B, H, D = 2, 4, 8
TIMEOUT = 60.0  # seconds: a broken schedule fails the test instead of hanging it


@dataclass(frozen=True)
class Case:
    name: str
    position: str  # t5, t5_causal, clipped, alibi, alibi_symmetric, kerple, fire, sandwich, log_decay, rope, xpos, none
    causal: bool
    layout: str
    padded: bool = False
    kv_heads: int = H
    dtype: torch.dtype = torch.float64
    length: int = 48  # tokens in the whole sequence; a multiple of 2 x world size
    piece: int = 5  # relpos.distributed.PIECE_ROWS inside the case (small: many pieces, partial blocks)
    query_rows: int = 7  # relpos.distributed.ring.QUERY_ROWS: query blocks that straddle key pieces
    batch: int = B
    empty_example: bool = False  # the last example all padding (with padded=True)
    seed: int = 0


CASES = [
    Case("t5", "t5", False, "contiguous"),
    Case("t5_causal_zigzag_padded", "t5_causal", True, "zigzag", padded=True),
    Case("t5_causal_contiguous_padded", "t5_causal", True, "contiguous", padded=True, piece=7),
    Case("clipped_causal", "clipped", True, "contiguous"),
    Case("alibi_causal_zigzag_gqa", "alibi", True, "zigzag", kv_heads=2),
    Case("alibi_symmetric_padded", "alibi_symmetric", False, "contiguous", padded=True),
    Case("kerple_zigzag", "kerple", False, "zigzag"),
    Case("kerple_power_causal", "kerple_power", True, "contiguous"),
    Case("fire_causal", "fire", True, "contiguous"),
    Case("sandwich", "sandwich", False, "contiguous", padded=True),
    Case("log_decay_causal_zigzag", "log_decay", True, "zigzag", padded=True),
    Case("rope_causal_zigzag", "rope", True, "zigzag", padded=True),
    Case("rope_dynamic", "rope_dynamic", False, "contiguous"),
    Case("xpos_causal", "xpos", True, "contiguous"),
    Case("none_causal_padded", "none", True, "zigzag", padded=True),
    Case("t5_one_piece", "t5", True, "contiguous", piece=4096, query_rows=4096),
    Case("t5_query_pieces_smaller", "t5_causal", True, "zigzag", padded=True, piece=7, query_rows=3),
    Case("t5_fp32", "t5_causal", True, "zigzag", padded=True, dtype=torch.float32),
    Case("t5_batch_of_one_padded", "t5_causal", True, "zigzag", padded=True, batch=1),
    Case("alibi_batch_of_one", "alibi_symmetric", False, "contiguous", batch=1, piece=4, query_rows=5),
    Case("t5_all_padding_example", "t5", False, "contiguous", padded=True, batch=3, empty_example=True),
    Case("t5_causal_all_padding_example", "t5_causal", True, "zigzag", padded=True, batch=3, empty_example=True),
    Case("t5_real_size", "t5_causal", True, "zigzag", padded=True, length=1024, piece=300, query_rows=200),
]
FOUR = ["t5_causal_zigzag_padded", "alibi_causal_zigzag_gqa", "kerple_zigzag", "rope_causal_zigzag", "t5",
        "t5_batch_of_one_padded", "t5_causal_all_padding_example"]


def position_module(name: str, dtype: torch.dtype, seed: int):
    """The case's position module, parameters drawn in fp64 from ``seed`` (so they move the result), then cast."""
    module = _position_module(name, seed)
    return module if module is None or dtype == torch.float64 else module.to(dtype)


def _position_module(name: str, seed: int):
    dtype = torch.float64
    torch.manual_seed(seed)
    if name == "none":
        return None
    if name in ("t5", "t5_causal"):
        module = relpos.T5RelativeBias(H, 16, 20, bidirectional=name == "t5", dtype=dtype)
    elif name == "clipped":
        module = relpos.ClippedRelativeBias(H, 6, dtype=dtype)
    elif name == "alibi":
        return relpos.ALiBi(H)
    elif name == "alibi_symmetric":
        return relpos.ALiBi(H, mode="symmetric")
    elif name in ("kerple", "kerple_power"):
        module = relpos.KerpleBias(H, "log" if name == "kerple" else "power", r1=[0.5, 1.0, 1.5, 2.0], r2=[0.3, 0.6, 0.9, 1.2], dtype=dtype)
        return module
    elif name == "fire":
        module = relpos.FIREBias(H, mlp_width=8, init_L=64.0, dtype=dtype)
    elif name == "sandwich":
        return relpos.SandwichBias(H, 8)
    elif name == "log_decay":
        return relpos.LogDecayBias(0.7, num_heads=H)
    elif name == "rope":
        return relpos.RotaryEmbedding(D, base=100.0)
    elif name == "rope_dynamic":
        return relpos.RotaryEmbedding(D, base=100.0, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16})
    elif name == "xpos":
        return relpos.XPos(D, scale_base=64.0)
    else:
        raise ValueError(name)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def inputs(case: Case):
    """Whole-sequence q, k, v, key mask (or None) and output gradient."""
    g = torch.Generator().manual_seed(100 + case.seed)
    batch = case.batch
    q = torch.randn(batch, H, case.length, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, case.kv_heads, case.length, D, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(batch, H, case.length, D, generator=g, dtype=torch.float64)
    keep = None
    if case.padded:
        keep = torch.ones(batch, case.length, dtype=torch.bool)
        keep[0, case.length - case.length // 3 :] = False  # right padding across a shard boundary
        if batch > 1:
            keep[1, : 3] = False  # left padding: under a causal mask its first rows see no key
        if case.empty_example:
            keep[-1] = False
    return q.to(case.dtype), k.to(case.dtype), v.to(case.dtype), keep, grad.to(case.dtype)


def split(position):
    """(bias, rotary) arguments of ring_attention for a position module."""
    if isinstance(position, (relpos.RotaryEmbedding, relpos.XPos)):
        return None, position
    return position, None


def run_case(case: Case, rank: int, world: int) -> dict:
    ring_module.PIECE_ROWS, ring_module.QUERY_ROWS = case.piece, case.query_rows
    q, k, v, keep, grad = inputs(case)
    position = position_module(case.position, case.dtype, case.seed)
    bias, rotary = split(position)
    part = lambda t, dim=2: rd.shard(t, dim, rank, world, case.layout).clone()  # noqa: E731
    ql, kl, vl = (part(t).requires_grad_() for t in (q, k, v))
    out = rd.ring_attention(
        ql, kl, vl, bias=bias, rotary=rotary, causal=case.causal, key_mask=None if keep is None else part(keep, 1),
        layout=case.layout, timeout=TIMEOUT,
    )
    (out * part(grad)).sum().backward()
    params = {} if position is None else {n: p.grad for n, p in position.named_parameters()}
    return {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "params": params}


def _worker(rank: int, world: int, directory: str, jobs: list[str]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{directory}/store", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT)
    )
    torch.set_num_threads(1)
    results = {}
    for job in jobs:
        try:
            results[job] = JOBS[job](rank, world) if job in JOBS else run_case(BY_NAME[job], rank, world)
        except Exception as error:  # recorded per case: the parent's test for it fails with the traceback
            results[job] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    torch.save(results, f"{directory}/rank{rank}.pt")
    if "timeout" in jobs:  # after a timed-out collective the group cannot be torn down cleanly: just exit
        os._exit(0)
    rd.exit_process(0)  # a barrier, the group destroyed, no interpreter teardown: a gloo thread can abort it


def run_world(world: int, jobs: list[str]) -> list[dict]:
    """Spawn ``world`` gloo processes that run ``jobs`` (case or job names) in order; every rank's results."""
    directory = tempfile.mkdtemp(prefix="relpos-ring-")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, directory, jobs), nprocs=world, join=True)
    return [torch.load(f"{directory}/rank{r}.pt") for r in range(world)]


BY_NAME = {c.name: c for c in CASES}
JOBS: dict = {}  # name -> fn(rank, world) -> picklable result: the layer and bad-input jobs (tests/distributed/jobs.py)


# --- jobs beyond the attention cases: the sharded layer, and what every rank must refuse ---

LAYER_DIM, LAYER_LENGTH = 32, 40


def layer_inputs(causal: bool):
    """A T5-style stack (fp64, seeded), its (B, L, dim) input, key mask and output weights for the loss."""
    torch.manual_seed(7)
    stack = relpos.T5Stack(2, LAYER_DIM, H, 64, num_buckets=16, max_distance=20, bidirectional=not causal, dtype=torch.float64)
    with torch.no_grad():
        stack.relative_bias.relative_attention_bias.weight.normal_()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, LAYER_LENGTH, LAYER_DIM, generator=g, dtype=torch.float64)
    w = torch.randn(B, LAYER_LENGTH, LAYER_DIM, generator=g, dtype=torch.float64)
    keep = torch.ones(B, LAYER_LENGTH, dtype=torch.bool)
    keep[1, LAYER_LENGTH - 9 :] = False
    return stack, x, keep, w


def _layer_job(causal: bool, layout: str):
    def job(rank: int, world: int) -> dict:
        ring_module.PIECE_ROWS, ring_module.QUERY_ROWS = 6, 4
        stack, x, keep, w = layer_inputs(causal)
        part = lambda t: rd.shard(t, 1, rank, world, layout)  # noqa: E731
        with rd.context_parallel(stack, layout=layout, timeout=TIMEOUT):
            y = stack(part(x), key_mask=part(keep))  # (B, Lc, dim)
            loss = (y * part(w)).sum()
            loss.backward()
        rd.all_reduce_grads(stack, timeout=TIMEOUT)
        total = loss.detach().clone()
        dist.all_reduce(total)
        patched = [n for n, m in stack.named_modules() if "forward" in m.__dict__]
        return {"out": y.detach(), "loss": total, "grads": {n: p.grad for n, p in stack.named_parameters()}, "patched after undo": patched}

    return job


def _expect_error(call) -> dict:
    try:
        call()
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None}


def _small(rank: int, world: int, *, length: int = 16, causal: bool = False, bias=None, keep=None, timeout=TIMEOUT):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, length, D, generator=g, dtype=torch.float64) for _ in range(3))
    part = lambda t, dim=2: rd.shard(t, dim, rank, world)  # noqa: E731
    return rd.ring_attention(
        part(q), part(k), part(v), bias=bias, causal=causal, key_mask=None if keep is None else part(keep, 1), timeout=timeout
    )


def _mismatch_causal(rank, world):
    return _expect_error(lambda: _small(rank, world, causal=rank == 1))


def _mismatch_length(rank, world):
    return _expect_error(lambda: _small(rank, world, length=16 if rank == 0 else 24))


def _mismatch_parameters(rank, world):
    bias = relpos.T5RelativeBias(H, 16, 20)
    with torch.no_grad():
        bias.relative_attention_bias.weight.fill_(float(rank))  # unsynchronized parameters
    return _expect_error(lambda: _small(rank, world, bias=bias.double()))


def _mask_holes(rank, world):
    keep = torch.ones(1, 16, dtype=torch.bool)
    keep[0, 11] = False  # a hole inside rank 1's rows (8..15)
    return _expect_error(lambda: _small(rank, world, keep=keep))


def _timeout(rank, world):
    import time

    if rank == 1:  # rank 1 never joins (but stays alive, so rank 0's wait ends by its timeout, not a closed socket)
        time.sleep(6.0)
        return {"raised": "did not call"}
    start = time.monotonic()
    result = _expect_error(lambda: _small(rank, world, timeout=2.0))
    return {**result, "seconds": time.monotonic() - start}


JOBS.update(
    layer_bidirectional=_layer_job(False, "contiguous"),
    layer_causal_zigzag=_layer_job(True, "zigzag"),
    mismatch_causal=_mismatch_causal,
    mismatch_length=_mismatch_length,
    mismatch_parameters=_mismatch_parameters,
    mask_holes=_mask_holes,
    timeout=_timeout,
)
