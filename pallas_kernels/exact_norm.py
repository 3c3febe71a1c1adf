"""Pallas-Triton GPU RMS norm whose result for a row does not depend on how many rows share the call.

`rms_norm_pallas`: x `[..., W]` (W >= H), gain `[H]` -> `[..., H]` in x.dtype, the semantics of `reference.rms_norm` of
x's first H columns (x in f32 over the sum of its squares, rounded back, times the gain), read in place. XLA emits a
norm as a reduction whose strategy (vectorisation, threads per row, what else shares the fusion) it chooses per program,
so a row's sum of squares can round differently at another batch size or block length. Here the order is fixed by H
alone:

* Every program owns BLOCK_M rows; M only sets how many programs run (rows past M load as zeros, are not stored).
* Pass 1 walks H in ascending tiles of `block_h(H)` columns, adding each tile's squares elementwise into one
  `[BLOCK_M, block_h]` f32 accumulator, then sums the accumulator's columns: the same instructions for a row
  whatever M is and wherever the row sits in its tile. When H is not a multiple of the tile, the last tile starts
  at H - block_h and overlaps its predecessor; its columns already summed load as zeros (exact zeros added).
* Pass 2 re-reads the tiles, scales them and stores them (the overlap is stored twice, with the same values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_M = 8  # rows per program
MAX_BLOCK_H = 1024  # columns per tile at most
NUM_WARPS = 4


def block_h(hidden: int) -> int:
    """Columns per tile: the largest power of two <= H, at most MAX_BLOCK_H (Triton blocks are powers of two)."""
    return min(MAX_BLOCK_H, 1 << (hidden.bit_length() - 1))


def _kernel(x_ref, w_ref, o_ref, *, rows: int, eps: float) -> None:
    """One program: rows [i * BLOCK_M, (i + 1) * BLOCK_M) of x_ref `[BLOCK_M, W]`, their first H columns (H:
    w_ref's length), normalised into o_ref `[BLOCK_M, H]`."""
    hidden = w_ref.shape[0]
    bh = block_h(hidden)
    whole, tail = divmod(hidden, bh)
    row_ok = (pl.program_id(0) * BLOCK_M + jnp.arange(BLOCK_M, dtype=jnp.int32) < rows)[:, None]

    def load(c0, mask=row_ok):
        return pltriton.load(x_ref.at[:, pl.ds(c0, bh)], mask=mask, other=0).astype(jnp.float32)

    def square(c0, acc, mask=row_ok):
        x = load(c0, mask)
        return acc + x * x

    acc = lax.fori_loop(0, whole, lambda t, acc: square(t * bh, acc), jnp.zeros((BLOCK_M, bh), jnp.float32))
    if tail:  # the last bh columns, those already summed loaded as zeros
        acc = square(hidden - bh, acc, row_ok & (jnp.arange(bh, dtype=jnp.int32) >= bh - tail)[None, :])
    inv = lax.rsqrt(jnp.sum(acc, axis=1, keepdims=True) / hidden + eps)

    def scale(c0):
        w = w_ref[pl.ds(c0, bh)].astype(o_ref.dtype)
        y = w[None, :] * (load(c0) * inv).astype(o_ref.dtype)
        pltriton.store(o_ref.at[:, pl.ds(c0, bh)], y, mask=row_ok)

    @pl.loop(0, whole)
    def _(t):
        scale(t * bh)

    if tail:
        scale(hidden - bh)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm_pallas(x: jax.Array, weight: jax.Array, eps: float, *, interpret: bool = False) -> jax.Array:
    """x `[..., W]`, weight `[H]` (W >= H) -> `[..., H]` in x.dtype, `reference.rms_norm` of x's first H columns
    (the others are not read), each row's result independent of the other rows of the call."""
    hidden, width = weight.shape[0], x.shape[-1]
    if width < hidden:
        raise ValueError(f"x has {width} columns, fewer than the gain's {hidden}")
    flat = x.reshape(-1, width)
    m = flat.shape[0]
    out = pl.pallas_call(
        functools.partial(_kernel, rows=m, eps=eps),
        grid=(pl.cdiv(m, BLOCK_M),),
        in_specs=[
            pl.BlockSpec((BLOCK_M, width), lambda i: (i, 0)),
            pl.BlockSpec((hidden,), lambda i: (0,)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, hidden), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, hidden), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="exact_rms_norm",
    )(flat, weight)
    return out.reshape(*x.shape[:-1], hidden)
