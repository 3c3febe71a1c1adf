"""The drafter's feed-forward block: the Pallas kernel in interpret mode against the reference (row counts across
row tiles, several inner tiles), the reference against the model's own layer math, what the kernel refuses, the
dispatch point, the gradient, and the drafter through it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_drafter_and_inputs

from ddtree_jax.models import layers
from pallas_kernels import dispatch, drafter_ffn
from pallas_kernels.dispatch import Kernels
from pallas_kernels.drafter_ffn import drafter_ffn_pallas, unsupported
from pallas_kernels.reference import DrafterFFNWeights, drafter_ffn_reference, rms_norm

EPS = 1e-6
MODES = ("reference", "interpret")


def ffn_inputs(
    rng: np.random.Generator, rows: int, hidden: int, inner: int, dtype
) -> tuple[jax.Array, DrafterFFNWeights]:
    """x `[rows, hidden]` and weights scaled so every product is of order one."""

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    w = DrafterFFNWeights(
        normal((hidden,), 0.1) + 1,
        normal((hidden, inner), hidden**-0.5),
        normal((hidden, inner), hidden**-0.5),
        normal((inner, hidden), inner**-0.5),
    )
    return normal((rows, hidden), 2.0), w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("rows", "hidden", "inner"), [(1, 64, 96), (9, 48, 96), (17, 64, 384), (65, 192, 96), (130, 64, 384)]
)
def test_kernel_equals_the_reference(rows, hidden, inner, dtype):
    """Rows 1-130 (one partial row tile up to three row tiles of 64); hidden 48 (3 steps of 16), 64 (one step) and
    192 (3 steps of 64); inner 96 (3 tiles of 32) and 384 (3 of 128).
    The partials sum in another order than the reference's one product, so f32 agrees to rounding; in bf16 both
    round the same SwiGLU to bf16, so they agree to f32 rounding too, bar a SwiGLU value on a rounding boundary."""
    x, w = ffn_inputs(np.random.default_rng(rows), rows, hidden, inner, dtype)
    got = drafter_ffn_pallas(x, w, EPS, interpret=True)
    want = drafter_ffn_reference(x, w, EPS)
    assert got.dtype == jnp.float32 and got.shape == (rows, hidden)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)


def test_partials_are_one_per_inner_tile():
    x, w = ffn_inputs(np.random.default_rng(), 20, 32, 384, jnp.float32)
    partials = drafter_ffn.drafter_ffn_partials(x, w, EPS, interpret=True)
    assert partials.shape == (384 // drafter_ffn.BLOCK_INNER, 20, 32)
    np.testing.assert_allclose(partials.sum(0), drafter_ffn_reference(x, w, EPS), atol=1e-5, rtol=1e-5)


def test_reference_is_the_layer_math():
    """The op is the drafter layer's `swiglu(rms_norm(x))` before its rounding to x.dtype."""
    x, w = ffn_inputs(np.random.default_rng(), 6, 32, 64, jnp.bfloat16)
    want = layers.swiglu(rms_norm(x, w.norm, EPS), w.gate, w.up, w.down)
    got = drafter_ffn_reference(x, w, EPS)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got.astype(x.dtype), np.float32), np.asarray(want, np.float32))


def test_kernel_refuses_what_it_cannot_take():
    x, w = ffn_inputs(np.random.default_rng(), 4, 32, 64, jnp.float32)
    assert unsupported(x, w) == ""
    assert "one dtype" in unsupported(x.astype(jnp.bfloat16), w)
    assert "not [(48,), (32,)" in unsupported(jnp.zeros((4, 48)), w)
    assert "down [I, H]" in unsupported(x, w._replace(down=w.down[:, :16]))
    x24, w24 = ffn_inputs(np.random.default_rng(), 4, 32, 24, jnp.float32)
    assert "multiples of 16, not (32, 24)" in unsupported(x24, w24)
    spec = jax.ShapeDtypeStruct
    big = DrafterFFNWeights(
        spec((512,), jnp.bfloat16), *[spec((512, 4096), jnp.bfloat16)] * 2, spec((4096, 512), jnp.bfloat16)
    )
    assert "at most" in unsupported(spec((8, 512), jnp.bfloat16), big)
    with pytest.raises(ValueError, match="multiples of 16"):
        drafter_ffn_pallas(x24, w24, EPS, interpret=True)


def test_the_mini_and_k26_drafters():
    """The shipped mini drafter (hidden 256, inner 1536) takes the kernel; K2.6's (hidden 7168) runs the reference."""
    spec = jax.ShapeDtypeStruct

    def shapes(hidden, inner):
        w = DrafterFFNWeights(
            spec((hidden,), jnp.bfloat16),
            *[spec((hidden, inner), jnp.bfloat16)] * 2,
            spec((inner, hidden), jnp.bfloat16),
        )
        return spec((256, hidden), jnp.bfloat16), w

    assert unsupported(*shapes(256, 1536)) == ""
    assert unsupported(*shapes(7168, 18432))


def test_dispatch_runs_the_kernel_or_the_reference_by_mode():
    x, w = ffn_inputs(np.random.default_rng(), 2 * 4, 32, 96, jnp.float32)
    x = x.reshape(2, 4, 32)
    want = drafter_ffn_reference(x, w, EPS)
    for mode in ("auto", "reference", "interpret"):  # auto: the reference on this CPU
        got = dispatch.drafter_ffn(Kernels().with_mode(mode, op="drafter_ffn"), x, w, EPS)
        assert got.shape == x.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    w24 = w._replace(gate=w.gate[:, :24], up=w.up[:, :24], down=w.down[:24])
    assert dispatch.drafter_ffn(Kernels(), x, w24, EPS).shape == x.shape  # auto: the reference
    with pytest.raises(ValueError, match="multiples of 16"):
        dispatch.drafter_ffn(Kernels().with_mode("interpret"), x, w24, EPS)


def test_every_mode_selects_the_drafter_ffn_op():
    assert Kernels().with_mode("reference").drafter_ffn == "reference"
    assert Kernels().with_mode("reference", op="drafter_ffn").drafter_attention == "auto"
    assert Kernels.from_env({"DDTREE_KERNELS": "auto,drafter_ffn=reference"}).drafter_ffn == "reference"


def test_kernel_gradient_is_the_references():
    """The drafter trains through the kernel path: its gradient (w.r.t. x and the weights) is the reference's."""
    rng = np.random.default_rng()
    x, w = ffn_inputs(rng, 12, 32, 96, jnp.float32)
    probe = jnp.asarray(rng.standard_normal((12, 32)), jnp.float32)

    def loss(mode, x, w):
        return jnp.sum(dispatch.drafter_ffn(Kernels().with_mode(mode), x, w, EPS) * probe)

    grads = {mode: jax.jit(jax.grad(functools.partial(loss, mode), (0, 1)))(x, w) for mode in MODES}
    got, want = (jax.tree.leaves(grads[mode]) for mode in ("interpret", "reference"))
    for g, r in zip(got, want, strict=True):
        assert float(jnp.abs(r).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_drafter_output_is_the_same_through_the_kernel(dtype):
    """A 2-layer drafter (inner 128) with its FFN blocks in the kernel (interpret mode) against the reference."""
    drafter, args = tiny_drafter_and_inputs(np.random.default_rng(), dtype, intermediate_size=128)
    out = {mode: drafter(*args, kernels=Kernels().with_mode(mode, "drafter_ffn")) for mode in MODES}
    got, want = out["interpret"], out["reference"]
    assert got.dtype == dtype and np.isfinite(np.asarray(got, np.float32)).all()
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
