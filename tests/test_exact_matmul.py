"""The row-invariant matmul kernels (`pallas_kernels/exact_matmul.py`) in interpret mode: a row's result is the same
bits in calls of 1, 9, 17 and 65 rows; it matches jnp.dot (with the norm prologue: `reference.rms_norm` then
jnp.dot); o_proj's residual epilogue is XLA's add; without `exact` dispatch is the plain expression."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from row_invariance import PROBES, SIZES, probe_outputs, rows_invariant

from pallas_kernels import dispatch, exact_matmul, reference
from pallas_kernels.dispatch import Kernels

EXACT = Kernels(exact=True, matmul="interpret")
K, N = 200, 97  # neither a power of two: a K tail tile and an overlapping last N tile
EPS = 1e-6


def normal(rng, shape, dtype) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape), np.float32).astype(dtype)


def check_rows(fn, k: int, dtype, rng, lead: tuple[int, ...] = ()) -> list[np.ndarray]:
    """`probe_outputs` of fn on rows `[*lead, k]` of `dtype`."""
    probes = (normal(rng, (PROBES, *lead, k), dtype),)
    return probe_outputs(fn, probes, lambda m: (normal(rng, (m, *lead, k), dtype),), rng)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_rows_are_bitwise_invariant_and_match_jnp_dot(dtype):
    rng = np.random.default_rng(1)
    w = normal(rng, (K, N), dtype)
    outs = check_rows(lambda x: dispatch.matmul(EXACT, x, w, preferred_element_type=jnp.float32), K, dtype, rng)
    assert rows_invariant(outs)
    x = normal(rng, (SIZES[-1], K), dtype)
    out = dispatch.matmul(EXACT, x, w)
    assert out.dtype == dtype and out.shape == (SIZES[-1], N)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_head_matmul_rows_are_bitwise_invariant_and_match_einsum(dtype, transposed):
    """MLA's per-head products: `bnhp,hpc->bnhc` (w_uk) and `bnhc,hvc->bnhv` (w_uv, transposed)."""
    rng = np.random.default_rng(2)
    heads, k, n = 3, 48, 40
    w = normal(rng, (heads, n, k) if transposed else (heads, k, n), dtype)

    def fn(x):
        return dispatch.head_matmul(EXACT, x, w, transposed=transposed, preferred_element_type=jnp.float32)

    assert rows_invariant(check_rows(fn, k, dtype, rng, lead=(heads,)))
    x = normal(rng, (2, 5, heads, k), dtype)
    spec = "bnhk,hdk->bnhd" if transposed else "bnhk,hkd->bnhd"
    want = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(fn(x), np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [24, N])  # 24: below bf16's column tile (32), above f32's (16); 97: overlapping tails
def test_normed_matmul_rows_are_bitwise_invariant_and_match_the_reference(dtype, n):
    """The norm prologue (K = 200: a tail tile in both the sum of squares and the product) equals
    `reference.rms_norm` then the product, and keeps a row's bits in calls of any size."""
    rng = np.random.default_rng(3)
    w, gain = normal(rng, (K, n), dtype), (1 + 0.5 * normal(rng, (K,), np.float32)).astype(dtype)

    def fn(x):
        return dispatch.normed_matmul(EXACT, x, gain, EPS, w, preferred_element_type=jnp.float32)[0]

    assert rows_invariant(check_rows(fn, K, dtype, rng))
    x = 3 * normal(rng, (2, 5, K), np.float32).astype(dtype)
    (out,) = dispatch.normed_matmul(EXACT, x, gain, EPS, w)
    assert out.dtype == dtype and out.shape == (2, 5, n)
    want = np.asarray(reference.rms_norm(x, gain, EPS), np.float64) @ np.asarray(w, np.float64)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("n", [24, N])
def test_residual_matmul_adds_in_the_kernel_as_xla_would(n):
    """o_proj's epilogue: `residual + (x @ w).astype(bf16)` with the add inside the kernel is bitwise the product
    kernel's output added by XLA, keeps a row's bits in calls of any size, and refuses a residual of another shape."""
    rng = np.random.default_rng(4)
    bf16 = jnp.bfloat16
    w = normal(rng, (K, n), bf16)
    x, r = normal(rng, (2, 5, K), bf16), 4 * normal(rng, (2, 5, n), np.float32).astype(bf16)
    out = dispatch.residual_matmul(EXACT, r, x, w)
    want = r + dispatch.matmul(EXACT, x, w, preferred_element_type=jnp.float32).astype(bf16)
    assert out.dtype == bf16 and np.array_equal(np.asarray(out), np.asarray(want))
    assert rows_invariant(check_rows(lambda a: dispatch.residual_matmul(EXACT, a[:, :n], a, w), K, bf16, rng))
    for wrong in (r[..., :-1], r.reshape(5, 2, n)):  # a column short; rows of another layout
        with pytest.raises(ValueError, match="residual"):
            dispatch.residual_matmul(EXACT, wrong, x, w)


