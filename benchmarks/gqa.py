"""Grouped-query attention on CPU: repeating k/v per group vs SDPA's enable_gqa, with relpos's bias view.

    python benchmarks/gqa.py            # B=1, 32 query heads, 8 key/value heads, L=2048, d=64

Interleaved rounds, medians; prints the two times and checks the outputs are equal.
"""

import statistics
import time

import torch
import torch.nn.functional as F

from relpos.core.bias import hankel_view


def main(batch=1, heads=32, kv_heads=8, length=2048, dim=64, rounds=7) -> None:
    q = torch.randn(batch, heads, length, dim)
    k, v = (torch.randn(batch, kv_heads, length, dim) for _ in range(2))
    view = hankel_view(torch.randn(heads, 2 * length - 1), length)  # (1, H, L, L) zero-copy bias

    def repeat():
        group = heads // kv_heads
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, H, L, d) copies
        return F.scaled_dot_product_attention(q.flip(-2), kk, vv, attn_mask=view, scale=dim**-0.5)

    def gqa():
        return F.scaled_dot_product_attention(q.flip(-2), k, v, attn_mask=view, scale=dim**-0.5, enable_gqa=True)

    variants = {"repeat_interleave": repeat, "enable_gqa": gqa}
    times = {name: [] for name in variants}
    with torch.no_grad():
        assert torch.allclose(repeat(), gqa(), atol=1e-5)
        for _ in range(rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
    for name, samples in times.items():
        print(f"{name}: {statistics.median(samples):.1f} ms")


if __name__ == "__main__":
    main()
