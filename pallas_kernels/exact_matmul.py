"""Pallas-Triton GPU matmuls whose result for a row does not depend on how many rows share the call.

`matmul_pallas`: x `[M, K]` @ w `[K, N]`, x optionally RMS-normed first; `head_matmul_pallas`: one such product
per head, x `[M, heads, K]` with w `[heads, K, N]` or `[heads, N, K]` (MLA's absorbed w_uk / w_uv einsums; x may
be wider than K, its first K columns read in place). Both accumulate in f32. The invariance:

* Every program computes a `[BLOCK_M, block_n]` output tile; BLOCK_M is fixed and (block_n, block_k) come from
  (K, N, dtype) alone (`tiling`), never from M, and M only sets the number of row tiles in the grid (the last
  tile's rows past M load as zeros and are not stored). A row's products therefore run through the same dot
  instructions whatever M is and wherever the row sits in its tile.
* No split-K: one program owns an output tile and walks K in ascending tiles of block_k into one f32 accumulator.
* K or N not a multiple of its block (non-power-of-two dims): the last tile starts at `dim - block` and overlaps
  its predecessor. Along K the overlapped columns of x are zeroed, so they add exact zeros; along N the overlapped
  columns are stored by the tile that owns them only (a masked store). Dims below MIN_DIM are zero-padded to it.
* f32 operands multiply in IEEE f32 (precision HIGHEST; Triton's default for them is TF32).

`matmul_pallas(..., residual=r)` is `r + (x @ w rounded to r.dtype)` in one kernel (an epilogue: each program adds
its own tile of r in f32 and rounds to r.dtype, as XLA's elementwise add of the two does).

`matmul_pallas(..., norm=(gain, eps))` is `reference.rms_norm(x, gain, eps) @ w` in one kernel (the RMS norm as a
prologue; the same grid and tiling as without it). Each program first sums its rows' squares over K in f32,
elementwise into a `[BLOCK_M, block_k]` accumulator over the ascending K tiles (the tail tile's overlap loads as
zeros), then over the accumulator's columns: an order fixed by K alone. Its K loop then scales each loaded x tile
as the reference does (x in f32 times rsqrt(mean + eps), rounded to x.dtype, times the gain in x.dtype) before the
dot. Every column tile's program recomputes its rows' norm. The result is row-invariant, but not bitwise the norm
kernel (`exact_norm.py`, tiles of up to 1024 columns) followed by the plain product: the sums of squares are added
in another order. Invariance needs only that every call of a token runs the same arithmetic, which the model's
fixed choice of kernel per product gives.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import DTypeLike

BLOCK_M = 16  # rows per output tile: the smallest M of a Triton tensor-core dot
MIN_DIM = 16  # Triton dots take operands of at least 16 rows and columns
ROW_BYTES = 64  # bytes of one weight-tile row per K step: half a 128-byte line (see `tiling`)
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 3


class Tiling(NamedTuple):
    """Output columns per program and the K step of its loop (powers of two, at least MIN_DIM)."""

    block_n: int
    block_k: int


def _pow2_at_most(dim: int, cap: int) -> int:
    """The largest power of two <= min(dim, cap), at least MIN_DIM."""
    return max(MIN_DIM, min(cap, 1 << (dim.bit_length() - 1)))


def tiling(k: int, n: int, dtype: DTypeLike) -> Tiling:
    """The tiling for a `[K, N]` weight of `dtype`, a function of (K, N, dtype) only.

    block_n: 64 bytes of the weight per tile row (32 bf16, 16 f32 columns). At decode (M <= 16 rows: one row tile)
    the weight is read once and the grid has N / block_n programs, so narrow tiles keep the GPU busy. block_k: 256
    (a 256 x 32 bf16 weight tile, 16 KB, per pipeline stage): a decode product is latency-bound, and the fewer
    serial steps its K loop takes the sooner it ends. Both were chosen by round times of the shipped pair on an H100,
    against 128-byte rows and K steps of 64 and 128 (docs/exactness.md).
    """
    return Tiling(_pow2_at_most(n, ROW_BYTES // jnp.dtype(dtype).itemsize), _pow2_at_most(k, BLOCK_K))


def ieee_dot(dtype: DTypeLike):
    """`jnp.dot` with f32 accumulation for operands of `dtype` inside a kernel: f32 operands multiply in IEEE f32
    (Triton's default for them is TF32), bf16 ones need no setting."""
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)


