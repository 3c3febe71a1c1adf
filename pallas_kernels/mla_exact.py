"""Pallas-Triton GPU kernels for absorbed-MLA attention and its W_UV product whose result for a node depends only
on its own sequence.

`mla_output_exact(q, latent_cache, prefix_len, tree_mask, w_uv, ...)`: q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]`,
w_uv `[Hq, V, value_dim]` -> `[B, N, Hq, V]` (f32, or rounded to out_dtype), the attention of
`reference.mla_attention_reference` (rounded to w_uv's dtype) times each head's W_UV. The arithmetic is fixed so that a
token's output is bitwise the same whether it is computed in a one-token decode step, in a prefill block, or as a node
of any tree in a verify call, whatever the batch and the cache's allocated length (issue 34, docs/exactness.md). Two
kernels:

* The segment kernel (`_segment_kernel`, `_causal_segment_kernel`; grid (B, ceil(N / P), segments)): one program
  per (sequence, group of P nodes, segment). Its `R` query rows (`query_rows`: at least `ROWS`) hold the P nodes'
  heads, each node's padded to R / P rows (`nodes_per_program`: in calls large enough, 4 nodes of 4 heads; with
  16 heads or more, one), so every call runs the same dot shapes whatever the number of nodes. A row's result
  depends only on its own query and its node's keys: the P nodes share the prefix's chunks, one online-softmax step
  for all rows; past the prefix each chunk is stepped once per node with its own keys and the node's rows taken
  from that step.
  - The node's keys are laid out by absolute position: the cache's prefix at positions `< prefix_len`, then its
    ancestors-or-self at position `prefix_len + depth` (depth = ancestors in the tree mask), exactly where
    one-token decoding would have written them. Other tree nodes are excluded, not only masked.
  - Positions are cut into fixed segments of `SEGMENT` absolute positions, and each segment into fixed chunks
    (`chunk_len`: a function of the latent width only). A segment's program visits its chunks in ascending order
    with an online softmax (f32) started afresh and writes its unnormalised partial: acc `[S, B, ceil(N / P),
    R, value_dim]`, running max and sum `[S, B, ceil(N / P), R]` (f32, segment axis first). It does so for every
    allocation, one segment included: one code path. A segment starting past every packed node's last position
    does nothing; a node's partial of a segment it does not reach is never read.
  - Chunks reaching past the prefix gather the ancestors' latents into their position slots with one-hot dots over
    16-node tiles of the block (each gathered value is 1.0 x the latent, summed with exact zeros: exact).
  - A causal block (`causal=True`: the engine's prefill chunks) needs no gather: node j's ancestors are the block's
    nodes 0..j, which the cache already holds at their positions, so each node runs as the decode step at
    prefix + j, reading its keys from the cache (zeros past itself, as the gather gives). It has no size limit.
* `merged_value_matmul` (grid (Hq, tokens / 16)): one program per (head, 16 tokens), all V columns. It merges each
  token's partials over the segments that token reaches (a count that follows its position, not the allocation)
  in ascending order, by log-sum-exp in f32 (the maximum over the live segments first, then the weighted sums),
  divides, rounds to w_uv's dtype and multiplies by the head's W_UV in ascending K tiles of the row-invariant
  product's K step (`exact_matmul.tiling`) into one f32 accumulator. Segments a token does not reach load as exact
  zeros, so its bits depend neither on its tile-mates nor on the grid's segment count.

Segments bound a program's serial walk to `SEGMENT` positions (a batch-1 decode step runs one program per
segment instead of one walking the whole context), at the price of the partials (`R x value_dim` f32 per
(sequence, node group, segment)), which the W_UV product reads; see `SEGMENT`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import logging
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import DTypeLike

from pallas_kernels.exact_matmul import BLOCK_M, MIN_DIM, ieee_dot, tiling

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start
CHUNK = 64  # absolute positions per context chunk (the cache is allocated in multiples of it: sizing.CACHE_ALIGN)
WIDE_CHUNK = 32  # the chunk of latents wider than 256 (Kimi K2's 576: 64-slot tiles overflow an H100's SMEM)
# Absolute positions per segment, a whole number of chunks of either width. A program walks at most SEGMENT / chunk
# chunks in series (4, or 8 wide ones) instead of every chunk of the context: a batch-1 decode step at position 1000
# runs 4 programs, not one of 16 chunks. Each segment adds a partial, written and merged (rows x value_dim f32: 8 KB
# against the 80 KB of cache its program reads for the shipped pair, 128 KB against 288 KB at Kimi width), so
# segments are no shorter: where batch x nodes already fill the GPU they only add traffic.
SEGMENT = 256
ROWS = 16  # query rows per program at least (heads padded): Triton dots take 16 rows and more
# Nodes are packed into a program's rows (`nodes_per_program`) only in calls of at least PACK_MIN_SEGMENTS segments
# and PACK_MIN_PROGRAMS (sequence, node, segment) triples (about four waves of an H100's 132 SMs): packing cuts the
# programs P-fold and shares the chunks below the prefix, but steps every chunk past it P times in one program, which
# lengthens the critical path where the prefix is short or the programs left do not fill the GPU
# (experiments/results/ab_exact_mla_pack).
PACK_MIN_SEGMENTS = 4
PACK_MIN_PROGRAMS = 512
MAX_BLOCK = 64  # tree nodes per call at most (+ the root): a program holds the block's latents on chip


def chunk_len(latent_dim: int) -> int:
    """Absolute positions per chunk for latents of `latent_dim` channels."""
    return CHUNK if latent_dim <= 256 else WIDE_CHUNK


def query_rows(heads: int) -> int:
    """Query rows of a segment program: the node's `heads` heads padded to a power of two of at least ROWS."""
    return max(ROWS, pl.next_power_of_2(heads))


