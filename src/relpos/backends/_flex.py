"""The ``flex`` backend: compiled FlexAttention reading the per-offset bias in its score_mod.

``score_mod`` adds ``values[h, kv_idx - q_idx + Lq - 1]``: the bias is looked up, never
materialized. A causal mask and key padding become a block mask (fully masked blocks are
skipped). On GPU
FlexAttention differentiates through the captured ``values`` (the table gets its gradient); on
CPU torch supports it for inference only. Each new shape compiles once (seconds).
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["flex_biased_attention"]

_MAX_SHAPES = 256


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _score_mod(values: torch.Tensor, query_length: int):
    last = query_length - 1
    if values.shape[0] == 1:  # one bias shared by every head

        def shared(score, b, h, q_idx, kv_idx):
            return score + values[0, kv_idx - q_idx + last]

        return shared

    def per_head(score, b, h, q_idx, kv_idx):
        return score + values[h, kv_idx - q_idx + last]

    return per_head


_BLOCK = 128  # FlexAttention's default block size


def _block_mask(batch, query_length, key_length, *, causal, q_offset, key_ranges, device):
    """Block mask for the causal triangle and/or key padding, built block by block (never per score).

    ``key_ranges``: ``(starts, ends)``, example ``b`` keeps keys ``starts[b] <= j < ends[b]``. Which
    (query block, key block) pairs see some key, and which see every key, follow from the block
    bounds; only the partial blocks run ``keep`` per score. torch's ``create_block_mask`` evaluates
    ``keep`` on the whole ``(B, Lq, Lk)`` grid first (577 MiB at B = 1, L = 8192; tests/backends/test_cuda.py).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not causal and key_ranges is None:
        return None
    rows = torch.arange(0, query_length, _BLOCK, device=device)  # (nQ,) first row of each query block
    cols = torch.arange(0, key_length, _BLOCK, device=device)  # (nK,) first key of each key block
    row_first = rows[:, None] + q_offset  # (nQ, 1) positions
    row_last = (rows + _BLOCK).clamp(max=query_length)[:, None] - 1 + q_offset
    col_first, col_last = cols[None, :], (cols + _BLOCK).clamp(max=key_length)[None, :] - 1  # (1, nK)
    if key_ranges is None:
        starts = torch.zeros(1, 1, 1, dtype=torch.long, device=device)
        ends = torch.full((1, 1, 1), key_length, dtype=torch.long, device=device)
    else:
        starts = torch.tensor(key_ranges[0], device=device).view(-1, 1, 1)  # (B, 1, 1)
        ends = torch.tensor(key_ranges[1], device=device).view(-1, 1, 1)
    lo = torch.maximum(col_first, starts)  # (B|1, 1, nK) first kept key of the block
    hi = torch.minimum(col_last, ends - 1)  # last kept key
    full = (col_first >= starts) & (col_last < ends)  # (B|1, 1, nK)
    if causal:
        hi = torch.minimum(hi, row_last)  # (B|1, nQ, nK)
        full = full & (col_last <= row_first)
    any_key = lo <= hi  # (B|1, nQ, nK)
    full = full & any_key
    partial = any_key & ~full
    ragged = ((key_length % _BLOCK != 0) & (cols == cols[-1]))[None, :]  # (1, nK): out-of-range keys
    ragged = ragged | ((query_length % _BLOCK != 0) & (rows == rows[-1]))[:, None]  # (nQ, nK): and rows
    partial, full = partial | (full & ragged), full & ~ragged  # flex masks what lies past the ends

    def compact(blocks):  # (B|1, nQ, nK) bool -> counts (B|1, 1, nQ), indices (B|1, 1, nQ, nK) int32
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)  # kept blocks first
        return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def keep(b, h, q_idx, kv_idx):
        visible = kv_idx <= q_idx + q_offset if causal else kv_idx >= 0
        if key_ranges is None:
            return visible
        return visible & (kv_idx >= starts.view(-1)[b]) & (kv_idx < ends.view(-1)[b])

    counts, indices = compact(partial.expand(-1, len(rows), -1))
    full_counts, full_indices = compact(full.expand(-1, len(rows), -1))
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, _BLOCK, keep,
                                    seq_lengths=(query_length, key_length))


def flex_biased_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    values: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    q_offset: int = 0,
    key_ranges: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """(B, H, Lq, d) attention with the per-offset bias ``values`` (Hb, Lq + Lk - 1, fp32) via compiled flex.

    ``key_ranges``: ``(starts, ends)``: example ``b`` attends to keys ``starts[b] <= j < ends[b]``
    (padding). A query row with no key returns 0.
    """
    batch, _, query_length, _ = query.shape
    key_length = key.shape[-2]
    block_mask = _block_mask(
        batch, query_length, key_length, causal=causal, q_offset=q_offset, key_ranges=key_ranges, device=query.device
    )
    # Every new (Lq, Lk) compiles a kernel. Past dynamo's default limit of 8 it would silently fall
    # back to unfused flex, which materializes (B, H, Lq, Lk): allow many shapes instead.
    with torch._dynamo.config.patch(recompile_limit=_MAX_SHAPES):
        return _compiled_flex()(
            query, key, value, score_mod=_score_mod(values, query_length), block_mask=block_mask, scale=scale,
            kernel_options=_kernel_options(query, values),
        )


def _kernel_options(query: torch.Tensor, values: torch.Tensor) -> dict | None:
    """Two pipeline stages for a bf16/fp16 query with fp32 per-offset values on CUDA.

    With torch's default there (three stages), the kernel needs 245760 bytes of shared memory against an
    H100's 232448 and fails to compile ("No valid triton configs"; torch 2.11, measured for
    tests/backends/test_cuda.py). The values stay fp32 so the table's gradient accumulates in fp32.
    """
    if query.device.type == "cuda" and query.dtype != values.dtype:
        return {"num_stages": 2}
    return None
