"""The chunk-wise exact top-k (`ddtree_jax.topk`) against a brute-force NumPy ranking and `lax.top_k`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import topk


def brute_force_top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: indices ranked by (value desc, index asc), a Python sort of (-value, index) pairs."""
    rows = x.reshape(-1, x.shape[-1])
    ids = np.array([[i for _, i in sorted((-v, i) for i, v in enumerate(row))][:k] for row in rows])
    ids = ids.reshape(*x.shape[:-1], k)
    return np.take_along_axis(x, ids, -1), ids


@pytest.mark.parametrize(
    ("shape", "k", "chunk"),
    [
        ((2, 7, 4096), 16, 512),
        ((3, 1000), 32, 16),
        ((2, 7, 5003), 64, 512),
        ((4, 300), 8, 8),
        ((3, 77), 77, 4),
        ((5, 9), 3, 512),
        ((3, 700), 16, 0),  # chunk 0: lax.top_k itself
    ],
)
def test_chunked_top_k_is_exact(shape: tuple[int, ...], k: int, chunk: int) -> None:
    """Values and indices bit for bit: many exact ties (values from 6 levels), -inf entries, an all -inf row, row
    lengths that leave a short last chunk and need two or three rounds."""
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 3, shape).astype(np.float32) + rng.choice([0.0, 0.5], shape).astype(np.float32)
    x[rng.random(shape) < 0.3] = -np.inf
    x.reshape(-1, shape[-1])[0] = -np.inf
    got_v, got_i = jax.jit(lambda a: topk.top_k(a, k, chunk))(jnp.asarray(x))
    want_v, want_i = brute_force_top_k(x, k)
    assert got_i.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got_v), want_v)
    np.testing.assert_array_equal(np.asarray(got_i), want_i)
    lax_v, lax_i = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(lax_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(lax_v))


def test_k_longer_than_the_row_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds the row length"):
        topk.top_k(jnp.zeros((2, 5)), 6, 512)
