"""The split merge (`mla_combine`) against a float64 NumPy merge written from the definition, with empty splits
(lse = -inf), a row no split saw (NaN) and padded rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_combine import merge_splits


def numpy_merge(o_part: np.ndarray, lse: np.ndarray, rows: int) -> np.ndarray:
    """Row by row: out = sum_s exp(lse_s) o_s / sum_s exp(lse_s), over the splits with a finite lse (NaN if none)."""
    b, s, _, dv = o_part.shape
    out = np.full((b, rows, dv), np.nan)
    for bb in range(b):
        for r in range(rows):
            seen = [k for k in range(s) if np.isfinite(lse[bb, k, r])]
            if seen:
                top = max(lse[bb, k, r] for k in seen)
                w = np.array([np.exp(lse[bb, k, r] - top) for k in seen])
                out[bb, r] = (w[:, None] * o_part[bb, seen, r].astype(np.float64)).sum(0) / w.sum()
    return out


def random_partials(rng: np.random.Generator, b: int, s: int, rows_pad: int, dv: int = 512):
    """bf16 partials `[B, S, R_pad, dv]` and f32 lse `[B, S, R_pad]` with about a fifth of the (split, row) pairs
    empty (lse -inf, partial 0) and row 1 of sequence 0 seen by no split."""
    o_part = rng.standard_normal((b, s, rows_pad, dv)).astype(np.float32)
    lse = (rng.standard_normal((b, s, rows_pad)) * 4).astype(np.float32)
    empty = rng.random((b, s, rows_pad)) < 0.2
    empty[0, :, 1] = True
    lse[empty] = -np.inf
    o_part[empty] = 0.0
    o_bf16 = jnp.asarray(o_part, jnp.bfloat16)
    return o_bf16, jnp.asarray(lse), np.asarray(o_bf16.astype(jnp.float32), np.float64), lse.astype(np.float64)


@pytest.mark.parametrize(("b", "s", "rows", "rows_pad"), [(2, 5, 64, 64), (1, 3, 136, 192), (2, 1, 40, 64)])
def test_merge_matches_numpy(b, s, rows, rows_pad):
    rng = np.random.default_rng(1)
    o_part, lse, o64, lse64 = random_partials(rng, b, s, rows_pad)
    out = merge_splits(o_part, lse, rows, jnp.bfloat16)
    assert out.shape == (b, rows, 512) and out.dtype == jnp.bfloat16
    want = numpy_merge(o64, lse64, rows)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    if s > 1:  # one split is passed through unmerged, so its unseen row stays the partial's 0
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want[0, 1]).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-2, atol=1e-2)
