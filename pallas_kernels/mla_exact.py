"""Pallas-Triton GPU kernel for absorbed-MLA attention whose result for a node depends only on its own sequence.

Semantics are those of `reference.mla_attention_reference`; the arithmetic is fixed so that a token's output is
bitwise the same whether it is computed in a one-token decode step, in a prefill block, or as a node of any tree
in a verify call, whatever the batch and the cache's allocated length (issue 34, docs/exactness.md):

* One program per (sequence, node, segment): its query rows are the node's heads, padded to `ROWS`, so every call
  runs the same dot shapes whatever the number of nodes.
* The node's keys are laid out by absolute position: the cache's prefix at positions `< prefix_len`, then its
  ancestors-or-self at position `prefix_len + depth` (depth = ancestors in the tree mask), exactly where one-token
  decoding would have written them. Other tree nodes are excluded, not only masked.
* Positions are cut into fixed segments of `SEGMENT` absolute positions, and each segment into fixed chunks
  (`chunk_len`: a function of the latent width only). A segment's program visits its chunks in ascending order
  with an online softmax (f32) started afresh, and writes its unnormalised partial (acc, running max, sum).
  Segments starting past the node's last position do no work (their partial is the empty one, never read).
* `_merge_kernel` combines a node's partials in ascending segment order with the log-sum-exp merge (f32), over
  the segments the node reaches (a count that follows its position, not the allocation), then divides and casts.
  A call whose cache fits in one segment skips the partials: its one program divides and casts itself, the
  operations a merge of one partial would run.
* Chunks reaching past the prefix gather the ancestors' latents into their position slots with one-hot dots over
  16-node tiles of the block (each gathered value is 1.0 x the latent, summed with exact zeros: exact).
* A causal block (`causal=True`: the engine's prefill chunks) needs no gather: node j's ancestors are the block's
  nodes 0..j, which the cache already holds at their positions, so each node runs as the decode step at prefix + j,
  reading its keys from the cache (zeros past itself, as the gather gives). Such a block has no size limit.

Segments bound a program's serial walk to `SEGMENT` positions (a batch-1 decode step runs one program per
segment instead of one walking the whole context), at the price of the partials (`rows x value_dim` f32 per
(sequence, node, segment)) and the merge; see `SEGMENT`.
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

from pallas_kernels.exact_matmul import ieee_dot

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start
CHUNK = 64  # absolute positions per context chunk (the cache is allocated in multiples of it: sizing.CACHE_ALIGN)
WIDE_CHUNK = 32  # the chunk of latents wider than 256 (Kimi K2's 576: 64-slot tiles overflow an H100's SMEM)
# Absolute positions per segment, a whole number of chunks of either width. A program walks at most SEGMENT / chunk
# chunks in series (4, or 8 wide ones) instead of every chunk of the context: a batch-1 decode step at position 1000
# runs 4 programs, not one of 16 chunks. Each segment adds a partial, written and merged (rows x value_dim f32: 8 KB
# against the 80 KB of cache its program reads for the shipped pair, 128 KB against 288 KB at Kimi width), so
# segments are no shorter: where batch x nodes already fill the GPU they only add traffic. A cache of at most one
# segment needs neither partials nor merge.
SEGMENT = 256
ROWS = 16  # query rows per program at least (heads padded): Triton dots take 16 rows and more
MAX_BLOCK = 64  # tree nodes per call at most (+ the root): a program holds the block's latents on chip
MERGE_COLUMNS = 128  # value columns per merge program (the merge is elementwise along them)


def chunk_len(latent_dim: int) -> int:
    """Absolute positions per chunk for latents of `latent_dim` channels."""
    return CHUNK if latent_dim <= 256 else WIDE_CHUNK


def _attend_segment(q_ref, kv_ref, out_refs, prefix, last, tail, *, scale: float, value_dim: int, chunk: int) -> None:
    """The node's segment (program axis 2) of its positions [0, last]: chunks wholly below `prefix` read from the
    cache, later ones through `tail(pos, kn, kp) -> (kn, kp)`, which supplies the keys from `prefix` on (the node's
    ancestors-or-self, zeros past `last`). Which chunks take the tail changes where a key comes from, not its value
    or the arithmetic. Writes the normalised output (one segment) or the partial; see `_segment_kernel`."""
    rope_dim = kv_ref.shape[1] - value_dim
    total = last + 1  # positions this node attends to
    n_chunks = pl.cdiv(total, chunk)
    n_full = prefix // chunk  # chunks wholly inside the prefix
    per_segment = SEGMENT // chunk
    lo = pl.program_id(2) * per_segment  # this segment's chunks: [lo, hi), the full ones [lo, mid)
    hi = jnp.maximum(lo, jnp.minimum(lo + per_segment, n_chunks))
    mid = jnp.minimum(jnp.maximum(n_full, lo), hi)
    qn = q_ref[:, pl.ds(0, value_dim)]
    qp = q_ref[:, pl.ds(value_dim, rope_dim)]
    dtype = kv_ref.dtype
    dot = ieee_dot(dtype)
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

    def tail_chunk(c, carry):
        pos, kn, kp = load(c)
        return attend(carry, pos, *tail(pos, kn, kp))

    rows = qn.shape[0]
    carry = (
        jnp.zeros((rows, value_dim), jnp.float32),
        jnp.full((rows,), _NEG_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    carry = lax.fori_loop(lo, mid, full_chunk, carry)
    acc, m_i, l_i = lax.fori_loop(mid, hi, tail_chunk, carry)
    if len(out_refs) == 1:  # the only segment: what the merge of this one partial gives
        out_refs[0][...] = (acc / l_i[:, None]).astype(out_refs[0].dtype)  # l_i > 0: every node sees itself
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...], m_ref[...], l_ref[...] = acc, m_i, l_i


def _segment_kernel(
    prefix_ref, depth_ref, see_ref, q_ref, kv_ref, blk_ref, *out_refs, scale: float, value_dim: int, chunk: int
):
    """One (sequence, node, segment) program of a tree block.

    prefix_ref: scalar int32; depth_ref `[Np]` int32 depth of each block node; see_ref `[Np]` int32, 1 where this
    node sees the block node (its ancestors-or-self); q_ref `[R, Dk]`; kv_ref `[L, Dk]` (the whole cache row);
    blk_ref `[Np, Dk]` (the block's latents, padded). out_refs: the normalised output o_ref `[R, value_dim]` when
    the call has one segment, else the segment's partial: acc_ref `[R, value_dim]` f32 (unnormalised), m_ref `[R]`
    f32 (running max, log2 units) and l_ref `[R]` f32 (sum of exponentials). Positions from the prefix on hold the
    node's ancestors-or-self, gathered from the block into their slots (zeros where none).
    """
    rope_dim = kv_ref.shape[1] - value_dim
    prefix = prefix_ref[()]
    depth, see = depth_ref[...], see_ref[...] > 0
    dtype = kv_ref.dtype
    dot = ieee_dot(dtype)

    def gather(pos, lo: int, width: int):
        """`[chunk, width]`: channels [lo, lo + width) of the ancestor at each position (zeros where none), one
        `ROWS`-node tile of the block at a time so that only one tile of latents is on chip."""
        out = jnp.zeros((chunk, width), jnp.float32)
        for j in range(0, blk_ref.shape[0], ROWS):
            d, sv = depth_ref[pl.ds(j, ROWS)], see_ref[pl.ds(j, ROWS)] > 0
            pick = (((pos - prefix)[:, None] == d[None, :]) & sv[None, :]).astype(dtype)  # one-hot rows
            out += dot(pick, blk_ref[pl.ds(j, ROWS), pl.ds(lo, width)])
        return out.astype(dtype)

    def tail(pos, kn, kp):
        in_prefix = (pos < prefix)[:, None]
        return (
            jnp.where(in_prefix, kn, gather(pos, 0, value_dim)),
            jnp.where(in_prefix, kp, gather(pos, value_dim, rope_dim)),
        )

    last = prefix + jnp.max(jnp.where(see, depth, 0))
    _attend_segment(q_ref, kv_ref, out_refs, prefix, last, tail, scale=scale, value_dim=value_dim, chunk=chunk)


def _causal_segment_kernel(prefix_ref, q_ref, kv_ref, *out_refs, scale: float, value_dim: int, chunk: int):
    """One (sequence, node, segment) program of a causal block whose latents the cache already holds: node j sits
    at prefix + j with every earlier position its ancestor, so it is the decode step at that position. Its own
    latent is read back from its slot and positions past it are zeros, the keys the tree gather gives a decode
    step. prefix_ref: scalar int32; q_ref, kv_ref, out_refs as in `_segment_kernel`."""
    last = prefix_ref[()] + pl.program_id(1)

    def tail(pos, kn, kp):
        seen = (pos <= last)[:, None]
        return jnp.where(seen, kn, jnp.zeros_like(kn)), jnp.where(seen, kp, jnp.zeros_like(kp))

    _attend_segment(q_ref, kv_ref, out_refs, last, last, tail, scale=scale, value_dim=value_dim, chunk=chunk)


def _merge_kernel(live_ref, acc_ref, m_ref, l_ref, o_ref):
    """One (sequence, node, column tile) program: the node's partials merged in ascending segment order.

    live_ref: scalar int32, the segments the node reaches (>= 1; later ones are never read); acc_ref `[S, R, W]`
    f32, m_ref and l_ref `[S, R]` f32 (the segment kernel's partials); o_ref `[R, W]`.
    """

    def merge(s, carry):
        acc, m_i, l_i = carry
        m_s = m_ref[s]
        m_new = jnp.maximum(m_i, m_s)
        alpha, beta = jnp.exp2(m_i - m_new), jnp.exp2(m_s - m_new)
        return acc * alpha[:, None] + acc_ref[s] * beta[:, None], m_new, l_i * alpha + l_ref[s] * beta

    acc, _, l_i = lax.fori_loop(1, live_ref[()], merge, (acc_ref[0], m_ref[0], l_ref[0]))
    o_ref[...] = (acc / l_i[:, None]).astype(o_ref.dtype)


def merge_partials(
    acc: jax.Array, maxes: jax.Array, sums: jax.Array, live: jax.Array, dtype: jnp.dtype, *, interpret: bool = False
) -> jax.Array:
    """The segment kernel's partials merged per node in ascending segment order (`_merge_kernel`).

    acc `[B, N, S, R, dv]` f32, maxes and sums `[B, N, S, R]` f32 (running maxes, log2 units; sums of
    exponentials), live `[B, N]` int32 (segments each node reaches, >= 1: those past it are not read) ->
    `[B, N, R, dv]` in dtype.
    """
    b, n, segments, rows, value_dim = acc.shape
    width = min(value_dim, MERGE_COLUMNS)
    return pl.pallas_call(
        _merge_kernel,
        grid=(b, n, value_dim // width),
        in_specs=[
            pl.BlockSpec((None, None), lambda i, j, c: (i, j)),
            pl.BlockSpec((None, None, segments, rows, width), lambda i, j, c: (i, j, 0, 0, c)),
            pl.BlockSpec((None, None, segments, rows), lambda i, j, c: (i, j, 0, 0)),
            pl.BlockSpec((None, None, segments, rows), lambda i, j, c: (i, j, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, width), lambda i, j, c: (i, j, 0, c)),
        out_shape=jax.ShapeDtypeStruct((b, n, rows, value_dim), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_attention_exact_merge",
    )(live.astype(jnp.int32), acc, maxes, sums)


def tree_depths(tree_mask: jax.Array) -> jax.Array:
    """`[B, N, N]` ancestors-or-self mask -> `[B, N]` int32 depth of each node (its ancestors)."""
    return jnp.sum(tree_mask, axis=-1, dtype=jnp.int32) - 1


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "causal", "interpret"))
def mla_attention_exact(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array | None,
    scale: float,
    value_dim: int = 512,
    *,
    causal: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed-MLA attention, batch- and tree-invariant; see the module docstring and
    `reference.mla_attention_reference`.

    q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]` (the N new nodes at slots prefix_len[b] + j), prefix_len `[B]`,
    tree_mask `[B, N, N]` bool (ancestors-or-self; node j's position is prefix_len + its depth) ->
    `[B, N, Hq, value_dim]` in q.dtype. value_dim and Dk - value_dim must be powers of two. causal: the block is
    causal (node j's ancestors are nodes 0..j; `tree_mask` is not read): every node attends straight over the
    cache, as the decode step at its position (`_causal_segment_kernel`), so the block may exceed MAX_BLOCK.
    """
    b, n, heads, dk = q.shape
    if n > MAX_BLOCK + 1 and not causal:  # a budget-64 tree has 65 nodes
        raise ValueError(f"{n} nodes in one call; the exact kernel takes at most {MAX_BLOCK + 1}")
    rope_dim = dk - value_dim
    for d in (value_dim, rope_dim):
        if d & (d - 1):
            raise ValueError(f"value_dim {value_dim} and rope dim {rope_dim} must be powers of two")
    length = latent_cache.shape[1]
    if length % CHUNK:  # the engine allocates whole chunks; other callers pay a copy
        logging.warning("mla_attention_exact: cache length %d padded to a multiple of %d (a copy)", length, CHUNK)
        latent_cache = jnp.pad(latent_cache, ((0, 0), (0, -length % CHUNK), (0, 0)))
    length = latent_cache.shape[1]
    segments = pl.cdiv(length, SEGMENT)
    rows = max(ROWS, pl.next_power_of_2(heads))
    prefix = prefix_len.astype(jnp.int32)
    qr = jnp.pad(q.astype(latent_cache.dtype), ((0, 0), (0, 0), (0, rows - heads), (0, 0)))
    if segments == 1:
        out_specs = pl.BlockSpec((None, None, rows, value_dim), lambda i, j, s: (i, j, 0, 0))
        out_shape = jax.ShapeDtypeStruct((b, n, rows, value_dim), q.dtype)
    else:
        if b * n * segments * rows * value_dim >= 2**31:  # Pallas-Triton addresses a buffer with int32 offsets
            raise ValueError(f"{b} x {n} x {segments} partials of {rows} x {value_dim}: more than int32 offsets reach")
        out_specs = [
            pl.BlockSpec((None, None, None, rows, value_dim), lambda i, j, s: (i, j, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((b, n, segments, rows, value_dim), jnp.float32),
            jax.ShapeDtypeStruct((b, n, segments, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, n, segments, rows), jnp.float32),
        ]
    prefix_spec = pl.BlockSpec((None,), lambda i, j, s: (i,))
    q_spec = pl.BlockSpec((None, None, rows, dk), lambda i, j, s: (i, j, 0, 0))
    kv_spec = pl.BlockSpec((None, length, dk), lambda i, j, s: (i, 0, 0))
    options = {"scale": float(scale), "value_dim": value_dim, "chunk": chunk_len(dk)}
    if causal:
        kernel = functools.partial(_causal_segment_kernel, **options)
        in_specs = [prefix_spec, q_spec, kv_spec]
        args = (prefix, qr, latent_cache)
        reach = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    else:
        n_pad = max(ROWS, pl.next_power_of_2(n))
        blk = jax.vmap(lambda c, p: lax.dynamic_slice_in_dim(c, p, n))(latent_cache, prefix)
        blk = jnp.pad(blk, ((0, 0), (0, n_pad - n), (0, 0)))
        depths = tree_depths(tree_mask)
        depth = jnp.pad(depths, ((0, 0), (0, n_pad - n)), constant_values=-1)
        see = jnp.pad(tree_mask.astype(jnp.int32), ((0, 0), (0, 0), (0, n_pad - n)))
        kernel = functools.partial(_segment_kernel, **options)
        in_specs = [
            prefix_spec,
            pl.BlockSpec((None, n_pad), lambda i, j, s: (i, 0)),
            pl.BlockSpec((None, None, n_pad), lambda i, j, s: (i, j, 0)),
            q_spec,
            kv_spec,
            pl.BlockSpec((None, n_pad, dk), lambda i, j, s: (i, 0, 0)),
        ]
        args = (prefix, depth, see, qr, latent_cache, blk)
        reach = jnp.max(jnp.where(tree_mask, depths[:, None, :], 0), axis=-1)  # depth reached (as the kernel)
    out = pl.pallas_call(
        kernel,
        grid=(b, n, segments),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_attention_exact",
    )(*args)
    if segments > 1:
        live = jnp.minimum(pl.cdiv(prefix[:, None] + reach + 1, SEGMENT), segments)  # `[B, N]` segments reached
        out = merge_partials(*out, live, q.dtype, interpret=interpret)
    return out[:, :, :heads]