@pytest.mark.parametrize("k,n", [(8, 8), (16, 200), (130, 16)])
def test_dims_below_and_off_the_tile(k, n):
    """Dims below 16 (the router of a model with 8 experts) are zero-padded; others take overlapping tail tiles.
    The norm prologue averages the squares over the unpadded K."""
    rng = np.random.default_rng(5)
    x, w, gain = normal(rng, (3, k), np.float32), normal(rng, (k, n), np.float32), normal(rng, (k,), np.float32)
    out = exact_matmul.matmul_pallas(x, w, jnp.float32, interpret=True)
    np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    out = exact_matmul.matmul_pallas(x, w, jnp.float32, norm=(gain, EPS), interpret=True)
    want = np.asarray(reference.rms_norm(x, gain, EPS), np.float64) @ w
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [8, 64])
def test_head_matmul_reads_the_first_k_columns_of_wider_rows(k):
    """x wider than w's K (MLA's q, whose first columns are q_nope): the product of its first K columns, bitwise
    that of the sliced x, read in place (K >= 16) or sliced first (K below 16, whose padding must be zeros)."""
    rng = np.random.default_rng(6)
    x, w = normal(rng, (5, 3, k + 24), jnp.bfloat16), normal(rng, (3, k, 40), jnp.bfloat16)
    product = lambda a: dispatch.head_matmul(EXACT, a, w, preferred_element_type=jnp.float32)  # noqa: E731
    assert np.array_equal(np.asarray(product(x)), np.asarray(product(x[..., :k])))
    with pytest.raises(ValueError, match="fewer"):
        product(x[..., : k // 2])
    want = np.einsum("mhk,hkn->mhn", np.asarray(x[..., :k], np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(product(x)), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_the_check_catches_a_tiling_chosen_from_m():
    """Control: the same kernel with its K step chosen from M (16 for a single row tile, else 64), as an M-dependent
    tiling would, fails the check; so does XLA's CPU dot in bf16, whose 1-row product rounds differently."""
    rng = np.random.default_rng(7)
    w = normal(rng, (K, N), jnp.float32)

    def by_m(x):
        tile = exact_matmul.Tiling(32, 16 if x.shape[0] <= exact_matmul.BLOCK_M else 64)
        return exact_matmul.head_matmul_tiled(x[:, None], w[None], jnp.dtype(jnp.float32), False, tile, True)[:, 0]

    assert not rows_invariant(check_rows(by_m, K, jnp.float32, rng))
    w16 = w.astype(jnp.bfloat16)
    xla = jax.jit(lambda x: jnp.dot(x, w16, preferred_element_type=jnp.float32))
    assert not rows_invariant(check_rows(xla, K, jnp.bfloat16, rng))


def test_without_exact_dispatch_is_the_plain_expression():
    """exact=False (whatever the matmul mode): the jaxpr of `jnp.dot` / the model's einsums, no kernel."""
    plain = Kernels(matmul="interpret")
    x, w = jax.ShapeDtypeStruct((2, 3, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    q, w_uk = jax.ShapeDtypeStruct((2, 3, 4, 16), jnp.bfloat16), jax.ShapeDtypeStruct((4, 16, 32), jnp.bfloat16)
    o_lat, w_uv = jax.ShapeDtypeStruct((2, 3, 4, 32), jnp.bfloat16), jax.ShapeDtypeStruct((4, 16, 32), jnp.bfloat16)
    f32 = jnp.float32
    pairs = [
        ((x, w), lambda a, b: jnp.dot(a, b), lambda a, b: dispatch.matmul(plain, a, b)),
        (
            (x, w),
            lambda a, b: jnp.dot(a, b, preferred_element_type=f32),
            lambda a, b: dispatch.matmul(plain, a, b, preferred_element_type=f32),
        ),
        ((q, w_uk), lambda a, b: jnp.einsum("bnhp,hpc->bnhc", a, b), lambda a, b: dispatch.head_matmul(plain, a, b)),
        (
            (o_lat, w_uv),
            lambda a, b: jnp.einsum("bnhc,hvc->bnhv", a, b, preferred_element_type=f32),
            lambda a, b: dispatch.head_matmul(plain, a, b, transposed=True, preferred_element_type=f32),
        ),
    ]
    residual = jax.ShapeDtypeStruct((2, 3, 32), jnp.bfloat16)
    pairs.append(
        (
            (residual, x, w),
            lambda r, a, b: r + jnp.dot(a, b, preferred_element_type=f32).astype(r.dtype),
            lambda r, a, b: dispatch.residual_matmul(plain, r, a, b),
        )
    )
    for args, today, dispatched in pairs:
        assert str(jax.make_jaxpr(dispatched)(*args)) == str(jax.make_jaxpr(today)(*args))
    gain = jax.ShapeDtypeStruct((64,), jnp.bfloat16)  # one norm for both products

    def today(a, g, b):
        normed = reference.rms_norm(a, g, EPS)
        return jnp.dot(normed, b, preferred_element_type=f32), jnp.dot(normed, b, preferred_element_type=f32)

    dispatched = lambda a, g, b: dispatch.normed_matmul(plain, a, g, EPS, b, b, preferred_element_type=f32)
    assert str(jax.make_jaxpr(dispatched)(x, gain, w)) == str(jax.make_jaxpr(today)(x, gain, w))
