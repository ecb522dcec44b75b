"""What denormal floats cost relpos's CPU attention, and what flushing them saves (docs/attention.md).

Causal attention with Bloom-style ALiBi slopes (2^-1 .. 2^-8), B = 2, H = 8, L = 2048, d = 64, one
example left-padded by 300, fp32; forward + backward, interleaved rounds, median seconds:

* ``floor``: SDPA ``is_causal`` with no bias and no padding;
* ``sdpa autograd``: relpos's tiles through ``F.scaled_dot_product_attention`` (torch's backward,
  denormals kept): the path training took before the frozen-bias ``fused`` path;
* ``fused, flushed`` / ``fused, kept``: the frozen-bias path (SDPA's flash backward per tile) with
  relpos's flushing on / off (``relpos.backends._denormals.ENABLED``).

    PYTHONPATH=src python benchmarks/denormals.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import relpos.backends._denormals as denormals
from relpos import OffsetBias
from relpos.backends.dispatch import attention


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, heads, length, dim = 2, 8, args.length, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g, requires_grad=True) for _ in range(3))
    slopes = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32)  # (H,)
    values = slopes[:, None] * torch.arange(-(length - 1), length, dtype=torch.float32).clamp(max=0)  # (H, 2L-1)
    bias = OffsetBias(values, length, length)
    keep = torch.ones(batch, length, dtype=torch.bool)
    keep[0, :300] = False

    def relpos_step(backend: str, flush: bool):
        def step():
            denormals.ENABLED = flush
            try:
                attention(q, k, v, bias=bias, causal=True, key_mask=keep, backend=backend).sum().backward()
            finally:
                denormals.ENABLED = True
        return step

    variants = {
        "floor": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
        "sdpa autograd": relpos_step("sdpa", False),
        "fused, flushed": relpos_step("fused", True),
        "fused, kept": relpos_step("fused", False),
    }
    seen = {name: [] for name in variants}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, step in variants.items():
            start = time.perf_counter()
            step()
            if round_:
                seen[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in seen.items()}
    for name, s in medians.items():
        print(f"{name:16s} {s:.3f} s  ({s / medians['floor']:.2f}x the floor)", flush=True)
    return medians


if __name__ == "__main__":
    main()
