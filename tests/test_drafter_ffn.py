"""The drafter's kernels after its attention: the post-attention norm, gate and up and SwiGLU in one Pallas kernel
(interpret mode) against the reference, the inputs it refuses, the dispatch point (its gradient the reference's); the
residual updates (o_proj, down) with the add in the product's kernel; and the drafter through both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_drafter_and_inputs

from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels
from pallas_kernels.drafter_swiglu import drafter_swiglu_pallas, unsupported
from pallas_kernels.reference import DrafterSwigluWeights, drafter_swiglu_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
EPS = 1e-6


def inputs(rng: np.random.Generator, shape: tuple[int, ...], inner: int, dtype) -> tuple:
    """Random x `shape` (hidden last) and weights of a layer with `inner` inner columns, scaled like trained ones."""
    hidden = shape[-1]

    def normal(*s, scale=1.0):
        return jnp.asarray(rng.standard_normal(s) * scale, dtype)

    w = DrafterSwigluWeights(
        1 + normal(hidden, scale=0.1),
        normal(hidden, inner, scale=hidden**-0.5),
        normal(hidden, inner, scale=hidden**-0.5),
    )
    return normal(*shape), w


def assert_close(got, want, dtype) -> None:
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("shape", "inner", "dtype"),
    [
        ((32, 8, 256), 1536, jnp.bfloat16),  # the shipped drafter at 32 rows: 4 row tiles of 64, 24 inner tiles
        ((100, 64), 96, jnp.bfloat16),  # a partial last row tile; inner tiles of 32
        ((3, 5, 128), 48, jnp.float32),  # 15 rows in one tile of 16; inner tiles of 16
        ((1, 1, 16), 16, jnp.float32),  # the least sizes
    ],
)
def test_kernel_matches_reference(shape, inner, dtype):
    x, w = inputs(np.random.default_rng(0), shape, inner, dtype)
    got = drafter_swiglu_pallas(x, w, EPS, interpret=True)
    want = drafter_swiglu_reference(x, w, EPS)
    assert got.shape == (*shape[:-1], inner) and got.dtype == dtype
    assert_close(got, want, dtype)


def test_rows_are_independent_of_the_call():
    """A row's output does not depend on how many rows share the call or where it sits in its tile."""
    x, w = inputs(np.random.default_rng(1), (70, 64), 64, jnp.bfloat16)
    whole = drafter_swiglu_pallas(x, w, EPS, interpret=True)
    for lo, hi in ((0, 1), (3, 20), (64, 70)):
        part = drafter_swiglu_pallas(x[lo:hi], w, EPS, interpret=True)
        np.testing.assert_array_equal(np.asarray(part, np.float32), np.asarray(whole[lo:hi], np.float32))


@pytest.mark.parametrize(
    ("shape", "inner", "dtype", "why"),
    [
        ((4, 256), 1536, jnp.float32, "power-of-two hidden size of at least 16 whose tiles take at most"),
        ((4, 512), 64, jnp.bfloat16, "power-of-two hidden size of at least 16 whose tiles take at most"),
        ((4, 96), 64, jnp.bfloat16, "power-of-two hidden size"),
        ((4, 64), 40, jnp.bfloat16, "inner size in multiples of 16, not 40"),
    ],
)
def test_unsupported_inputs_are_named(shape, inner, dtype, why):
    x, w = inputs(np.random.default_rng(2), shape, inner, dtype)
    assert why in unsupported(x, w)
    with pytest.raises(ValueError, match=why):
        drafter_swiglu_pallas(x, w, EPS, interpret=True)


def test_mixed_dtypes_and_shapes_are_refused():
    x, w = inputs(np.random.default_rng(3), (4, 64), 64, jnp.bfloat16)
    assert "one dtype" in unsupported(x.astype(jnp.float32), w)
    assert "x [..., H], norm [H], gate and up [H, I]" in unsupported(x, w._replace(up=w.up[:, :32]))


def test_dispatch_runs_the_reference_on_cpu_and_the_kernel_when_asked():
    x, w = inputs(np.random.default_rng(4), (2, 8, 64), 96, jnp.float32)
    want = drafter_swiglu_reference(x, w, EPS)
    np.testing.assert_array_equal(dispatch.drafter_swiglu(Kernels(), x, w, EPS), want)
    assert_close(
        dispatch.drafter_swiglu(Kernels().with_mode("interpret", "drafter_swiglu"), x, w, EPS), want, jnp.float32
    )


def test_kernel_gradient_is_the_reference_gradient():
    x, w = inputs(np.random.default_rng(5), (2, 8, 64), 96, jnp.float32)

    def loss(mode):
        kernels = Kernels().with_mode(mode, "drafter_swiglu")
        return jax.grad(lambda x, w: jnp.sum(dispatch.drafter_swiglu(kernels, x, w, EPS) ** 2), argnums=(0, 1))(x, w)

    for got, want in zip(jax.tree.leaves(loss("interpret")), jax.tree.leaves(loss("reference")), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_residual_update_matches_the_plain_expression(dtype):
    rng = np.random.default_rng(6)
    residual, x = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((3, 8, 64), (3, 8, 96)))
    w = jnp.asarray(rng.standard_normal((96, 64)) * 96**-0.5, dtype)
    want = residual + jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)
    for mode in ("reference", "interpret"):
        got = dispatch.drafter_residual(Kernels().with_mode(mode, "drafter_residual"), residual, x, w)
        assert got.dtype == dtype
        assert_close(got, want, dtype)


def test_residual_update_gradient_is_the_plain_expression_gradient():
    rng = np.random.default_rng(7)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 8, 32), (2, 8, 48), (48, 32))]

    def grads(mode):
        kernels = Kernels().with_mode(mode, "drafter_residual")
        return jax.grad(lambda *a: jnp.sum(dispatch.drafter_residual(kernels, *a) ** 2), argnums=(0, 1, 2))(*args)

    for got, want in zip(grads("interpret"), grads("reference"), strict=True):  # the forwards' K orders differ
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_drafter_output_is_the_same_through_the_kernels(dtype):
    """The drafter with its SwiGLU and residual updates in the kernels (interpret mode) against the reference."""
    drafter, args = tiny_drafter_and_inputs(np.random.default_rng(1), dtype, intermediate_size=128)
    modes = {"interpret": Kernels().with_mode("interpret", "drafter_swiglu").with_mode("interpret", "drafter_residual")}
    modes["reference"] = Kernels().with_mode("reference")
    out = {mode: drafter(*args, kernels=kernels) for mode, kernels in modes.items()}
    got, want = out["interpret"], out["reference"]
    assert got.dtype == dtype and np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5 * TOL[dtype], rtol=TOL[dtype]
    )
