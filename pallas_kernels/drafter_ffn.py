"""Pallas-Triton GPU kernel for a drafter layer's feed-forward block: the post-attention RMS norm, gate and up,
SwiGLU and down in one launch, where XLA runs four or five.

Semantics are those of `reference.drafter_ffn_reference` (the f32 output before the residual), casts included: the
norm in f32 rounded to x.dtype, gate and up accumulated in f32, SwiGLU rounded to x.dtype before down. The grid is
(row tile, inner tile): program (r, j) takes TM rows of x `[M, H]` from row r*TM and inner columns j*TI.., and

* sums its rows' squares over H in steps of BH columns (f32), then, in a second pass over the same steps, normalises
  each x tile `[TM, BH]` and accumulates its products with gate's and up's `[BH, TI]` tiles into g and u;
* applies SwiGLU to g and u, rounds to x.dtype, and multiplies by down's rows j*TI.. in steps of BH output columns,
  storing each `[TM, BH]` f32 result to partial j of `[I/TI, M, H]`.

No operand larger than `[TM, TI]` or `[BH, TI]` is held at once, whatever H. The caller's XLA fusion sums the
partials. Rows past M are masked: no padded copy of x exists outside the kernel.

Every row tile reads all of the layer's FFN weights, so the kernel takes small drafters only (MAX_WEIGHT_BYTES); a
large drafter's products are bandwidth-bound GEMMs that XLA runs well, and `dispatch.drafter_ffn` runs the reference
for them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.exact_matmul import MIN_DIM, ieee_dot
from pallas_kernels.reference import DrafterFFNWeights

BLOCK_ROWS = 64  # rows per program at most
BLOCK_INNER = 128  # inner columns per program at most
BLOCK_HIDDEN = 64  # hidden columns per step at most
MAX_WEIGHT_BYTES = 1 << 23  # gate, up and down together: each row tile reads them all
NUM_WARPS = 8  # g and u `[64, 128]` f32 accumulate side by side: 64 registers a thread each at 8 warps


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of a call: M rows, H hidden, TM rows per program, BH hidden columns per step, the norm's eps."""

    rows: int
    hidden: int
    block_rows: int
    block_hidden: int
    eps: float


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    return min(cap, n & -n)


def unsupported(x: jax.Array, w: DrafterFFNWeights) -> str:
    """Why the kernel cannot take these inputs ('' when it can): x `[..., H]`, norm `[H]`, gate and up `[H, I]` and
    down `[I, H]` of one dtype, H and I multiples of MIN_DIM, and weights of at most MAX_WEIGHT_BYTES."""
    hidden, inner = w.gate.shape
    shapes = [x.shape[-1:], w.norm.shape, w.gate.shape, w.up.shape, w.down.shape]
    if shapes != [(hidden,), (hidden,), (hidden, inner), (hidden, inner), (inner, hidden)]:
        return f"the drafter FFN takes x [..., H], norm [H], gate and up [H, I], down [I, H], not {shapes}"
    dtypes = sorted({str(a.dtype) for a in (x, *w)})
    weight_bytes = sum(a.size * a.dtype.itemsize for a in (w.gate, w.up, w.down))
    if len(dtypes) > 1:
        return f"the Pallas drafter FFN takes x and weights of one dtype, not {dtypes}"
    if hidden % MIN_DIM or inner % MIN_DIM:
        return f"the Pallas drafter FFN takes hidden and inner sizes in multiples of {MIN_DIM}, not {hidden, inner}"
    if weight_bytes > MAX_WEIGHT_BYTES:
        return f"the Pallas drafter FFN takes weights of at most {MAX_WEIGHT_BYTES} bytes, not {weight_bytes}"
    return ""