def nodes_per_program(heads: int, nodes: int, batch: int, length: int) -> int:
    """Nodes of one sequence whose query rows share a segment program (P) in a call of `batch` sequences of `nodes`
    query tokens over a cache of `length` slots: where `heads` divides ROWS and the call has at least
    PACK_MIN_SEGMENTS segments and PACK_MIN_PROGRAMS (sequence, node, segment) triples, as many as fill the ROWS rows
    (4 for 4 heads, 2 for 8), a power of two, at most `nodes`; else 1. P changes no bit of the output
    (`_attend_segment`)."""
    segments = pl.cdiv(length, SEGMENT)
    if ROWS % heads or segments < PACK_MIN_SEGMENTS or batch * nodes * segments < PACK_MIN_PROGRAMS:
        return 1
    return min(ROWS // heads, 1 << (max(nodes, 1).bit_length() - 1))


def partial_bytes(batch: int, nodes: int, length: int, heads: int, value_dim: int) -> int:
    """Bytes of the segment kernel's partials for `batch` sequences of `nodes` query tokens of `heads` heads over a
    cache of `length` slots, one node a program: per node and segment, acc `[rows, value_dim]`, running max and sum
    `[rows]`, all f32. Packed calls write 1/P of that; the unpacked count is their bound, and it grows with every
    argument (the memory planner's searches need that)."""
    return batch * nodes * pl.cdiv(length, SEGMENT) * query_rows(heads) * (value_dim + 2) * 4


Keys = tuple[jax.Array, jax.Array]  # a chunk's keys: latents `[chunk, value_dim]` and rope parts `[chunk, rope_dim]`
Tail = Callable[[int, jax.Array, jax.Array, jax.Array], Keys]  # (node, pos, kn, kp) -> that node's keys


def _attend_segment(
    q_ref,
    kv_ref,
    acc_ref,
    m_ref,
    l_ref,
    prefix: jax.Array,
    lasts: list[jax.Array],
    tail: Tail,
    *,
    scale: float,
    value_dim: int,
    chunk: int,
) -> None:
    """The program's segment (program axis 2) for its P = len(lasts) packed nodes, node g's rows `[g*R/P,
    (g+1)*R/P)` of q_ref `[R, Dk]`, attending to its positions [0, lasts[g]].

    Every chunk is one online-softmax step (`step`), the arithmetic of a single node. Chunks wholly below `prefix`
    (which every packed node reads from the cache) are loaded once and stepped for all rows at once. A later chunk
    is stepped once per node, with that node's keys (`tail(g, pos, kn, kp)`: its ancestors-or-self from `prefix` on,
    zeros past its last position), and node g's rows are taken from its step, or left as they were where the chunk
    starts past the node's last position. So a row's bits are those of its node computed alone, whichever nodes
    share the program and whichever chunks take the tail (which changes where a key comes from, not its value).
    Writes the segment's partial for all R rows (see `_segment_kernel`), or nothing when the segment starts past
    every node's last position."""
    rope_dim = kv_ref.shape[1] - value_dim
    rows, group = q_ref.shape[0], len(lasts)
    node = jnp.arange(rows, dtype=jnp.int32) // (rows // group)  # the packed node of each query row
    totals = [last + 1 for last in lasts]  # positions each node attends to
    n_chunks = pl.cdiv(functools.reduce(jnp.maximum, totals), chunk)
    n_full = prefix // chunk  # chunks wholly inside the shared prefix: below every node's last position
    per_segment = SEGMENT // chunk
    lo = pl.program_id(2) * per_segment  # this segment's chunks: [lo, hi), the full ones [lo, mid)

    @pl.when(lo < n_chunks)
    def _():
        hi = jnp.minimum(lo + per_segment, n_chunks)
        mid = jnp.minimum(jnp.maximum(n_full, lo), hi)
        qn = q_ref[:, pl.ds(0, value_dim)]
        qp = q_ref[:, pl.ds(value_dim, rope_dim)]
        dtype = kv_ref.dtype
        dot = ieee_dot(dtype)
        cols = jnp.arange(chunk, dtype=jnp.int32)

        def step(carry, pos, kn, kp, total):
            """One chunk of keys for every row, positions at or past `total` masked."""
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
            return step(carry, *load(c), totals[0])  # every mask here is all-true: any node's total will do

        def tail_chunk(c, carry):
            pos, kn, kp = load(c)
            out = carry
            for g in range(group):  # one node's keys on chip at a time
                stepped = step(carry, pos, *tail(g, pos, kn, kp), totals[g])
                take = (node == g) & (c * chunk < totals[g])  # `[R]`
                out = tuple(
                    jnp.where(take.reshape(-1, *[1] * (x.ndim - 1)), x, o) for x, o in zip(stepped, out, strict=True)
                )
            return out

        carry = (
            jnp.zeros((rows, value_dim), jnp.float32),
            jnp.full((rows,), _NEG_INIT, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        carry = lax.fori_loop(lo, mid, full_chunk, carry)
        acc_ref[...], m_ref[...], l_ref[...] = lax.fori_loop(mid, hi, tail_chunk, carry)


def _segment_kernel(
    prefix_ref, depth_ref, see_ref, q_ref, kv_ref, acc_ref, m_ref, l_ref, *, scale, value_dim, chunk, nodes
):
    """One (sequence, node group, segment) program of a tree block of `nodes` nodes, the group's P nodes packed in
    the query rows (see `_attend_segment`).

    prefix_ref: scalar int32; depth_ref `[Np]` int32 depth of each block node; see_ref `[P, Np]` int32, 1 where the
    group's node sees the block node (its ancestors-or-self; all 0 for a padding node past the block); q_ref
    `[R, Dk]`; kv_ref `[L, Dk]` (the whole cache row, the block's latents at slots prefix..prefix + nodes - 1).
    The segment's partial: acc_ref `[R, value_dim]` f32 (unnormalised), m_ref `[R]` f32 (running max, log2 units)
    and l_ref `[R]` f32 (sum of exponentials). Positions from the prefix on hold each node's ancestors-or-self,
    gathered from the block's slots into their own (zeros where none).
    """
    rope_dim = kv_ref.shape[1] - value_dim
    prefix = prefix_ref[()]
    depth = depth_ref[...]
    dtype = kv_ref.dtype
    dot = ieee_dot(dtype)

    def gather(g: int, pos: jax.Array, lo: int, width: int) -> jax.Array:
        """`[chunk, width]`: channels [lo, lo + width) of packed node g's ancestor at each position (zeros where
        none), one `ROWS`-node tile of the block at a time so that only one tile of latents is on chip. A tile's
        rows past the block or the cache's end load as zeros, masked (never read)."""
        out = jnp.zeros((chunk, width), jnp.float32)
        for j in range(0, depth_ref.shape[0], ROWS):
            d, sv = depth_ref[pl.ds(j, ROWS)], see_ref[g, pl.ds(j, ROWS)] > 0
            pick = (((pos - prefix)[:, None] == d[None, :]) & sv[None, :]).astype(dtype)  # one-hot rows
            node = j + jnp.arange(ROWS, dtype=jnp.int32)
            in_block = ((node < nodes) & (prefix + node < kv_ref.shape[0]))[:, None]
            lat = pltriton.load(kv_ref.at[pl.ds(prefix + j, ROWS), pl.ds(lo, width)], mask=in_block, other=0)
            out += dot(pick, lat)
        return out.astype(dtype)

    def tail(g: int, pos: jax.Array, kn: jax.Array, kp: jax.Array) -> Keys:
        in_prefix = (pos < prefix)[:, None]
        return (
            jnp.where(in_prefix, kn, gather(g, pos, 0, value_dim)),
            jnp.where(in_prefix, kp, gather(g, pos, value_dim, rope_dim)),
        )

    lasts = [prefix + jnp.max(jnp.where(see_ref[g, :] > 0, depth, 0)) for g in range(see_ref.shape[0])]
    options = {"scale": scale, "value_dim": value_dim, "chunk": chunk}
    _attend_segment(q_ref, kv_ref, acc_ref, m_ref, l_ref, prefix, lasts, tail, **options)


def _causal_segment_kernel(prefix_ref, q_ref, kv_ref, acc_ref, m_ref, l_ref, *, scale, value_dim, chunk, nodes, group):
    """One (sequence, node group, segment) program of a causal block of `nodes` nodes whose latents the cache
    already holds, `group` nodes packed in the query rows: node k sits at prefix + k with every earlier position
    its ancestor, so it is the decode step at that position. Its own latent is read back from its slot and
    positions past it are zeros, the keys the tree gather gives a decode step. A padding node past the block
    (its query zeros) reads the last node's positions. prefix_ref: scalar int32; q_ref, kv_ref and the partial's
    refs as in `_segment_kernel`."""
    first = pl.program_id(1) * group
    lasts = [prefix_ref[()] + jnp.minimum(first + g, nodes - 1) for g in range(group)]

    def tail(g: int, pos: jax.Array, kn: jax.Array, kp: jax.Array) -> Keys:
        seen = (pos <= lasts[g])[:, None]
        return jnp.where(seen, kn, jnp.zeros_like(kn)), jnp.where(seen, kp, jnp.zeros_like(kp))

    options = {"scale": scale, "value_dim": value_dim, "chunk": chunk}
    _attend_segment(q_ref, kv_ref, acc_ref, m_ref, l_ref, lasts[0], lasts, tail, **options)


def _merged_kernel(live_ref, acc_ref, m_ref, l_ref, w_ref, o_ref, *, tokens: int, block_k: int) -> None:
    """One (head, 16-token tile) program: each token's partials merged in ascending segment order, then its
    product with the head's W_UV.

    live_ref `[BLOCK_M]` int32 (segments each token reaches, >= 1); acc_ref `[S, BLOCK_M, C]` f32, m_ref and l_ref
    `[S, BLOCK_M]` f32 (the head's partials); w_ref `[V, C]`; o_ref `[BLOCK_M, V]` (the f32 product rounded to its
    dtype). Tokens at or past `tokens` (the last tile's overhang) and segments at or past a token's live count load
    as `other` and are never stored.
    """
    row_ok = pl.program_id(1) * BLOCK_M + jnp.arange(BLOCK_M, dtype=jnp.int32) < tokens
    live = pltriton.load(live_ref, mask=row_ok, other=1)
    n_seg = jnp.max(live)  # the tile's longest walk; shorter ones add exact zeros past their own
    n_tiles = acc_ref.shape[-1] // block_k

    def max_load(s, ok):
        return pltriton.load(m_ref.at[s], mask=ok, other=_NEG_INIT)

    def top(s, m_max):
        return jnp.maximum(m_max, max_load(s, row_ok & (s < live)))

    m_max = lax.fori_loop(0, n_seg, top, jnp.full((BLOCK_M,), _NEG_INIT, jnp.float32))

    def add(s, carry):
        l_sum, v = carry
        ok = row_ok & (s < live)
        w_s = jnp.where(ok, jnp.exp2(max_load(s, ok) - m_max), 0.0)  # 0 where the token does not reach segment s
        l_s = pltriton.load(l_ref.at[s], mask=ok, other=0.0)

        def acc_tile(t: int) -> jax.Array:
            return pltriton.load(acc_ref.at[s, :, pl.ds(t * block_k, block_k)], mask=ok[:, None], other=0.0)

        return l_sum + l_s * w_s, tuple(v_t + acc_tile(t) * w_s[:, None] for t, v_t in enumerate(v))

    init = (jnp.zeros((BLOCK_M,), jnp.float32), (jnp.zeros((BLOCK_M, block_k), jnp.float32),) * n_tiles)
    l_sum, v = lax.fori_loop(0, n_seg, add, init)
    l_sum = jnp.where(row_ok, l_sum, 1.0)  # the overhang's rows: no 0 / 0
    dot = ieee_dot(w_ref.dtype)
    out = jnp.zeros(o_ref.shape, jnp.float32)
    for t, v_t in enumerate(v):
        x = (v_t / l_sum[:, None]).astype(w_ref.dtype)
        out += dot(x, w_ref[:, pl.ds(t * block_k, block_k)].T)
    pltriton.store(o_ref, out.astype(o_ref.dtype), mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def merged_value_matmul(
    acc: jax.Array,
    maxes: jax.Array,
    sums: jax.Array,
    live: jax.Array,
    w_uv: jax.Array,
    *,
    out_dtype: DTypeLike = jnp.float32,
    interpret: bool = False,
) -> jax.Array:
    """The segment kernel's partials merged per token in ascending segment order, divided, rounded to w_uv's dtype
    and multiplied by each head's W_UV (`_merged_kernel`): a token's result depends neither on the other tokens of
    the call nor on S.

    acc `[S, T, R, C]` f32, maxes and sums `[S, T, R]` f32 (a token's R rows: its share of a segment program's rows,
    R / P; running maxes, log2 units; sums of exponentials), live `[T]` int32 (segments each token reaches, >= 1:
    those past it are not read), w_uv `[Hq, V, C]` (Hq <= R; C a multiple of the K step of `exact_matmul.tiling`) ->
    `[T, Hq, V]`, the f32 product rounded to out_dtype. V is zero-padded to a power of two of at least 16 (a copy)
    where it is not one.
    """
    segments, tokens, rows, c = acc.shape
    heads, v, _ = w_uv.shape
    if w_uv.shape[2] != c or heads > rows:
        raise ValueError(f"w_uv {w_uv.shape} does not fit partials of {rows} heads x {c} channels")
    block_k = tiling(c, v, w_uv.dtype).block_k
    if c % block_k:
        raise ValueError(f"latent width {c} is not a multiple of the product's K step {block_k}")
    vp = max(MIN_DIM, pl.next_power_of_2(v))
    w = jnp.pad(w_uv, ((0, 0), (0, vp - v), (0, 0)))
    stats = pl.BlockSpec((segments, BLOCK_M, None), lambda h, i: (0, i, h))
    o = pl.pallas_call(
        functools.partial(_merged_kernel, tokens=tokens, block_k=block_k),
        grid=(heads, pl.cdiv(tokens, BLOCK_M)),
        in_specs=[
            pl.BlockSpec((BLOCK_M,), lambda h, i: (i,)),
            pl.BlockSpec((segments, BLOCK_M, None, c), lambda h, i: (0, i, h, 0)),
            stats,
            stats,
            pl.BlockSpec((None, vp, c), lambda h, i: (h, 0, 0)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, None, vp), lambda h, i: (i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((tokens, heads, vp), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_exact_merged_w_uv",
    )(live.astype(jnp.int32), acc, maxes, sums, w)
    return o if v == vp else o[..., :v]


def tree_depths(tree_mask: jax.Array) -> jax.Array:
    """`[B, N, N]` ancestors-or-self mask -> `[B, N]` int32 depth of each node (its ancestors)."""
    return jnp.sum(tree_mask, axis=-1, dtype=jnp.int32) - 1


def _segment_partials(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array | None,
    scale: float,
    value_dim: int,
    causal: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The segment kernel's partials per query token, acc `[S, B*N', R/P, value_dim]` and maxes, sums
    `[S, B*N', R/P]` (f32; those of segments past a token's last position unread), and live `[B*N']` int32, the
    segments each token reaches (N' = N padded to whole groups of P = `nodes_per_program`; the padding tokens' are
    discarded)."""
    b, n, heads, dk = q.shape
    if n > MAX_BLOCK + 1 and not causal:  # a budget-64 tree has 65 nodes
        raise ValueError(f"{n} nodes in one call; the exact kernel takes at most {MAX_BLOCK + 1}")
    rope_dim = dk - value_dim
    for d in (value_dim, rope_dim):
        if d & (d - 1):
            raise ValueError(f"value_dim {value_dim} and rope dim {rope_dim} must be powers of two")
    length = latent_cache.shape[1]
    if length % CHUNK:  # the engine allocates whole chunks; other callers pay a copy
        logging.warning("mla_output_exact: cache length %d padded to a multiple of %d (a copy)", length, CHUNK)
        latent_cache = jnp.pad(latent_cache, ((0, 0), (0, -length % CHUNK), (0, 0)))
    length = latent_cache.shape[1]
    segments = pl.cdiv(length, SEGMENT)
    rows = query_rows(heads)
    group = nodes_per_program(heads, n, b, length)
    groups = pl.cdiv(n, group)
    if segments * b * groups * rows * value_dim >= 2**31:  # Pallas-Triton addresses a buffer with int32 offsets
        raise ValueError(f"{segments} x {b} x {groups} partials of {rows} x {value_dim}: more than int32 offsets reach")
    prefix = prefix_len.astype(jnp.int32)
    node_pad = groups * group - n
    qr = jnp.pad(q.astype(latent_cache.dtype), ((0, 0), (0, node_pad), (0, rows // group - heads), (0, 0)))
    qr = qr.reshape(b, groups, rows, dk)  # each group's nodes, their heads padded to R / P rows each
    stats = pl.BlockSpec((None, None, None, rows), lambda i, j, s: (s, i, j, 0))
    out_specs = [pl.BlockSpec((None, None, None, rows, value_dim), lambda i, j, s: (s, i, j, 0, 0)), stats, stats]
    out_shape = [
        jax.ShapeDtypeStruct((segments, b, groups, rows, value_dim), jnp.float32),
        jax.ShapeDtypeStruct((segments, b, groups, rows), jnp.float32),
        jax.ShapeDtypeStruct((segments, b, groups, rows), jnp.float32),
    ]
    prefix_spec = pl.BlockSpec((None,), lambda i, j, s: (i,))
    q_spec = pl.BlockSpec((None, None, rows, dk), lambda i, j, s: (i, j, 0, 0))
    kv_spec = pl.BlockSpec((None, length, dk), lambda i, j, s: (i, 0, 0))
    options = {"scale": float(scale), "value_dim": value_dim, "chunk": chunk_len(dk)}
    if causal:
        kernel = functools.partial(_causal_segment_kernel, **options, nodes=n, group=group)
        in_specs = [prefix_spec, q_spec, kv_spec]
        args = (prefix, qr, latent_cache)
        reach = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    else:
        n_pad = max(ROWS, pl.next_power_of_2(n))
        depths = tree_depths(tree_mask)
        depth = jnp.pad(depths, ((0, 0), (0, n_pad - n)), constant_values=-1)
        see = jnp.pad(tree_mask.astype(jnp.int32), ((0, 0), (0, node_pad), (0, n_pad - n)))
        kernel = functools.partial(_segment_kernel, **options, nodes=n)
        in_specs = [
            prefix_spec,
            pl.BlockSpec((None, n_pad), lambda i, j, s: (i, 0)),
            pl.BlockSpec((None, group, n_pad), lambda i, j, s: (i, j, 0)),
            q_spec,
            kv_spec,
        ]
        args = (prefix, depth, see, qr, latent_cache)
        reach = jnp.max(jnp.where(tree_mask, depths[:, None, :], 0), axis=-1)  # depth reached (as the kernel)
    acc, maxes, sums = pl.pallas_call(
        kernel,
        grid=(b, groups, segments),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="mla_attention_exact",
    )(*args)
    live = jnp.minimum(pl.cdiv(prefix[:, None] + reach + 1, SEGMENT), segments)  # `[B, N]` segments reached
    live = jnp.pad(live, ((0, 0), (0, node_pad)), constant_values=1)
    tokens = b * groups * group
    return (
        acc.reshape(segments, tokens, rows // group, value_dim),
        maxes.reshape(segments, tokens, rows // group),
        sums.reshape(segments, tokens, rows // group),
        live.reshape(tokens),
    )


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "causal", "out_dtype", "interpret"))
def mla_output_exact(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array | None,
    w_uv: jax.Array,
    scale: float,
    value_dim: int = 512,
    *,
    causal: bool = False,
    out_dtype: DTypeLike = jnp.float32,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed-MLA attention times W_UV, batch- and tree-invariant: `reference.mla_attention_reference` rounded to
    w_uv's dtype, then `einsum("bnhc,hvc->bnhv")` with f32 accumulation, rounded to out_dtype; see the module
    docstring.

    q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]` (the N new nodes at slots prefix_len[b] + j), prefix_len `[B]`,
    tree_mask `[B, N, N]` bool (ancestors-or-self; node j's position is prefix_len + its depth), w_uv
    `[Hq, V, value_dim]` in q's dtype -> `[B, N, Hq, V]` in out_dtype. value_dim and Dk - value_dim must be powers
    of two. causal: the block is causal (node j's ancestors are nodes 0..j; `tree_mask` is not read): every node attends
    straight over the cache, as the decode step at its position (`_causal_segment_kernel`), so the block may
    exceed MAX_BLOCK.
    """
    b, n, heads, _ = q.shape
    if w_uv.dtype != q.dtype or w_uv.shape[0] != heads:
        raise ValueError(f"w_uv {w_uv.dtype}{list(w_uv.shape)} for queries {q.dtype}{list(q.shape)}: heads or dtype")
    acc, maxes, sums, live = _segment_partials(
        q, latent_cache, prefix_len, tree_mask, scale, value_dim, causal, interpret
    )
    out = merged_value_matmul(acc, maxes, sums, live, w_uv, out_dtype=out_dtype, interpret=interpret)
    return out.reshape(b, -1, heads, out.shape[-1])[:, :n]
