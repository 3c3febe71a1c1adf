"""Pallas-Triton GPU kernel for the first half of a small drafter layer's feed-forward block: the post-attention RMS
norm, gate and up, and SwiGLU in one launch, where XLA runs a norm fusion, the gate/up product and a SwiGLU fusion.
The down product and its residual add are `dispatch.drafter_residual`.

Semantics are those of `reference.drafter_swiglu_reference`, casts included: the norm in f32 rounded to x.dtype,
gate and up accumulated in f32, the SwiGLU rounded to x.dtype. The grid is (row tile, inner tile): program (r, j)
loads TM rows of x `[M, H]` from row r*TM whole (the hidden size in one tile), takes their norm, multiplies the
normed rows by gate's and up's `[H, TI]` columns j*TI.. (one dot each: no K loop, so a program is its loads of x, the
norm's gain, gate and up, all issued before the norm waits on x, two dots and a store) and writes SwiGLU's `[TM, TI]`
to the output. Rows past M are masked: no padded copy of x exists outside the kernel.

Every row tile reads the layer's gate and up columns and every program holds a whole `[H, TI]` tile of each, so the
kernel takes small drafters only (`unsupported`: those tiles within MAX_TILE_BYTES); a large drafter's products are
bandwidth-bound GEMMs that XLA runs well, and `dispatch.drafter_swiglu` runs the reference for them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.exact_matmul import MIN_DIM, ieee_dot
from pallas_kernels.reference import DrafterSwigluWeights

BLOCK_ROWS = 64  # rows per program at most
BLOCK_INNER = 64  # inner columns per program at most
MAX_TILE_BYTES = 96 << 10  # x `[TM, H]`, gate and up `[H, TI]` whole in one program: H = 256 in bf16, 128 in f32
NUM_WARPS = 8  # x `[64, H]` in f32 (64 registers a thread at H = 256) and gate and up (64 more) live at the norm


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of a call: M rows, H hidden, TM rows per program, the norm's eps."""

    rows: int
    hidden: int
    block_rows: int
    eps: float


def unsupported(x: jax.Array, w: DrafterSwigluWeights) -> str:
    """Why the kernel cannot take these inputs ('' when it can): x `[..., H]`, norm `[H]`, gate and up `[H, I]` of
    one dtype, H a power of two of at least MIN_DIM whose tiles (`[TM, H]` and two `[H, TI]`, at most BLOCK_ROWS and
    BLOCK_INNER) take at most MAX_TILE_BYTES, I a multiple of MIN_DIM."""
    shapes = [x.shape[-1:], w.norm.shape, w.gate.shape, w.up.shape]
    if w.gate.ndim != 2 or shapes != [w.gate.shape[:1], w.gate.shape[:1], w.gate.shape, w.gate.shape]:
        return f"the drafter SwiGLU takes x [..., H], norm [H], gate and up [H, I], not {shapes}"
    hidden, inner = w.gate.shape
    dtypes = sorted({str(a.dtype) for a in (x, *w)})
    if len(dtypes) > 1:
        return f"the Pallas drafter SwiGLU takes x and weights of one dtype, not {dtypes}"
    tile_bytes = hidden * (BLOCK_ROWS + 2 * BLOCK_INNER) * x.dtype.itemsize
    if hidden & (hidden - 1) or hidden < MIN_DIM or tile_bytes > MAX_TILE_BYTES:
        return (
            f"the Pallas drafter SwiGLU takes a power-of-two hidden size of at least {MIN_DIM} whose tiles take at "
            f"most {MAX_TILE_BYTES} bytes, not {hidden} ({tile_bytes} bytes in {x.dtype})"
        )
    if inner % MIN_DIM:
        return f"the Pallas drafter SwiGLU takes an inner size in multiples of {MIN_DIM}, not {inner}"
    return ""


def _kernel(x_ref, norm_ref, gate_ref, up_ref, out_ref, *, d: _Dims) -> None:
    """Program (r, j): x_ref `[M, H]` (rows r*TM.. read), norm_ref `[H]`, gate_ref and up_ref `[H, TI]` (inner tile
    j), out_ref `[M, TI]` (inner tile j; rows r*TM.. written)."""
    row0 = pl.program_id(0) * d.block_rows
    live = (row0 + jnp.arange(d.block_rows, dtype=jnp.int32) < d.rows)[:, None]
    rows, dtype = pl.ds(row0, d.block_rows), x_ref.dtype
    x = pltriton.load(x_ref.at[rows, :], mask=live, other=0).astype(jnp.float32)
    gain, gate, up = norm_ref[...], gate_ref[...], up_ref[...]  # loaded before the norm waits on x
    scale = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d.hidden + d.eps)[:, None]
    normed = gain.astype(dtype)[None, :] * (x * scale).astype(dtype)
    dot = ieee_dot(dtype)
    g, u = dot(normed, gate), dot(normed, up)
    pltriton.store(out_ref.at[rows, :], (g * jax.nn.sigmoid(g) * u).astype(dtype), mask=live)


def drafter_swiglu_pallas(x: jax.Array, w: DrafterSwigluWeights, eps: float, *, interpret: bool = False) -> jax.Array:
    """`reference.drafter_swiglu_reference` by the kernel: x `[..., H]` -> `[..., I]` in x.dtype. `eps` is a
    compile-time constant; inputs must pass `unsupported`."""
    if why := unsupported(x, w):
        raise ValueError(why)
    hidden, inner = w.gate.shape
    flat = x.reshape(-1, hidden)
    m = flat.shape[0]
    block_inner = min(BLOCK_INNER, inner & -inner)
    d = _Dims(rows=m, hidden=hidden, block_rows=min(BLOCK_ROWS, max(MIN_DIM, pl.next_power_of_2(m))), eps=eps)
    columns = pl.BlockSpec((hidden, block_inner), lambda r, j: (0, j))
    out = pl.pallas_call(
        functools.partial(_kernel, d=d),
        grid=(pl.cdiv(m, d.block_rows), inner // block_inner),
        in_specs=[
            pl.BlockSpec((m, hidden), lambda r, j: (0, 0)),
            pl.BlockSpec((hidden,), lambda r, j: (0,)),
            columns,
            columns,
        ],
        out_specs=pl.BlockSpec((m, block_inner), lambda r, j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, inner), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="drafter_swiglu",
    )(flat, w.norm, w.gate, w.up)
    return out.reshape(*x.shape[:-1], inner)
