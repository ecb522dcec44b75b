"""Seed 004's NumPy attention and seed 001's JAX function, against the torch path and golden numbers."""

import numpy as np
import pytest
import torch

from relpos import attention, relative_positions, t5_bucket
from relpos.encodings.reference import numpy_log_decay_bias, numpy_relative_bias_attention, t5_relative_pos

from cat_sat import BIAS_TABLE, BIASED, BIASED_SCORES, DIFFERENCE, RAW, STANDARD, STANDARD_OUT, V


def qk_from_raw():
    """Q, K (d = 5) with Q K^T / sqrt(5) = RAW / 2, the seed's scaled scores (its d_k is 4)."""
    return RAW * np.sqrt(5) / 2, np.eye(5)


def test_cat_sat_example_tables_numpy():
    b = numpy_log_decay_bias(5, 0.3)
    assert np.allclose(b[0], BIAS_TABLE[0], atol=5e-5)
    assert np.allclose(RAW / 2 + b, BIASED_SCORES, atol=5e-5)
    q, k = qk_from_raw()
    w0, out0 = numpy_relative_bias_attention(q, k, V)
    w1, out1 = numpy_relative_bias_attention(q, k, V, b)
    assert np.allclose(w0, STANDARD, atol=5e-5)
    assert np.allclose(w1, BIASED, atol=5e-5)
    assert np.allclose(w1 - w0, DIFFERENCE, atol=1e-4)  # the seed rounds after subtracting
    assert np.allclose(out0, STANDARD_OUT, atol=5e-5)
    assert np.allclose(out1[4], [0.3077, 0.3181, 0.3326, 0.3554], atol=2e-4)


def test_numpy_equals_torch_attention():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(7, 8)), rng.normal(size=(11, 8)), rng.normal(size=(11, 5))
    bias = rng.normal(size=(7, 11))
    _, expected = numpy_relative_bias_attention(q, k, v, bias)
    t = lambda a: torch.tensor(a)[None, None]  # noqa: E731  (1, 1, L, d) float64
    for backend in ("eager", "sdpa"):
        got = attention(t(q), t(k), t(v), bias=t(bias), backend=backend)[0, 0].numpy()
        assert np.allclose(got, expected, atol=1e-10)


def test_numpy_log_decay_is_toeplitz_and_symmetric():
    b = numpy_log_decay_bias(9, 0.7)
    rel = relative_positions(9, 9).numpy()
    assert np.allclose(b, -0.7 * np.log1p(np.abs(rel)))
    with pytest.raises(ValueError, match="scale must be a finite number > 0, got -1.0"):
        numpy_log_decay_bias(3, -1.0)


jax = pytest.importorskip("jax")


@pytest.mark.parametrize("T, num_buckets, max_distance", [(4, 8, 16), (64, 32, 128), (300, 32, 128), (200, 64, 100), (50, 6, 7)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_jax_equals_torch(T, num_buckets, max_distance, bidirectional):
    got = t5_relative_pos(0, T, num_buckets, max_distance, bidirectional=bidirectional)
    assert got.dtype == jax.numpy.float32 and got.shape == (T * T,)
    expected = t5_bucket(relative_positions(T, T), bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    assert np.array_equal(np.asarray(got), expected.float().reshape(-1).numpy())


def test_jax_walkthrough_example_and_jit():
    got = t5_relative_pos(0, 4, 8, 16)
    assert np.asarray(got).reshape(4, 4).tolist() == [[0, 5, 6, 6], [1, 0, 5, 6], [2, 1, 0, 5], [2, 2, 1, 0]]
    jitted = jax.jit(t5_relative_pos, static_argnums=(0, 1, 2, 3))
    assert np.array_equal(np.asarray(jitted(0, 16, 8, 16)), np.asarray(t5_relative_pos(0, 16, 8, 16)))
    with pytest.raises(ValueError, match="num_buckets must be even"):
        t5_relative_pos(0, 4, 7, 16)
