"""Relative positions: the matrix ``key - query`` and its distinct values, the offsets.

Sign convention (T5, Hugging Face transformers, Mesh TensorFlow)::

    rel[i, j] = key_pos[j] - query_pos[i]      # > 0: the key is in the query's future

Queries sit at positions ``q_offset .. q_offset + Lq - 1`` of the keys (``q_offset`` is
the number of tokens already in a KV cache while decoding). The T5 bias explainer writes ``i - j``
(query - key); that is the opposite sign and is *not* what T5 checkpoints were trained
with. See docs/conventions.md.
"""

from __future__ import annotations

import torch

from .._checks import check_device, check_int

__all__ = ["offset_range", "relative_offsets", "relative_positions"]


def relative_positions(
    query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """The (Lq, Lk) matrix ``key_pos[j] - query_pos[i]`` with queries at ``q_offset + i``.

    >>> relative_positions(3, 4)
    tensor([[ 0,  1,  2,  3],
            [-1,  0,  1,  2],
            [-2, -1,  0,  1]])
    >>> relative_positions(1, 4, q_offset=3)   # one decoding step after 3 cached tokens
    tensor([[-3, -2, -1,  0]])
    """
    query_length = check_int("query_length", query_length, minimum=1)
    key_length = check_int("key_length", key_length, minimum=1)
    q_offset = check_int("q_offset", q_offset, minimum=0)
    device = check_device("device", device)
    query_pos = torch.arange(query_length, device=device) + q_offset  # (Lq,)
    key_pos = torch.arange(key_length, device=device)  # (Lk,)
    return key_pos[None, :] - query_pos[:, None]  # (Lq, Lk)


def relative_offsets(
    query_length: int, key_length: int, *, q_offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Every distinct value of :func:`relative_positions`, ascending: ``Lq + Lk - 1`` of them.

    A bias that depends only on ``j - i`` needs its value at these offsets and nothing
    else. Entry ``t`` is offset ``t - (q_offset + Lq - 1)``, so row ``i`` of the full
    matrix is the window ``t = Lq-1-i .. Lq-1-i+Lk-1`` of this vector.

    >>> relative_offsets(3, 4)
    tensor([-2, -1,  0,  1,  2,  3])
    """
    query_length = check_int("query_length", query_length, minimum=1)
    key_length = check_int("key_length", key_length, minimum=1)
    q_offset = check_int("q_offset", q_offset, minimum=0)
    device = check_device("device", device)
    low, high = offset_range(query_length, key_length, q_offset)
    return torch.arange(low, high + 1, device=device)  # (Lq + Lk - 1,)


def offset_range(query_length: int, key_length: int, q_offset: int = 0) -> tuple[int, int]:
    """The lowest and the highest offset ``j - i`` of a call (both included; arguments already checked): the first
    and last entry of :func:`relative_offsets`.

    >>> offset_range(3, 4), offset_range(1, 4, q_offset=3)
    ((-2, 3), (-3, 0))
    """
    return -(q_offset + query_length - 1), key_length - 1 - q_offset
