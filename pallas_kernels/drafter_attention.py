"""Pallas-Triton GPU kernel for the drafter's GQA attention over its context cache and its block.

Semantics are those of `reference.drafter_attention_reference`. Layout of the work:

* One program per (sequence, KV head): the `S * G` query rows of that KV head (row r = block position r // G,
  query head r % G of the group) are one `[rows, hd]` matrix against `[block_l, hd]` tiles of that head's K/V.
* The context part loops over the tiles below `ctx_len[b]` only: slots past a row's context length are never read,
  so the cost follows the context used, not the allocation. The block (all visible) is one more tile.
* Online softmax (flash attention): running max, exp-sum and P V in f32, one normalisation at the end.
* The context cache is passed whole `[layers, B, L, kvh, hd]` with the layer index in the block index map, so no
  slice of it is materialised per layer.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start: a fully masked tile never produces inf - inf
MIN_DIM = 16  # Triton dots take operands of at least 16 rows and columns
BLOCK_L = 64


def unsupported(q: jax.Array, ctx_k: jax.Array) -> str:
    """Why the kernel cannot take these shapes ('' when it can): a power-of-two head dim >= 16, a cache of at least
    16 slots."""
    hd, length = q.shape[-1], ctx_k.shape[2]
    if hd < MIN_DIM or hd & (hd - 1):
        return f"the Pallas drafter attention takes a power-of-two head dim >= {MIN_DIM}, not {hd}"
    if length < MIN_DIM:
        return f"the Pallas drafter attention takes a cache of at least {MIN_DIM} slots, not {length}"
    return ""


def _kernel(len_ref, q_ref, ck_ref, cv_ref, bk_ref, bv_ref, o_ref, *, scale: float, block_len: int, block_l: int):
    """One (sequence, KV head) program.

    len_ref: scalar int32 context length; q_ref `[R, hd]`; ck_ref, cv_ref `[L, hd]` (that head's whole cache row);
    bk_ref, bv_ref `[Sb, hd]` (the block, padded to Sb rows, `block_len` of them real); o_ref `[R, hd]`.
    """
    length = ck_ref.shape[0]
    ctx_len = len_ref[()]
    q = q_ref[...]
    qk_scale = scale * _LOG2E
    # f32 operands multiply in IEEE f32 (Triton's default for them is TF32); bf16 ones need no setting
    dot = functools.partial(
        jnp.dot,
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST if ck_ref.dtype == jnp.float32 else None,
    )

    def update(carry, k, v, seen):
        acc, m_i, l_i = carry
        s = jnp.where(seen[None, :], dot(q, k.T) * qk_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        return acc * alpha[:, None] + dot(p.astype(v.dtype), v), m_new, l_i * alpha + jnp.sum(p, axis=1)

    cols = jnp.arange(block_l, dtype=jnp.int32)

    def tile(t, carry):
        start = jnp.minimum(t * block_l, length - block_l)  # the last tile may overlap its predecessor
        slot = start + cols
        seen = (slot >= t * block_l) & (slot < ctx_len)
        return update(carry, ck_ref[pl.ds(start, block_l), :], cv_ref[pl.ds(start, block_l), :], seen)

    rows, hd = q.shape
    carry = (
        jnp.zeros((rows, hd), jnp.float32),
        jnp.full((rows,), _NEG_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    carry = lax.fori_loop(0, pl.cdiv(ctx_len, block_l), tile, carry)
    in_block = jnp.arange(bk_ref.shape[0], dtype=jnp.int32) < block_len
    acc, _, l_i = update(carry, bk_ref[...], bv_ref[...], in_block)
    o_ref[...] = (acc / l_i[:, None]).astype(o_ref.dtype)  # l_i >= 1: every row sees its block


@functools.partial(jax.jit, static_argnames=("scale", "layer", "interpret"))
def drafter_attention_pallas(
    q: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_len: jax.Array,
    block_k: jax.Array,
    block_v: jax.Array,
    scale: float,
    layer: int,
    *,
    interpret: bool = False,
) -> jax.Array:
    """The drafter's attention; see `reference.drafter_attention_reference` (which takes layer `layer` of the cache).

    q `[B, S, nh, hd]`; ctx_k, ctx_v `[layers, B, L, kvh, hd]` (layer `layer` read, slots `< ctx_len[b]` only);
    ctx_len `[B]` int32; block_k, block_v `[B, S, kvh, hd]` -> `[B, S, nh, hd]` in q.dtype. `scale` and `layer`
    are compile-time constants. Shapes must pass `unsupported`.
    """
    b, s, nh, hd = q.shape
    kvh, length = ctx_k.shape[3], ctx_k.shape[2]
    if why := unsupported(q, ctx_k):
        raise ValueError(why)
    group = nh // kvh
    rows = s * group
    rows_pad = max(MIN_DIM, pl.next_power_of_2(rows))
    block_pad = max(MIN_DIM, pl.next_power_of_2(s))
    block_l = min(BLOCK_L, 1 << (length.bit_length() - 1))  # a power of two <= L
    qr = jnp.swapaxes(q.reshape(b, s, kvh, group, hd), 1, 2).reshape(b, kvh, rows, hd).astype(ctx_k.dtype)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    bk, bv = (jnp.pad(x.astype(ctx_k.dtype), ((0, 0), (0, block_pad - s), (0, 0), (0, 0))) for x in (block_k, block_v))
    cache_spec = pl.BlockSpec((None, None, length, None, hd), lambda i, h: (layer, i, 0, h, 0))
    block_spec = pl.BlockSpec((None, block_pad, None, hd), lambda i, h: (i, 0, h, 0))
    row_spec = pl.BlockSpec((None, None, rows_pad, hd), lambda i, h: (i, h, 0, 0))
    o = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block_len=s, block_l=block_l),
        grid=(b, kvh),
        in_specs=[pl.BlockSpec((None,), lambda i, h: (i,)), row_spec, cache_spec, cache_spec, block_spec, block_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct((b, kvh, rows_pad, hd), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="drafter_attention",
    )(ctx_len.astype(jnp.int32), qr, ctx_k, ctx_v, bk, bv)
    return jnp.swapaxes(o[:, :, :rows].reshape(b, kvh, s, group, hd), 1, 2).reshape(b, s, nh, hd)
