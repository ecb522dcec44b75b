"""Framework-independent references from the worked examples relpos grew from, each tested equal to the torch path.

* :func:`numpy_relative_bias_attention`: the 'The cat sat on mat' example's from-scratch NumPy attention with an
  additive relative position bias (float64 throughout).
* :func:`numpy_log_decay_bias`: the 'The cat sat on mat' example's fixed bias ``-scale * log(1 + |i - j|)``.
* :func:`t5_relative_pos`: the T5 bucketing walkthrough's JAX function (jax is imported only when it is called).
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import check_int, check_positive_float
from .buckets import check_bucket_config

__all__ = ["numpy_relative_bias_attention", "numpy_log_decay_bias", "t5_relative_pos"]


def numpy_log_decay_bias(length: int, scale: float = 0.3) -> np.ndarray:
    """(L, L) matrix ``-scale * log(1 + |i - j|)``.

    >>> numpy_log_decay_bias(3).round(4)
    array([[ 0.    , -0.2079, -0.3296],
           [-0.2079,  0.    , -0.2079],
           [-0.3296, -0.2079,  0.    ]])
    """
    length = check_int("length", length, minimum=1)
    scale = check_positive_float("scale", scale)
    pos = np.arange(length)
    return 0.0 - scale * np.log1p(np.abs(pos[:, None] - pos[None, :]))  # 0.0 - : no -0.0 on the diagonal


def numpy_relative_bias_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The 'The cat sat on mat' example: ``softmax(Q K^T / sqrt(d_k) + B) V`` for one head; returns ``(weights, output)``.

    ``q`` (Lq, d), ``k`` (Lk, d), ``v`` (Lk, dv), ``bias`` (Lq, Lk) or None.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scores = q @ k.T / math.sqrt(q.shape[-1])  # (Lq, Lk)
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=np.float64)
    scores = scores - scores.max(axis=-1, keepdims=True)  # stable softmax
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)  # (Lq, Lk)
    return weights, weights @ v  # (Lq, Lk), (Lq, dv)


def t5_relative_pos(seed: int, T: int, num_buckets: int = 32, max_distance: int = 128, *, bidirectional: bool = True):
    """The T5 bucketing walkthrough: the (T, T) T5 bucket matrix of ``rel[i, j] = j - i``, as float32, flattened to (T*T,).

    ``seed`` is unused (kept for the walkthrough's signature). A JAX port of
    :func:`relpos.relative_position_bucket` (log strategy), jit-compatible; it gives the same
    buckets as the torch function (tested).
    """
    import jax.numpy as jnp  # optional dependency: pip install "relpos[jax]"

    check_int("seed", seed)
    T = check_int("T", T, minimum=1)
    num_buckets, max_distance, bidirectional, _ = check_bucket_config(num_buckets, max_distance, bidirectional)
    pos = jnp.arange(T, dtype=jnp.int32)
    rel = pos[None, :] - pos[:, None]  # (T, T): key - query
    half = num_buckets
    if bidirectional:
        half = num_buckets // 2
        buckets = (rel > 0).astype(jnp.int32) * half
        distance = jnp.abs(rel)
    else:
        buckets = jnp.zeros_like(rel)
        distance = -jnp.minimum(rel, 0)
    max_exact = half // 2
    # distance 0 would give log(0) = -inf in the unused branch; feed it 1 instead (no warning, same result)
    safe = jnp.maximum(distance, 1).astype(jnp.float32)
    far = max_exact + (
        jnp.log(safe / max_exact) / jnp.float32(math.log(max_distance / max_exact)) * (half - max_exact)
    ).astype(jnp.int32)
    far = jnp.minimum(far, half - 1)
    buckets = buckets + jnp.where(distance < max_exact, distance, far)
    return buckets.astype(jnp.float32).reshape(-1)  # (T*T,)
