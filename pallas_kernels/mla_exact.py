"""Pallas-Triton GPU kernel for absorbed-MLA attention whose result for a node depends only on its own sequence.

Semantics are those of `reference.mla_attention_reference`; the arithmetic is fixed so that a token's output is
bitwise the same whether it is computed in a one-token decode step, in a prefill block, or as a node of any tree
in a verify call, whatever the batch (issue 34, docs/exactness.md):

* One program per (sequence, node): its query rows are the node's heads, padded to `ROWS`, so every call runs the
  same dot shapes whatever the number of nodes.
* The node's keys are laid out by absolute position: the cache's prefix at positions `< prefix_len`, then its
  ancestors-or-self at position `prefix_len + depth` (depth = ancestors in the tree mask), exactly where one-token
  decoding would have written them. Other tree nodes are excluded, not only masked.
* Positions are cut into fixed chunks of absolute positions (`chunk_len`: a function of the latent width only),
  visited in ascending order with an online softmax (f32): the chunk boundaries and the order are those of a
  decode step at the node's position.
* Chunks reaching past the prefix gather the ancestors' latents into their position slots with one-hot dots over
  16-node tiles of the block (each gathered value is 1.0 x the latent, summed with exact zeros: exact).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start
CHUNK = 64  # absolute positions per context chunk (the cache is allocated in multiples of it: sizing.CACHE_ALIGN)
WIDE_CHUNK = 32  # the chunk of latents wider than 256 (Kimi K2's 576: 64-slot tiles overflow an H100's SMEM)
ROWS = 16  # query rows per program at least (heads padded): Triton dots take 16 rows and more
MAX_BLOCK = 64  # nodes per call at most: every program holds the block's latents on chip (prefill goes in chunks)


def chunk_len(latent_dim: int) -> int:
    """Absolute positions per chunk for latents of `latent_dim` channels."""
    return CHUNK if latent_dim <= 256 else WIDE_CHUNK


def _kernel(prefix_ref, depth_ref, see_ref, q_ref, kv_ref, blk_ref, o_ref, *, scale: float, value_dim: int, chunk: int):
    """One (sequence, node) program.

    prefix_ref: scalar int32; depth_ref `[Np]` int32 depth of each block node; see_ref `[Np]` int32, 1 where this
    node sees the block node (its ancestors-or-self); q_ref `[R, Dk]`; kv_ref `[L, Dk]` (the whole cache row);
    blk_ref `[Np, Dk]` (the block's latents, padded); o_ref `[R, value_dim]`.
    """
    rope_dim = kv_ref.shape[1] - value_dim
    prefix = prefix_ref[()]
    depth, see = depth_ref[...], see_ref[...] > 0
    total = prefix + jnp.max(jnp.where(see, depth, 0)) + 1  # positions this node attends to
    n_chunks = pl.cdiv(total, chunk)
    n_full = prefix // chunk  # chunks wholly inside the prefix
    qn = q_ref[:, pl.ds(0, value_dim)]
    qp = q_ref[:, pl.ds(value_dim, rope_dim)]
    dtype = kv_ref.dtype
    # f32 operands multiply in IEEE f32 (Triton's default for them is TF32); bf16 ones need no setting
    dot = functools.partial(
        jnp.dot,
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST if dtype == jnp.float32 else None,
    )
    cols = jnp.arange(chunk, dtype=jnp.int32)

    def attend(carry, pos, kn, kp):
        acc, m_i, l_i = carry
        s = (dot(qn, kn.T) + dot(qp, kp.T)) * (scale * _LOG2E)
        s = jnp.where((pos < total)[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        return acc * alpha[:, None] + dot(p.astype(dtype), kn), m_new, l_i * alpha + jnp.sum(p, axis=1)

    def load(c):
        start = c * chunk
        return (
            start + cols,
            kv_ref[pl.ds(start, chunk), pl.ds(0, value_dim)],
            kv_ref[pl.ds(start, chunk), pl.ds(value_dim, rope_dim)],
        )

    def full_chunk(c, carry):
        return attend(carry, *load(c))

    def gather(pos, lo: int, width: int):
        """`[chunk, width]`: channels [lo, lo + width) of the ancestor at each position (zeros where none), one
        `ROWS`-node tile of the block at a time so that only one tile of latents is on chip."""
        out = jnp.zeros((chunk, width), jnp.float32)
        for j in range(0, blk_ref.shape[0], ROWS):
            d, sv = depth_ref[pl.ds(j, ROWS)], see_ref[pl.ds(j, ROWS)] > 0
            pick = (((pos - prefix)[:, None] == d[None, :]) & sv[None, :]).astype(dtype)  # one-hot rows
            out += dot(pick, blk_ref[pl.ds(j, ROWS), pl.ds(lo, width)])
        return out.astype(dtype)

    def tail_chunk(c, carry):
        pos, kn, kp = load(c)
        in_prefix = (pos < prefix)[:, None]
        kn = jnp.where(in_prefix, kn, gather(pos, 0, value_dim))
        kp = jnp.where(in_prefix, kp, gather(pos, value_dim, rope_dim))
        return attend(carry, pos, kn, kp)

    rows = qn.shape[0]
    carry = (
        jnp.zeros((rows, value_dim), jnp.float32),
        jnp.full((rows,), _NEG_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    carry = lax.fori_loop(0, n_full, full_chunk, carry)
    acc, _, l_i = lax.fori_loop(n_full, n_chunks, tail_chunk, carry)
    o_ref[...] = (acc / l_i[:, None]).astype(o_ref.dtype)  # l_i > 0: every node sees itself


def tree_depths(tree_mask: jax.Array) -> jax.Array:
    """`[B, N, N]` ancestors-or-self mask -> `[B, N]` int32 depth of each node (its ancestors)."""
    return jnp.sum(tree_mask, axis=-1, dtype=jnp.int32) - 1


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "interpret"))
def mla_attention_exact(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array,
    scale: float,
    value_dim: int = 512,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed-MLA attention, batch- and tree-invariant; see the module docstring and
    `reference.mla_attention_reference`.

    q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]` (the N new nodes at slots prefix_len[b] + j), prefix_len `[B]`,
    tree_mask `[B, N, N]` bool (ancestors-or-self; node j's position is prefix_len + its depth) ->
    `[B, N, Hq, value_dim]` in q.dtype. value_dim and Dk - value_dim must be powers of two.
    """
    b, n, heads, dk = q.shape
    if n > MAX_BLOCK + 1:  # a budget-64 tree has 65 nodes
        raise ValueError(f"{n} nodes in one call; the exact kernel takes at most {MAX_BLOCK + 1}")
    rope_dim = dk - value_dim
    for d in (value_dim, rope_dim):
        if d & (d - 1):
            raise ValueError(f"value_dim {value_dim} and rope dim {rope_dim} must be powers of two")
    length = latent_cache.shape[1]
    if length % CHUNK:  # the engine allocates whole chunks; other callers pay a copy
        logging.warning("mla_attention_exact: cache length %d padded to a multiple of %d (a copy)", length, CHUNK)
        latent_cache = jnp.pad(latent_cache, ((0, 0), (0, -length % CHUNK), (0, 0)))
    rows = max(ROWS, pl.next_power_of_2(heads))
    n_pad = max(ROWS, pl.next_power_of_2(n))
    prefix = prefix_len.astype(jnp.int32)
    blk = jax.vmap(lambda c, p: lax.dynamic_slice_in_dim(c, p, n))(latent_cache, prefix)
    blk = jnp.pad(blk, ((0, 0), (0, n_pad - n), (0, 0)))
    depth = jnp.pad(tree_depths(tree_mask), ((0, 0), (0, n_pad - n)), constant_values=-1)
    see = jnp.pad(tree_mask.astype(jnp.int32), ((0, 0), (0, 0), (0, n_pad - n)))
    qr = jnp.pad(q.astype(latent_cache.dtype), ((0, 0), (0, 0), (0, rows - heads), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), value_dim=value_dim, chunk=chunk_len(dk)),
        grid=(b, n),
        in_specs=[
            pl.BlockSpec((None,), lambda i, j: (i,)),
            pl.BlockSpec((None, n_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((None, None, n_pad), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, None, rows, dk), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec((None, latent_cache.shape[1], dk), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, n_pad, dk), lambda i, j: (i, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, value_dim), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n, rows, value_dim), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_attention_exact",
    )(prefix, depth, see, qr, latent_cache, blk)
    return out[:, :, :heads]
