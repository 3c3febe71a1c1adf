"""Merge of split-KV attention partials by log-sum-exp, shared by the Triton and Mosaic GPU MLA kernels.

Each split s of a row wrote a normalised partial output o_s and its log-sum-exp lse_s; the row's output is
sum_s w_s o_s with w_s = exp(lse_s - max_s lse) / sum_s exp(lse_s - max_s lse). Splits that saw no slot have
lse = -inf and weigh 0; a row no split saw is 0 / 0 = NaN, as in the reference.

Three ways (`merge_splits(method=...)`):
  "xla" (default): the plain-JAX expression (`combine_xla`), which XLA runs as three small kernels (the weights,
    their normalisation, the weighted sum in the output dtype).
  "fused": the same sums written split by split (`combine_fused`: elementwise maxima and sums of the S slices instead
    of reductions over the split axis), so no reduction separates the weights from the weighted sum and XLA can run
    the merge as one or two loop fusions (the split count is static and small). On the H200 it times the same as "xla"
    in the whole decode call (4096 / 8192 x B8 / B32 x 64 heads: within 1.6 %, bench_mla_schedule_decode).
  "pallas": one Pallas GPU kernel (Triton lowering); each program reads its rows' partials of 128 columns once
    and writes them merged. Slower in the whole call on the H200 except with many splits (same run, 8192 x 17
    nodes: 62.8 against 58.5 us at 64 heads x B1, 448 against 425 us at B8, 26.9 against 30.4 us at 8 heads x B1
    with 43 splits; decode 4096 x B8 x 64: 35.5 against 29.8 us; records bench_mla_combine_*).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

COMBINE_METHODS = ("xla", "fused", "pallas")
COLUMN_BLOCK = 128  # output columns per program: with 16 rows, 2,048 elements, 16 per thread of 4 warps


def check_combine(method: str, owner: object = None) -> None:
    """A ValueError naming `method` (and the config `owner` it came from) unless it is one of COMBINE_METHODS."""
    if method not in COMBINE_METHODS:
        raise ValueError(f"combine must be one of {COMBINE_METHODS}, not {method!r}" + (f": {owner}" if owner else ""))


def combine_xla(o_part: jax.Array, lse: jax.Array) -> jax.Array:
    """o_part `[B, S, R, dv]`, lse `[B, S, R]` f32 -> `[B, R, dv]` f32 in plain JAX."""
    m = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))  # [B, S, R]; empty splits weigh 0
    w = w / jnp.sum(w, axis=1, keepdims=True)  # 0 / 0 only for a row that sees no slot (NaN, as the reference)
    return jnp.sum(w[..., None] * o_part.astype(jnp.float32), axis=1)


def merge_slices(parts: list[jax.Array], lses: list[jax.Array]) -> jax.Array:
    """The merge written split by split: parts S x `[..., R, dv]`, lses S x `[..., R]` f32 -> `[..., R, dv]` f32
    (elementwise maxima and sums, no reduction over a split axis; shared by `combine_fused` and the Pallas kernel)."""
    m = functools.reduce(jnp.maximum, lses)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = [jnp.exp(x - m) for x in lses]
    total = functools.reduce(jnp.add, w)
    acc = functools.reduce(jnp.add, (w_s[..., None] * o.astype(jnp.float32) for w_s, o in zip(w, parts, strict=True)))
    return acc / total[..., None]


def combine_fused(o_part: jax.Array, lse: jax.Array) -> jax.Array:
    """o_part `[B, S, R, dv]`, lse `[B, S, R]` f32 -> `[B, R, dv]` f32, as `combine_xla` but one split at a time."""
    splits = range(lse.shape[1])
    return merge_slices([o_part[:, s] for s in splits], [lse[:, s] for s in splits])


def _kernel(o_ref, lse_ref, out_ref, *, num_splits: int):
    """One (row block, column block, sequence) program: o_ref `[S, rb, bd]`, lse_ref `[S, rb]` f32 -> out_ref
    `[rb, bd]`. The loops over the splits are unrolled, so every split's loads can be in flight at once."""
    splits = range(num_splits)
    out_ref[...] = merge_slices([o_ref[s] for s in splits], [lse_ref[s] for s in splits]).astype(out_ref.dtype)


def _row_block(rows: int) -> int:
    """Rows per program: 16, or 8 when that divides `rows` and 16 does not (8-head trees of odd node counts)."""
    return 8 if rows % 16 and not rows % 8 else 16


@functools.partial(jax.jit, static_argnames=("rows", "dtype", "interpret"))
def combine_pallas(
    o_part: jax.Array, lse: jax.Array, rows: int, dtype: jnp.dtype, interpret: bool = False
) -> jax.Array:
    """o_part `[B, S, R_pad, dv]`, lse `[B, S, R_pad]` f32 -> `[B, rows, dv]` in `dtype` (rows <= R_pad), in one
    kernel when R_pad and rows are multiples of the row block (always for 8 or 64 heads), else sliced after."""
    b, num_splits, rows_pad, dv = o_part.shape
    rb, bd = _row_block(rows), min(dv, COLUMN_BLOCK)
    if rows_pad % rb:
        raise ValueError(f"padded rows {rows_pad} must be a multiple of {rb}")
    out_rows = rows if rows % rb == 0 else rows_pad
    out = pl.pallas_call(
        functools.partial(_kernel, num_splits=num_splits),
        grid=(out_rows // rb, pl.cdiv(dv, bd), b),
        in_specs=[
            pl.BlockSpec((None, num_splits, rb, bd), lambda i, j, bb: (bb, 0, i, j)),
            pl.BlockSpec((None, num_splits, rb), lambda i, j, bb: (bb, 0, i)),
        ],
        out_specs=pl.BlockSpec((None, rb, bd), lambda i, j, bb: (bb, i, j)),
        out_shape=jax.ShapeDtypeStruct((b, out_rows, dv), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_combine",
    )(o_part, lse)
    return out[:, :rows]


def merge_splits(
    o_part: jax.Array, lse: jax.Array, rows: int, dtype: jnp.dtype, method: str = "xla", interpret: bool = False
) -> jax.Array:
    """o_part `[B, S, R_pad, dv]`, lse `[B, S, R_pad]` f32 -> `[B, rows, dv]` in `dtype`. One split: its partial."""
    check_combine(method)
    if o_part.shape[1] == 1:
        return o_part[:, 0, :rows].astype(dtype)
    if method in ("xla", "fused"):
        merge = combine_xla if method == "xla" else combine_fused
        return merge(o_part, lse)[:, :rows].astype(dtype)
    return combine_pallas(o_part, lse, rows, jnp.dtype(dtype), interpret=interpret)
