"""Pallas-Triton GPU kernel for a drafter layer's feed-forward block: the post-attention RMS norm, gate and up,
SwiGLU and down in one launch, where XLA runs four or five.

Semantics are those of `reference.drafter_ffn_reference` (the f32 output before the residual), casts included: the
norm in f32 rounded to x.dtype, gate and up accumulated in f32, SwiGLU rounded to x.dtype before down. The grid is
(row tile, inner tile): program (r, j) normalises its TM rows of x `[M, H]` (the whole hidden size, so every program of
a row tile repeats that small step), multiplies them by columns j*TI.. of gate and up, applies SwiGLU and multiplies by
rows j*TI.. of down, writing an f32 partial `[TM, H]` to `[I/TI, M, H]`. The caller's XLA fusion sums the partials in
tile order. Rows past M are masked: no padded copy of x exists outside the kernel.

Every row tile reads all of the layer's FFN weights, so the kernel takes small drafters only (MAX_WEIGHT_BYTES, and a
hidden size that fits a program's registers, MAX_HIDDEN); a large drafter's products are bandwidth-bound GEMMs that
XLA runs well, and `dispatch.drafter_ffn` runs the reference for them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.reference import DrafterFFNWeights

MIN_DIM = 16  # Triton dots take operands of at least 16 rows and columns
BLOCK_ROWS = 64  # rows per program at most
BLOCK_INNER = 128  # inner columns per program at most
MAX_HIDDEN = 512  # a program holds `[TM, H]` f32 tiles in registers
MAX_WEIGHT_BYTES = 1 << 23  # gate, up and down together: each row tile reads them all


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of a call: M rows, TM rows per program, TI inner columns per program, and the norm's eps."""

    rows: int
    block_rows: int
    block_inner: int
    eps: float


def inner_tile(inner: int) -> int:
    """TI: the largest power of two <= BLOCK_INNER that divides `inner`."""
    return min(BLOCK_INNER, inner & -inner)


def unsupported(x: jax.Array, w: DrafterFFNWeights) -> str:
    """Why the kernel cannot take these inputs ('' when it can): x and weights of one dtype, a power-of-two hidden
    size in [MIN_DIM, MAX_HIDDEN], an inner size with a power-of-two divisor >= MIN_DIM, and weights of at most
    MAX_WEIGHT_BYTES."""
    dtypes = sorted({str(a.dtype) for a in (x, *w)})
    hidden, inner = w.gate.shape
    weight_bytes = sum(a.size * a.dtype.itemsize for a in (w.gate, w.up, w.down))
    if len(dtypes) > 1:
        return f"the Pallas drafter FFN takes x and weights of one dtype, not {dtypes}"
    if hidden & (hidden - 1) or not MIN_DIM <= hidden <= MAX_HIDDEN:
        return f"the Pallas drafter FFN takes a power-of-two hidden size in [{MIN_DIM}, {MAX_HIDDEN}], not {hidden}"
    if inner_tile(inner) < MIN_DIM:
        return f"the Pallas drafter FFN takes an inner size that is a multiple of {MIN_DIM}, not {inner}"
    if weight_bytes > MAX_WEIGHT_BYTES:
        return f"the Pallas drafter FFN takes weights of at most {MAX_WEIGHT_BYTES} bytes, not {weight_bytes}"
    return ""


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b accumulated in f32; f32 operands multiply in IEEE f32 (Triton's default for them is TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _kernel(x_ref, norm_ref, gate_ref, up_ref, down_ref, out_ref, *, d: _Dims) -> None:
    """Program (r, j): x_ref `[M, H]` (rows r*TM.. read), norm_ref `[H]`, gate_ref and up_ref `[H, TI]` and down_ref
    `[TI, H]` (inner tile j), out_ref `[M, H]` f32 (partial j; rows r*TM.. written)."""
    row0 = pl.program_id(0) * d.block_rows
    live = (row0 + jnp.arange(d.block_rows, dtype=jnp.int32) < d.rows)[:, None]
    rows = pl.ds(row0, d.block_rows)
    x = pltriton.load(x_ref.at[rows, :], mask=live, other=0)
    xf = x.astype(jnp.float32)
    normed = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=1, keepdims=True) + d.eps)).astype(x.dtype)
    n = norm_ref[...].astype(x.dtype)[None, :] * normed
    g, u = _dot(n, gate_ref[...]), _dot(n, up_ref[...])
    h = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)
    pltriton.store(out_ref.at[rows, :], _dot(h, down_ref[...]), mask=live)


def drafter_ffn_partials(x: jax.Array, w: DrafterFFNWeights, eps: float, *, interpret: bool = False) -> jax.Array:
    """The feed-forward block of x `[M, H]` as I/TI f32 partials `[I/TI, M, H]`, which sum (in any order, f32) to
    `reference.drafter_ffn_reference(x, w, eps)`. `eps` is a compile-time constant; inputs must pass `unsupported`."""
    if why := unsupported(x, w):
        raise ValueError(why)
    m, hidden = x.shape
    inner = w.gate.shape[1]
    d = _Dims(
        rows=m, block_rows=min(BLOCK_ROWS, max(MIN_DIM, pl.next_power_of_2(m))), block_inner=inner_tile(inner), eps=eps
    )
    tiles = inner // d.block_inner

    def whole(a: jax.Array) -> pl.BlockSpec:
        return pl.BlockSpec(a.shape, lambda r, j: (0,) * a.ndim)

    columns = pl.BlockSpec((hidden, d.block_inner), lambda r, j: (0, j))
    return pl.pallas_call(
        functools.partial(_kernel, d=d),
        grid=(pl.cdiv(m, d.block_rows), tiles),
        in_specs=[
            whole(x),
            whole(w.norm),
            columns,
            columns,
            pl.BlockSpec((d.block_inner, hidden), lambda r, j: (j, 0)),
        ],
        out_specs=pl.BlockSpec((None, m, hidden), lambda r, j: (j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((tiles, m, hidden), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="drafter_ffn",
    )(x, w.norm, w.gate, w.up, w.down)


def drafter_ffn_pallas(x: jax.Array, w: DrafterFFNWeights, eps: float, *, interpret: bool = False) -> jax.Array:
    """`reference.drafter_ffn_reference` by the kernel: x `[..., H]` -> `[..., H]` f32, its partials summed in tile
    order (one XLA fusion, which takes the caller's rounding and residual add too)."""
    partials = drafter_ffn_partials(x.reshape(-1, x.shape[-1]), w, eps, interpret=interpret)
    return partials.sum(axis=0).reshape(x.shape)
