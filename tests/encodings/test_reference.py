"""Seed 004's NumPy attention and seed 001's JAX function, against the torch path and golden numbers."""

import numpy as np
import pytest
import torch

from relpos import attention, relative_positions, t5_bucket
from relpos.encodings.reference import numpy_log_decay_bias, numpy_relative_bias_attention, t5_relative_pos

# Seed 004, "The cat sat on mat": Q.K^T (printed), d_k = 4, bias scale 0.3. V is not printed;
# it is the V that reproduces the printed standard outputs: one-hot rows and a uniform last row.
RAW = np.array([[0, 2, 1, 1, 1.5], [3, 0, 2, 1, 0.5], [1, 2, 2, 1, 1.5], [1, 1, 0, 2, 1], [1, 1, 1, 1, 1.5]])
V = np.vstack([np.eye(4), np.full((1, 4), 0.5)])
BIAS_TABLE = [[0.0, -0.2079, -0.3296, -0.4159, -0.4828]]
STANDARD = [
    [0.1095, 0.2976, 0.1805, 0.1805, 0.2318],
    [0.4026, 0.0898, 0.2442, 0.1481, 0.1153],
    [0.1519, 0.2505, 0.2505, 0.1519, 0.1951],
    [0.1903, 0.1903, 0.1154, 0.3137, 0.1903],
    [0.1892, 0.1892, 0.1892, 0.1892, 0.2430],
]
BIASED = [
    [0.1473, 0.3253, 0.1747, 0.1603, 0.1924],
    [0.4099, 0.1126, 0.2486, 0.1335, 0.0954],
    [0.1321, 0.2460, 0.3029, 0.1492, 0.1697],
    [0.1523, 0.1660, 0.1137, 0.3805, 0.1875],
    [0.1508, 0.1612, 0.1758, 0.1985, 0.3138],
]
DIFFERENCE = [
    [0.0378, 0.0276, -0.0058, -0.0203, -0.0394],
    [0.0073, 0.0228, 0.0044, -0.0146, -0.0200],
    [-0.0198, -0.0045, 0.0524, -0.0027, -0.0254],
    [-0.0380, -0.0243, -0.0017, 0.0668, -0.0028],
    [-0.0385, -0.0280, -0.0135, 0.0092, 0.0708],
]
BIASED_SCORES = [
    [0.0000, 0.7921, 0.1704, 0.0841, 0.2672],
    [1.2921, 0.0000, 0.7921, 0.1704, -0.1659],
    [0.1704, 0.7921, 1.0000, 0.2921, 0.4204],
    [0.0841, 0.1704, -0.2079, 1.0000, 0.2921],
    [0.0172, 0.0841, 0.1704, 0.2921, 0.7500],
]
STANDARD_OUT = [
    [0.2254, 0.4135, 0.2964, 0.2964],
    [0.4602, 0.1475, 0.3018, 0.2058],
    [0.2495, 0.3481, 0.3481, 0.2495],
    [0.2854, 0.2854, 0.2106, 0.4089],
    [0.3108, 0.3108, 0.3108, 0.3108],
]


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
