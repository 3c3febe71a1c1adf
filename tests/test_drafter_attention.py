"""The drafter's attention block: the reference's attention (context cache and block as two parts merged by
log-sum-exp) against the formula that concatenates them (the oracle written here), the reference block against the
model's own layer math, the fused Pallas kernel in interpret mode against the reference block, and the drafter
through the dispatch point."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_drafter_and_inputs

from ddtree_jax.models import layers
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels
from pallas_kernels.drafter_attention import drafter_attention_pallas, project_in_kernel, unsupported
from pallas_kernels.reference import DrafterAttentionWeights, block_attention, drafter_attention_reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
MODES = ("reference", "interpret")
EPS = 1e-6
LAYER = 1  # of 3 stacked layers: the block reads the middle one
INV_FREQ = layers.yarn_inv_freq(32, 50000.0, None)


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


def context_lengths(rng: np.random.Generator, b: int, length: int) -> jax.Array:
    """Ragged lengths in [0, length]; the first row's context is empty, the last row's the whole allocation."""
    ctx_len = rng.integers(0, length + 1, b)
    ctx_len[0], ctx_len[-1] = 0, length
    return jnp.asarray(ctx_len, jnp.int32)


def attention_inputs(rng: np.random.Generator, b: int, s: int, length: int, nh: int, kvh: int, hd: int, dtype):
    """Random q, context K/V, block K/V of one attention."""

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    ctx_len = context_lengths(rng, b, length)
    q = normal(b, s, nh, hd)
    return (
        q,
        normal(b, length, kvh, hd),
        normal(b, length, kvh, hd),
        ctx_len,
        normal(b, s, kvh, hd),
        normal(b, s, kvh, hd),
    )


def block_inputs(rng: np.random.Generator, b: int, s: int, length: int, nh: int, kvh: int, dtype, hidden: int = 64):
    """The arguments of one attention block (head dim 32, 3 stacked layers): x, weights, caches, lengths, RoPE
    tables of positions ctx_len + 0..S-1."""

    def normal(*shape, scale=1.0, shift=0.0):
        return jnp.asarray(rng.standard_normal(shape) * scale + shift, dtype)

    hd = 32
    weights = DrafterAttentionWeights(
        input_norm=normal(hidden, scale=0.2, shift=1.0),
        q_proj=normal(hidden, nh * hd, scale=hidden**-0.5),
        q_norm=normal(hd, scale=0.2, shift=1.0),
        k_norm=normal(hd, scale=0.2, shift=1.0),
        kv_proj=normal(3, 2, hidden, kvh * hd, scale=hidden**-0.5),
    )
    ctx_len = context_lengths(rng, b, length)
    cos, sin = layers.rope_cos_sin(ctx_len[:, None] + jnp.arange(s)[None, :], INV_FREQ)
    cache = [normal(3, b, length, kvh, hd) for _ in range(2)]
    return normal(b, s, hidden), weights, *cache, ctx_len, cos, sin


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("nh", "kvh"), [(8, 2), (4, 4), (6, 1)])
def test_split_attention_equals_the_concatenated_one(dtype, nh, kvh):
    rng = np.random.default_rng(1)
    args = attention_inputs(rng, 5, 8, 37, nh, kvh, 16, dtype)
    got = block_attention(*args, 0.25)
    want = concatenated(*args, 0.25)
    assert got.dtype == dtype and got.shape == (5, 8, nh, 16)
    assert np.isfinite(np.asarray(got, np.float32)).all()  # an empty context (ctx_len 0) contributes nothing
    assert_close(got, want, dtype, 2.0)


def test_context_past_its_length_is_never_seen():
    """Slots >= ctx_len may hold any finite values (stale or never written): the output does not change."""
    rng = np.random.default_rng(2)
    q, ck, cv, ctx_len, bk, bv = attention_inputs(rng, 3, 4, 20, 4, 2, 8, jnp.float32)
    stale = jnp.arange(20)[None, :, None, None] >= ctx_len[:, None, None, None]
    got = block_attention(q, jnp.where(stale, 1e4, ck), jnp.where(stale, -1e4, cv), ctx_len, bk, bv, 0.3)
    want = block_attention(q, ck, cv, ctx_len, bk, bv, 0.3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_block_is_the_models_layer_math(dtype):
    """The reference block is the drafter's former per-layer code: `layers.rms_norm`, `layers.rope_half` at the
    positions, then the two-part attention."""
    rng = np.random.default_rng(3)
    x, w, ck, cv, ctx_len, cos, sin = block_inputs(rng, 2, 4, 16, 4, 2, dtype)
    positions = ctx_len[:, None] + jnp.arange(4)[None, :]
    a = layers.rms_norm(x, w.input_norm, EPS)
    heads = lambda t: t.reshape(*t.shape[:-1], -1, 32)  # noqa: E731
    q = layers.rope_half(layers.rms_norm(heads(a @ w.q_proj), w.q_norm, EPS), positions, INV_FREQ)
    k, v = heads(jnp.einsum("bsh,thd->tbsd", a, w.kv_proj[LAYER]))
    k = layers.rope_half(layers.rms_norm(k, w.k_norm, EPS), positions, INV_FREQ)
    want = block_attention(q, ck[LAYER], cv[LAYER], ctx_len, k, v, 0.3)
    got = drafter_attention_reference(x, w, ck, cv, ctx_len, cos, sin, layer=LAYER, eps=EPS, scale=0.3)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# (dtype, batch, block rows, query heads, KV heads, cache slots, project in the kernel): B*S below 16 rows, groups
# of one, three and four, blocks of 4 / 8 / 16 rows, caches of one tile, a tile and a part, two tiles, not whole;
# caches of 600 and 1000 slots run split over the context (3 and 4 splits; a row of 0 slots, one of some, one full).
F32, BF16 = jnp.float32, jnp.bfloat16
KERNEL_CASES = [
    (F32, 3, 8, 8, 2, 37, True),
    (F32, 1, 8, 8, 2, 64, False),
    (F32, 3, 4, 4, 4, 130, True),
    (F32, 2, 16, 6, 2, 16, False),
    (BF16, 3, 8, 8, 2, 37, True),
    (BF16, 2, 16, 6, 2, 16, False),
    (F32, 2, 8, 4, 2, 600, True),
    (BF16, 3, 8, 8, 2, 1000, False),
]


@pytest.mark.parametrize(("dtype", "b", "s", "nh", "kvh", "length", "project"), KERNEL_CASES)
def test_kernel_equals_the_reference_block(dtype, b, s, nh, kvh, length, project):
    """Interpret mode, projecting in the kernel or loading the projections, in one program per (row, head) or split
    over the context; ragged context lengths from 0 to the whole allocation."""
    args = block_inputs(np.random.default_rng(4), b, s, length, nh, kvh, dtype)
    got = drafter_attention_pallas(*args, LAYER, EPS, 0.2, project=project, interpret=True)
    want = drafter_attention_reference(*args, layer=LAYER, eps=EPS, scale=0.2)
    assert got.dtype == dtype and got.shape == (b, s, nh, 32)
    assert_close(got, want, dtype, 2.0)


@pytest.mark.parametrize("hidden", [256, 96, 80])
def test_kernel_projects_over_several_tiles(hidden):
    """Hidden sizes of 2 and 3 projection tiles (128 and 32 wide: the gain's tiles loaded before the loops) and of 5
    (16 wide: past HOISTED_GAIN_TILES, the gain loaded in the loop)."""
    args = block_inputs(np.random.default_rng(5), 2, 8, 64, 4, 2, jnp.float32, hidden=hidden)
    got = drafter_attention_pallas(*args, LAYER, EPS, 0.2, project=True, interpret=True)
    want = drafter_attention_reference(*args, layer=LAYER, eps=EPS, scale=0.2)
    assert_close(got, want, jnp.float32, 2.0)


def test_dispatch_runs_the_kernel_or_the_reference_by_mode():
    args = block_inputs(np.random.default_rng(6), 2, 4, 16, 4, 2, jnp.float32)
    kw = {"layer": LAYER, "eps": EPS, "scale": 0.25}
    want = drafter_attention_reference(*args, **kw)
    for mode in ("auto", "reference", "interpret"):  # auto: the reference on this CPU
        got = dispatch.drafter_attention(Kernels().with_mode(mode, op="drafter_attention"), *args, **kw)
        assert_close(got, want, jnp.float32)
    x, w, *rest = args
    w16 = w._replace(q_proj=w.q_proj[:, :64], q_norm=w.q_norm[:16], k_norm=w.k_norm[:16])  # head dim 16
    assert "head dim" in unsupported(x, w16, rest[0])
    with pytest.raises(ValueError, match="head dim"):
        dispatch.drafter_attention(Kernels().with_mode("interpret"), x, w16, *rest, **kw)


def test_large_hidden_sizes_project_before_the_kernel():
    """The mini drafter (hidden 256) projects in the kernel; K2.6's (hidden 7168, 8 query heads of 128 per KV head)
    before it, where every sequence would re-read 18 MB of weights."""

    def shapes(hidden, nh, kvh, hd):
        spec = jax.ShapeDtypeStruct
        x = spec((32, 8, hidden), jnp.bfloat16)
        sizes = [(hidden,), (hidden, nh * hd), (hd,), (hd,), (6, 2, hidden, kvh * hd)]
        return x, DrafterAttentionWeights(*(spec(size, jnp.bfloat16) for size in sizes))

    assert project_in_kernel(*shapes(256, 8, 2, 64)) and not project_in_kernel(*shapes(7168, 64, 8, 128))


def test_kernel_gradient_is_the_references():
    """The drafter trains through the kernel path: its gradient (w.r.t. x, the weights and the stacked cache) is the
    reference's."""
    rng = np.random.default_rng(7)
    x, w, ck, cv, ctx_len, cos, sin = block_inputs(rng, 3, 4, 16, 4, 2, jnp.float32)
    probe = jnp.asarray(rng.standard_normal((3, 4, 4, 32)), jnp.float32)

    def loss(mode, x, w, ck, cv):
        out = dispatch.drafter_attention(
            Kernels().with_mode(mode), x, w, ck, cv, ctx_len, cos, sin, layer=LAYER, eps=EPS, scale=0.25
        )
        return jnp.sum(out * probe)

    grads = {mode: jax.jit(jax.grad(functools.partial(loss, mode), (0, 1, 2, 3)))(x, w, ck, cv) for mode in MODES}
    got, want = (jax.tree.leaves(grads[mode]) for mode in ("interpret", "reference"))
    for g, r in zip(got, want, strict=True):
        assert float(jnp.abs(r).max()) > 0 and np.isfinite(np.asarray(r)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=0)


def test_every_mode_selects_the_drafter_attention_op():
    assert Kernels().with_mode("reference").drafter_attention == "reference"
    assert Kernels().with_mode("reference", op="drafter_attention").mla_attention == "auto"
    assert Kernels.from_env({"DDTREE_KERNELS": "reference"}).drafter_attention == "reference"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_drafter_output_is_the_same_through_the_kernel(dtype):
    """The drafter with its attention blocks in the kernel (interpret mode) against the reference blocks."""
    drafter, args = tiny_drafter_and_inputs(np.random.default_rng(8), dtype)
    out = {mode: drafter(*args, kernels=Kernels().with_mode(mode, "drafter_attention")) for mode in MODES}
    got, want = out["interpret"], out["reference"]
    assert got.dtype == dtype and np.isfinite(np.asarray(got, np.float32)).all()
    assert_close(got, want, dtype, 5.0)
