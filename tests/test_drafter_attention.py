"""The drafter's attention: context cache and block as two parts merged by log-sum-exp (the reference) and the Pallas
kernel in interpret mode, against the formula that concatenates them (the oracle written here), and the drafter
through the dispatch point."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx

from ddtree_jax.models.dflash import DFlashDrafter
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels
from pallas_kernels.drafter_attention import drafter_attention_pallas
from pallas_kernels.drafter_attention import unsupported as drafter_attention_unsupported
from pallas_kernels.reference import drafter_attention_reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
MODES = ("reference", "interpret")


def assert_close(got, want, dtype, factor: float = 1.0) -> None:
    """Equal within `dtype`'s tolerance, absolute (times `factor`) and relative: in bf16 one rounding apart."""
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=factor * tol, rtol=tol)


def concatenated(q, ctx_k, ctx_v, ctx_len, block_k, block_v, scale):
    """The oracle: one softmax over [context cache ++ block] `[B, L+S]`, context slots >= ctx_len masked."""
    b, s, nh, hd = q.shape
    kvh = ctx_k.shape[2]
    keys = jnp.concatenate([ctx_k, block_k], axis=1)
    vals = jnp.concatenate([ctx_v, block_v], axis=1)
    ctx_visible = jnp.arange(ctx_k.shape[1])[None, :] < ctx_len[:, None]
    visible = jnp.concatenate([ctx_visible, jnp.ones((b, s), bool)], axis=1)[:, None, None, None, :]
    qg = q.reshape(b, s, kvh, nh // kvh, hd)
    sc = jnp.einsum("bskgd,blkd->bkgsl", qg, keys, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(visible, sc, -jnp.inf), axis=-1).astype(vals.dtype)
    o = jnp.einsum("bkgsl,blkd->bskgd", p, vals, preferred_element_type=jnp.float32)
    return o.astype(q.dtype).reshape(b, s, nh, hd)


def inputs(rng: np.random.Generator, b: int, s: int, length: int, nh: int, kvh: int, hd: int, dtype):
    """Random q, context K/V, block K/V; context lengths cover 0 and the whole allocation."""

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    ctx_len = rng.integers(0, length + 1, b)
    ctx_len[0], ctx_len[-1] = 0, length
    q = normal(b, s, nh, hd)
    return (
        q,
        normal(b, length, kvh, hd),
        normal(b, length, kvh, hd),
        jnp.asarray(ctx_len, jnp.int32),
        *(normal(b, s, kvh, hd) for _ in range(2)),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("nh", "kvh"), [(8, 2), (4, 4), (6, 1)])
def test_split_attention_equals_the_concatenated_one(dtype, nh, kvh):
    rng = np.random.default_rng()
    args = inputs(rng, 5, 8, 37, nh, kvh, 16, dtype)
    got = drafter_attention_reference(*args, 0.25)
    want = concatenated(*args, 0.25)
    assert got.dtype == dtype and got.shape == (5, 8, nh, 16)
    assert np.isfinite(np.asarray(got, np.float32)).all()  # an empty context (ctx_len 0) contributes nothing
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("s", "nh", "kvh", "length"), [(8, 8, 2, 37), (4, 4, 4, 16), (5, 6, 1, 130)])
def test_kernel_equals_the_concatenated_attention(dtype, s, nh, kvh, length):
    """Interpret mode, at layer 1 of a stacked cache; lengths not a multiple of the tile, blocks and row counts
    that need padding."""
    rng = np.random.default_rng()
    q, ck, cv, ctx_len, bk, bv = inputs(rng, 4, s, length, nh, kvh, 16, dtype)
    other = jnp.full_like(ck, 7.0)
    stacked_k, stacked_v = jnp.stack([other, ck, other]), jnp.stack([other, cv, other])
    got = drafter_attention_pallas(q, stacked_k, stacked_v, ctx_len, bk, bv, 0.25, 1, interpret=True)
    want = concatenated(q, ck, cv, ctx_len, bk, bv, 0.25)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype)


