"""The row-invariant RMS norm kernel (`pallas_kernels/exact_norm.py`) in interpret mode: a row's result is the same
bits in calls of 1, 9, 17 and 65 rows; it matches `reference.rms_norm`; without `exact` dispatch is the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from row_invariance import PROBES, probe_outputs, rows_invariant

from pallas_kernels import dispatch, exact_norm, reference
from pallas_kernels.dispatch import Kernels

EXACT = Kernels(exact=True, rms_norm="interpret")
EPS = 1e-6


def normal(rng, shape, dtype, scale: float = 3.0) -> np.ndarray:
    return (scale * np.asarray(rng.standard_normal(shape), np.float32)).astype(dtype)


@pytest.mark.parametrize("hidden", [256, 576, 2304])  # one tile; an overlapping tail; several tiles and a tail
def test_rows_are_bitwise_invariant_and_match_the_reference(hidden):
    rng = np.random.default_rng(1)
    w = normal(rng, (hidden,), jnp.bfloat16, 0.5)

    def fn(x):
        return dispatch.rms_norm(EXACT, x, w, EPS)

    probes = (normal(rng, (PROBES, hidden), jnp.bfloat16),)
    assert rows_invariant(probe_outputs(fn, probes, lambda m: (normal(rng, (m, hidden), jnp.bfloat16),), rng))
    x = normal(rng, (2, 5, hidden), jnp.bfloat16)
    out = fn(x)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    want = np.asarray(reference.rms_norm(x, w, EPS), np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", [EXACT, Kernels()])
def test_norms_the_first_h_columns_of_wider_rows(mode):
    """x wider than the gain (MLA's kv_a product, whose first columns are c_kv): the norm of its first H columns,
    bitwise that of the sliced x, with the kernel (reading them in place) and with the reference."""
    rng = np.random.default_rng(2)
    x, w = normal(rng, (2, 5, 96), jnp.bfloat16), normal(rng, (64,), jnp.bfloat16, 0.5)
    out = dispatch.rms_norm(mode, x, w, EPS)
    assert out.shape == (2, 5, 64)
    assert np.array_equal(np.asarray(out), np.asarray(dispatch.rms_norm(mode, x[..., :64], w, EPS)))
    with pytest.raises(ValueError, match="fewer"):
        exact_norm.rms_norm_pallas(x[..., :32], w, EPS, interpret=True)


def test_the_check_catches_a_tile_chosen_from_m():
    """Control: the kernel's pass-1 tile halved for calls of one row tile, as an M-dependent strategy would: the
    same rows then sum their squares in another order, and the check fails. Seeded: a single row's two orders
    round to the same sum now and then."""
    rng = np.random.default_rng(0)
    hidden = 2304
    w = normal(rng, (hidden,), jnp.float32, 0.5)

    def by_m(x):
        wide = exact_norm.MAX_BLOCK_H if x.shape[0] > exact_norm.BLOCK_M else exact_norm.MAX_BLOCK_H // 2
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(exact_norm, "MAX_BLOCK_H", wide)
            return exact_norm.rms_norm_pallas.__wrapped__(x, w, EPS, interpret=True)

    probes = (normal(rng, (PROBES, hidden), jnp.float32),)
    assert not rows_invariant(probe_outputs(by_m, probes, lambda m: (normal(rng, (m, hidden), jnp.float32),), rng))


def test_without_exact_dispatch_is_the_reference():
    plain = Kernels(rms_norm="interpret")
    x, w = jax.ShapeDtypeStruct((2, 3, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64,), jnp.bfloat16)
    got = jax.make_jaxpr(lambda a, b: dispatch.rms_norm(plain, a, b, EPS))(x, w)
    assert str(got) == str(jax.make_jaxpr(lambda a, b: reference.rms_norm(a, b, EPS))(x, w))