def _kernel(
    x_ref,
    w_ref,
    *refs,
    rows: int,
    k: int,
    tile: Tiling,
    transposed: bool,
    norm: tuple[int, float] | None,
    residual: bool,
) -> None:
    """One (head, row tile, column tile) program: o[:, n0:n0 + block_n] = x[:, :k] @ w[:, n0:n0 + block_n], x first
    RMS-normed when `norm` is (K before padding, eps), the tile of r added when `residual`.

    x_ref `[BLOCK_M, >= k]` (columns past k never read); w_ref `[k, N]`, or `[N, k]` when `transposed`; refs: gain `[k]`
    with `norm`, then r `[BLOCK_M, N]` with `residual`, then o; o_ref `[BLOCK_M, N]` (whole rows: the program stores
    its own columns). Rows at or past `rows` (the last tile's overhang) load as zeros and are not stored. With `norm`,
    a pass over the program's rows first sums their squares (tile by tile into a `[BLOCK_M, block_k]` f32 accumulator,
    then its columns), and the K loop scales each loaded x tile as `reference.rms_norm` does before its dot. With
    `residual`, the f32 product is rounded to o's dtype, added to r's tile in f32 and rounded again (XLA's add).
    """
    gain_ref = refs[0] if norm is not None else None
    res_ref = refs[-2] if residual else None
    o_ref = refs[-1]
    n = o_ref.shape[1]
    bn, bk = tile
    own = pl.program_id(2) * bn
    n0 = jnp.minimum(own, n - bn)  # the last tile may overlap its predecessor
    row_ok = (pl.program_id(1) * BLOCK_M + jnp.arange(BLOCK_M, dtype=jnp.int32) < rows)[:, None]
    dot = ieee_dot(x_ref.dtype)

    def k_tiles(body, init: jax.Array) -> jax.Array:
        """body(k0, x tile `[BLOCK_M, block_k]`, carry) over K in ascending tiles; the tail tile is the last block_k
        columns, those already visited loaded as zeros."""

        def visit(k0, carry, fresh=None):
            mask = row_ok if fresh is None else row_ok & fresh[None, :]
            return body(k0, pltriton.load(x_ref.at[:, pl.ds(k0, bk)], mask=mask, other=0), carry)

        carry = lax.fori_loop(0, k // bk, lambda t, carry: visit(t * bk, carry), init)
        if k % bk:
            carry = visit(k - bk, carry, jnp.arange(bk, dtype=jnp.int32) >= bk - k % bk)
        return carry

    def square(k0, x, acc):
        xf = x.astype(jnp.float32)
        return acc + xf * xf

    if norm is not None:
        hidden, eps = norm
        squares = k_tiles(square, jnp.zeros((BLOCK_M, bk), jnp.float32))
        inv = lax.rsqrt(jnp.sum(squares, axis=1, keepdims=True) / hidden + eps)

    def step(k0, x, acc):
        if norm is not None:
            g = gain_ref[pl.ds(k0, bk)].astype(x.dtype)
            x = g[None, :] * (x.astype(jnp.float32) * inv).astype(x.dtype)
        if transposed:
            return acc + dot(x, w_ref[pl.ds(n0, bn), pl.ds(k0, bk)].T)
        return acc + dot(x, w_ref[pl.ds(k0, bk), pl.ds(n0, bn)])

    if residual:  # loaded before the K loop, so that its latency overlaps the loop's
        r = pltriton.load(res_ref.at[:, pl.ds(n0, bn)], mask=row_ok, other=0)
    acc = k_tiles(step, jnp.zeros((BLOCK_M, bn), jnp.float32))
    out = acc.astype(o_ref.dtype)
    if residual:
        out = (r.astype(jnp.float32) + out.astype(jnp.float32)).astype(o_ref.dtype)
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    pltriton.store(o_ref.at[:, pl.ds(n0, bn)], out, mask=row_ok & (cols >= own)[None, :])


def _weight_dims(w: jax.Array, transposed: bool) -> tuple[int, int]:
    """(K, N) of a per-head weight `[heads, K, N]`, or `[heads, N, K]` when `transposed`."""
    k, n = w.shape[1:]
    return (n, k) if transposed else (k, n)


def _pad_to(a: jax.Array, axis: int, size: int) -> jax.Array:
    """`a` zero-padded at the end of `axis` to `size` (unchanged when already that long)."""
    if a.shape[axis] >= size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


@functools.partial(jax.jit, static_argnames=("out_dtype", "transposed", "tile", "interpret", "eps"))
def head_matmul_tiled(
    x: jax.Array,
    w: jax.Array,
    out_dtype: jnp.dtype,
    transposed: bool,
    tile: Tiling,
    interpret: bool = False,
    gain: jax.Array | None = None,
    eps: float = 0.0,
    residual: jax.Array | None = None,
) -> jax.Array:
    """x `[M, heads, K']` (K' >= K; columns past K are not read), w `[heads, K, N]` (transposed: `[heads, N, K]`) ->
    `[M, heads, N]` in out_dtype, the product of x's first K columns, with an explicit tiling (the kernels' entry points
    take `tiling(K, N, dtype)`; tests take others); with gain `[K]`, every x row `[K]` is first RMS-normed inside the
    kernel (`reference.rms_norm(x, gain, eps)`); with residual `[M, heads, N]` in out_dtype, the result is residual +
    the rounded product. Grid: heads x ceil(M / BLOCK_M) row tiles x ceil(N / block_n) column tiles, the same with or
    without either; K or N below MIN_DIM is zero-padded (a copy)."""
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    m, heads = x.shape[:2]
    k, n = _weight_dims(w, transposed)
    if x.shape[2] < k:
        raise ValueError(f"x has {x.shape[2]} columns, fewer than the weight's K = {k}")
    kp, np_ = max(k, MIN_DIM), max(n, MIN_DIM)
    if x.shape[2] != k and k < MIN_DIM:  # the padded K columns must be zeros, not x's next ones (a copy)
        x = x[..., :k]
    x = _pad_to(x, 2, kp)
    w = _pad_to(_pad_to(w, 2, kp), 1, np_) if transposed else _pad_to(_pad_to(w, 1, kp), 2, np_)
    in_specs = [
        pl.BlockSpec((BLOCK_M, None, x.shape[2]), lambda h, i, j: (i, h, 0)),
        pl.BlockSpec((None, *w.shape[1:]), lambda h, i, j: (h, 0, 0)),
    ]
    gains = []
    if gain is not None:
        in_specs.append(pl.BlockSpec((kp,), lambda h, i, j: (0,)))
        gains.append(_pad_to(gain, 0, kp))
    norm = None if gain is None else (k, eps)
    out_spec = pl.BlockSpec((BLOCK_M, None, np_), lambda h, i, j: (i, h, 0))
    residuals = []
    if residual is not None:
        if residual.shape != (m, heads, n) or residual.dtype != out_dtype:
            raise ValueError(
                f"residual {residual.dtype}{list(residual.shape)} for an output {out_dtype}{[m, heads, n]}"
            )
        in_specs.append(out_spec)
        residuals.append(_pad_to(residual, 2, np_))
    o = pl.pallas_call(
        functools.partial(
            _kernel, rows=m, k=kp, tile=tile, transposed=transposed, norm=norm, residual=residual is not None
        ),
        grid=(heads, pl.cdiv(m, BLOCK_M), pl.cdiv(np_, tile.block_n)),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((m, heads, np_), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="exact_matmul" if gain is None else "exact_normed_matmul",
    )(x, w, *gains, *residuals)
    return o if n == np_ else o[..., :n]


def head_matmul_pallas(
    x: jax.Array,
    w: jax.Array,
    out_dtype: DTypeLike,
    *,
    transposed: bool = False,
    norm: tuple[jax.Array, float] | None = None,
    residual: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Per-head products, row-invariant: x `[..., heads, K']` (K' >= K: its first K columns), w `[heads, K, N]`
    (transposed: `[heads, N, K]`) -> `[..., heads, N]` in out_dtype, f32 accumulation; x and w share a dtype. norm (gain
    `[K]`, eps): every x row `[K]` RMS-normed first, inside the kernel (`reference.rms_norm(x, gain, eps)`). residual
    `[..., heads, N]` in out_dtype: the result is `residual + product.astype(out_dtype)`, added inside the kernel."""
    k, n = _weight_dims(w, transposed)
    if residual is not None and residual.shape != (*x.shape[:-1], n):
        raise ValueError(f"residual {list(residual.shape)} for an output {[*x.shape[:-1], n]}")
    flat = x.reshape(-1, *x.shape[-2:])
    gain, eps = (None, 0.0) if norm is None else norm
    res = None if residual is None else residual.reshape(*flat.shape[:-1], n)
    tile = tiling(k, n, w.dtype)
    out = head_matmul_tiled(flat, w, jnp.dtype(out_dtype), transposed, tile, interpret, gain, eps, res)
    return out.reshape(*x.shape[:-1], n)


def matmul_pallas(
    x: jax.Array,
    w: jax.Array,
    out_dtype: DTypeLike,
    *,
    norm: tuple[jax.Array, float] | None = None,
    residual: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x `[..., K]` @ w `[K, N]` -> `[..., N]` in out_dtype, f32 accumulation, each row's result independent of
    the other rows of the call; x and w share a dtype. norm (gain `[K]`, eps): `reference.rms_norm(x, gain, eps)`
    @ w, the norm computed inside the kernel (a prologue; see the module docstring). residual `[..., N]` in out_dtype:
    `residual + (x @ w).astype(out_dtype)`, the add inside the kernel (an epilogue)."""
    res = None if residual is None else residual[..., None, :]
    out = head_matmul_pallas(x[..., None, :], w[None], out_dtype, norm=norm, residual=res, interpret=interpret)
    return out[..., 0, :]