def test_dispatch_runs_the_kernel_or_the_reference_by_mode():
    rng = np.random.default_rng()
    q, ck, cv, ctx_len, bk, bv = inputs(rng, 2, 4, 16, 4, 2, 16, jnp.float32)
    args = (q, ck[None], cv[None], ctx_len, bk, bv, 0.25, 0)
    want = np.asarray(concatenated(q, ck, cv, ctx_len, bk, bv, 0.25))
    for mode in ("auto", "reference", "interpret"):  # auto: the reference on this CPU
        got = dispatch.drafter_attention(Kernels().with_mode(mode, op="drafter_attention"), *args)
        assert_close(got, want, jnp.float32)
    q8 = jnp.zeros((2, 4, 4, 8))
    assert "head dim" in drafter_attention_unsupported(q8, ck[None])
    with pytest.raises(ValueError, match="head dim"):
        dispatch.drafter_attention(Kernels().with_mode("interpret"), q8, *args[1:])


def test_kernel_gradient_is_the_references():
    """The drafter trains through the kernel path: its gradient (w.r.t. q, the stacked cache and the block) is the
    reference's."""
    rng = np.random.default_rng()
    q, ck, cv, ctx_len, bk, bv = inputs(rng, 3, 4, 16, 4, 2, 16, jnp.float32)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(mode, q, ck, cv, bk, bv):
        out = dispatch.drafter_attention(Kernels().with_mode(mode), q, ck, cv, ctx_len, bk, bv, 0.25, 1)
        return jnp.sum(out * w)

    stacked = (q, jnp.stack([ck, ck + 1]), jnp.stack([cv, cv - 1]), bk, bv)
    grads = {mode: jax.grad(functools.partial(loss, mode), argnums=(0, 1, 2, 3, 4))(*stacked) for mode in MODES}
    for got, want in zip(grads["interpret"], grads["reference"], strict=True):
        assert float(jnp.abs(want).max()) > 0 and np.isfinite(np.asarray(want)).all()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_context_past_its_length_is_never_seen():
    """Slots >= ctx_len may hold any finite values (stale or never written): the output does not change."""
    rng = np.random.default_rng()
    q, ck, cv, ctx_len, bk, bv = inputs(rng, 3, 4, 20, 4, 2, 8, jnp.float32)
    stale = jnp.arange(20)[None, :, None, None] >= ctx_len[:, None, None, None]
    got = drafter_attention_reference(q, jnp.where(stale, 1e4, ck), jnp.where(stale, -1e4, cv), ctx_len, bk, bv, 0.3)
    want = drafter_attention_reference(q, ck, cv, ctx_len, bk, bv, 0.3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_every_mode_selects_the_drafter_attention_op():
    assert Kernels().with_mode("reference").drafter_attention == "reference"
    assert Kernels().with_mode("reference", op="drafter_attention").mla_attention == "auto"
    assert Kernels.from_env({"DDTREE_KERNELS": "reference"}).drafter_attention == "reference"


def drafter_and_inputs(rng: np.random.Generator, dtype):
    cfg = tiny_dflash_config(tiny_kimi_config(vocab_size=128))  # 2 target layers of features: 2 x hidden
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 20))), dtype=dtype)
    b, ctx = 3, 12
    feats = jnp.asarray(rng.standard_normal((b, ctx, 2 * cfg.hidden_size)), dtype)
    cache_len = jnp.asarray([0, 5, ctx], jnp.int32)
    cache = drafter.append_context(
        drafter.init_cache(b, 16), feats, jnp.arange(ctx)[None].repeat(b, 0), jnp.zeros((b,), jnp.int32)
    )
    embeds = jnp.asarray(rng.standard_normal((b, cfg.block_size, cfg.hidden_size)), dtype)
    positions = cache_len[:, None] + jnp.arange(cfg.block_size)[None, :]
    return drafter, (embeds, positions, cache, cache_len)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_drafter_output_is_that_of_the_concatenated_attention(dtype, monkeypatch):
    """The drafter through `dispatch.drafter_attention` (the reference, and the kernel in interpret mode) against
    the same drafter with the oracle in its place."""
    drafter, args = drafter_and_inputs(np.random.default_rng(), dtype)
    got = {mode: drafter(*args, kernels=Kernels().with_mode(mode)) for mode in ("reference", "interpret")}
    monkeypatch.setattr(
        dispatch,
        "drafter_attention",
        lambda kernels, q, ck, cv, ctx_len, bk, bv, scale, layer: concatenated(
            q, ck[layer], cv[layer], ctx_len, bk, bv, scale
        ),
    )
    want = np.asarray(drafter(*args), np.float32)
    for out in got.values():
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert_close(out, want, dtype, 5.0)
