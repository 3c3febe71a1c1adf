"""The merged W_UV product (`mla_exact.merged_value_matmul`), whose running max now comes from one load of the
maxes tile instead of a loop of one load per segment, gives bitwise the results of the kernel before the change,
kept here as the reference (`_before_merged_kernel`, commit f83ab68; this file can go once the change has been
measured): random partials with NaN (or +inf maxes) past each token's live count, 1 to 32 segments (3 and 5: not
powers of two), tiles with an overhang, both W_UV dtypes, and edge values (signed zeros in the maxes and sums,
weights that underflow to zero or to subnormals, subnormal and signed-zero acc). Interpret mode on CPU; on a GPU
the compiled kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.exact_matmul import BLOCK_M, MIN_DIM, ieee_dot, tiling
from pallas_kernels.mla_exact import merged_value_matmul

INTERPRET = jax.default_backend() != "gpu"
V = 32
NEG_INIT = -1e30  # the running max's start


def _before_merged_kernel(live_ref, acc_ref, m_ref, l_ref, w_ref, o_ref, *, tokens: int, block_k: int) -> None:
    """`mla_exact._merged_kernel` as of f83ab68: two segment loops, each loading its maxes one segment at a time."""
    row_ok = pl.program_id(1) * BLOCK_M + jnp.arange(BLOCK_M, dtype=jnp.int32) < tokens
    live = pltriton.load(live_ref, mask=row_ok, other=1)
    n_seg = jnp.max(live)
    n_tiles = acc_ref.shape[-1] // block_k

    def max_load(s, ok):
        return pltriton.load(m_ref.at[s], mask=ok, other=NEG_INIT)

    def top(s, m_max):
        return jnp.maximum(m_max, max_load(s, row_ok & (s < live)))

    m_max = lax.fori_loop(0, n_seg, top, jnp.full((BLOCK_M,), NEG_INIT, jnp.float32))

    def add(s, carry):
        l_sum, v = carry
        ok = row_ok & (s < live)
        w_s = jnp.where(ok, jnp.exp2(max_load(s, ok) - m_max), 0.0)
        l_s = pltriton.load(l_ref.at[s], mask=ok, other=0.0)

        def acc_tile(t: int) -> jax.Array:
            return pltriton.load(acc_ref.at[s, :, pl.ds(t * block_k, block_k)], mask=ok[:, None], other=0.0)

        return l_sum + l_s * w_s, tuple(v_t + acc_tile(t) * w_s[:, None] for t, v_t in enumerate(v))

    init = (jnp.zeros((BLOCK_M,), jnp.float32), (jnp.zeros((BLOCK_M, block_k), jnp.float32),) * n_tiles)
    l_sum, v = lax.fori_loop(0, n_seg, add, init)
    l_sum = jnp.where(row_ok, l_sum, 1.0)
    dot = ieee_dot(w_ref.dtype)
    out = jnp.zeros(o_ref.shape, jnp.float32)
    for t, v_t in enumerate(v):
        x = (v_t / l_sum[:, None]).astype(w_ref.dtype)
        out += dot(x, w_ref[:, pl.ds(t * block_k, block_k)].T)
    pltriton.store(o_ref, out, mask=row_ok[:, None])


@jax.jit
def before_merged_value_matmul(acc, maxes, sums, live, w_uv):
    """`mla_exact.merged_value_matmul` as of f83ab68 (V a power of two here: no padding)."""
    segments, tokens, _, c = acc.shape
    heads, v, _ = w_uv.shape
    assert v >= MIN_DIM and not v & (v - 1)
    block_k = tiling(c, v, w_uv.dtype).block_k
    stats = pl.BlockSpec((segments, BLOCK_M, None), lambda h, i: (0, i, h))
    return pl.pallas_call(
        functools.partial(_before_merged_kernel, tokens=tokens, block_k=block_k),
        grid=(heads, pl.cdiv(tokens, BLOCK_M)),
        in_specs=[
            pl.BlockSpec((BLOCK_M,), lambda h, i: (i,)),
            pl.BlockSpec((segments, BLOCK_M, None, c), lambda h, i: (0, i, h, 0)),
            stats,
            stats,
            pl.BlockSpec((None, v, c), lambda h, i: (h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, None, v), lambda h, i: (i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((tokens, heads, v), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=INTERPRET,
        name="mla_exact_merged_w_uv_before",
    )(live.astype(jnp.int32), acc, maxes, sums, w_uv)


def random_case(seed: int, segments: int, tokens: int, c: int, dtype, heads: int = 3, rows: int = 16, past_max=np.nan):
    """Partials `[S, T, R, ...]` (NaN at and past each token's live count, `past_max` in the maxes there), live
    `[T]` and a W_UV `[heads, V, C]`; token 0 reaches every segment and token 1 only the first."""
    rng = np.random.default_rng(seed)
    acc = rng.standard_normal((segments, tokens, rows, c)).astype(np.float32)
    m = (rng.standard_normal((segments, tokens, rows)) * 4).astype(np.float32)
    s = rng.uniform(1, 9, (segments, tokens, rows)).astype(np.float32)
    live = rng.integers(1, segments + 1, tokens).astype(np.int32)
    live[0] = segments
    live[1 % tokens] = 1 if tokens > 1 else segments
    past = np.arange(segments)[:, None] >= live[None, :]
    acc, s = (np.where(past.reshape(past.shape + (1,) * (a.ndim - 2)), np.nan, a) for a in (acc, s))
    m = np.where(past[..., None], np.float32(past_max), m)
    w = jnp.asarray(rng.standard_normal((heads, V, c)) / 16, dtype)
    return acc, m, s, live, w


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def both(acc, m, s, live, w):
    args = (jnp.asarray(acc), jnp.asarray(m), jnp.asarray(s), jnp.asarray(live, jnp.int32), w)
    new = merged_value_matmul(*args, interpret=INTERPRET)
    return np.asarray(new), np.asarray(before_merged_value_matmul(*args))


@pytest.mark.parametrize(
    ("segments", "tokens", "c", "dtype"),
    [
        (1, 20, 256, jnp.bfloat16),
        (3, 37, 256, jnp.float32),
        (5, 20, 512, jnp.bfloat16),
        (5, 1, 256, jnp.float32),
        (8, 17, 256, jnp.bfloat16),
        (32, 16, 256, jnp.float32),
    ],
)
def test_the_merged_product_keeps_its_bits(segments, tokens, c, dtype):
    new, before = both(*random_case(segments * 100 + tokens, segments, tokens, c, dtype))
    assert np.isfinite(new).all() and same_bits(new, before)


def test_maxes_past_a_tokens_segments_do_not_count():
    """The maxes tile is read whole, segments past a token's live count included (never written: any bits): +inf
    there changes nothing."""
    new, before = both(*random_case(11, 5, 20, 256, jnp.float32, past_max=np.inf))
    assert np.isfinite(new).all() and same_bits(new, before)


def test_the_merged_product_keeps_its_bits_at_edge_values():
    """Signed zeros among the maxes (their maximum's sign may follow the order of comparison) and in the sums and
    acc, maxes 200 below the top (weights 2^-200: zero) and 130 below (subnormal weights), subnormal acc."""
    segments, tokens, c = 5, 20, 256
    acc, m, s, live, w = random_case(7, segments, tokens, c, jnp.float32)
    rng = np.random.default_rng(8)
    pick = lambda shape, p: rng.random(shape) < p  # noqa: E731
    shape = m.shape
    m = np.where(pick(shape, 0.2), np.float32(-0.0), m)
    m = np.where(pick(shape, 0.2), np.float32(0.0), m)
    m = np.where(pick(shape, 0.1), m - 200, m)
    m = np.where(pick(shape, 0.1), m - 130, m)
    s = np.where(pick(shape, 0.1), np.float32(-0.0), s)
    s = np.where(pick(shape, 0.1), np.float32(0.0), s)
    acc = np.where(pick(acc.shape, 0.05), np.float32(-0.0), acc)
    acc = np.where(pick(acc.shape, 0.05), np.float32(1e-40), acc)
    acc, m, s = (np.asarray(a, np.float32) for a in (acc, m, s))
    new, before = both(acc, m, s, live, w)
    assert same_bits(new, before)