def _kernel(x_ref, norm_ref, gate_ref, up_ref, down_ref, out_ref, *, d: _Dims) -> None:
    """Program (r, j): x_ref `[M, H]` (rows r*TM.. read), norm_ref `[H]`, gate_ref and up_ref `[H, TI]` and down_ref
    `[TI, H]` (inner tile j), out_ref `[M, H]` f32 (partial j; rows r*TM.. written)."""
    row0 = pl.program_id(0) * d.block_rows
    live = (row0 + jnp.arange(d.block_rows, dtype=jnp.int32) < d.rows)[:, None]
    rows, bh, steps = pl.ds(row0, d.block_rows), d.block_hidden, d.hidden // d.block_hidden
    dtype = x_ref.dtype
    dot = ieee_dot(dtype)

    def x_tile(k):  # `[TM, BH]` f32, rows past M zero
        return pltriton.load(x_ref.at[rows, pl.ds(k * bh, bh)], mask=live, other=0).astype(jnp.float32)

    def sum_squares(k, acc):
        xk = x_tile(k)
        return acc + jnp.sum(xk * xk, axis=1)

    squares = lax.fori_loop(0, steps, sum_squares, jnp.zeros((d.block_rows,), jnp.float32))
    scale = lax.rsqrt(squares / d.hidden + d.eps)[:, None]

    def project(k, gu):
        cols = pl.ds(k * bh, bh)
        n = norm_ref[cols].astype(dtype)[None, :] * (x_tile(k) * scale).astype(dtype)
        return gu[0] + dot(n, gate_ref[cols, :]), gu[1] + dot(n, up_ref[cols, :])

    zeros = jnp.zeros((d.block_rows, gate_ref.shape[1]), jnp.float32)
    g, u = lax.fori_loop(0, steps, project, (zeros, zeros))
    h = (g * jax.nn.sigmoid(g) * u).astype(dtype)

    @pl.loop(0, steps)
    def _(c):
        cols = pl.ds(c * bh, bh)
        pltriton.store(out_ref.at[rows, cols], dot(h, down_ref[:, cols]), mask=live)


def drafter_ffn_partials(x: jax.Array, w: DrafterFFNWeights, eps: float, *, interpret: bool = False) -> jax.Array:
    """The feed-forward block of x `[M, H]` as I/TI f32 partials `[I/TI, M, H]`, which sum (f32, in any order) to
    `reference.drafter_ffn_reference(x, w, eps)`. `eps` is a compile-time constant; inputs must pass `unsupported`."""
    if why := unsupported(x, w):
        raise ValueError(why)
    m, hidden = x.shape
    inner = w.gate.shape[1]
    block_inner = _pow2_divisor(inner, BLOCK_INNER)
    d = _Dims(
        rows=m,
        hidden=hidden,
        block_rows=min(BLOCK_ROWS, max(MIN_DIM, pl.next_power_of_2(m))),
        block_hidden=_pow2_divisor(hidden, BLOCK_HIDDEN),
        eps=eps,
    )
    tiles = inner // block_inner

    def whole(a: jax.Array) -> pl.BlockSpec:
        return pl.BlockSpec(a.shape, lambda r, j: (0,) * a.ndim)

    columns = pl.BlockSpec((hidden, block_inner), lambda r, j: (0, j))
    return pl.pallas_call(
        functools.partial(_kernel, d=d),
        grid=(pl.cdiv(m, d.block_rows), tiles),
        in_specs=[whole(x), whole(w.norm), columns, columns, pl.BlockSpec((block_inner, hidden), lambda r, j: (j, 0))],
        out_specs=pl.BlockSpec((None, m, hidden), lambda r, j: (j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((tiles, m, hidden), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="drafter_ffn",
    )(x, w.norm, w.gate, w.up, w.down)


def drafter_ffn_pallas(x: jax.Array, w: DrafterFFNWeights, eps: float, *, interpret: bool = False) -> jax.Array:
    """`reference.drafter_ffn_reference` by the kernel: x `[..., H]` -> `[..., H]` f32, its partials summed by one
    XLA reduction (which the caller's rounding and residual add join as one fusion)."""
    partials = drafter_ffn_partials(x.reshape(-1, x.shape[-1]), w, eps, interpret=interpret)
    return partials.sum(axis=0).reshape(x.shape)
