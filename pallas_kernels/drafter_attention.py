"""Pallas-Triton GPU kernel for one drafter layer's attention block, from the layer input to the attention output.

Semantics are those of `reference.drafter_attention_reference`, casts included (projections rounded to the input
dtype, norms and RoPE in f32 rounded back). One program per (sequence, query head), B * nh programs side by side;
the G = nh / kvh programs of a KV head each compute its K and V of the block (a small product, repeated rather than
serialised over G query heads in one program):

* Rows. x, the RoPE tables and the output are `[B*S, ...]` arrays; a program reads and writes its S rows as
  R = max(16, S) rows from row b*S by masked loads and stores (Triton dots take at least 16 rows), so no padded
  copy exists outside the kernel. Rows past S are zeros, never seen as keys and never written.
* Projection (`_project`). The input RMS norm in f32 (a first pass over H for the sum of squares), then the query
  head's Q and its KV head's K and V of the block, accumulated in f32 over tiles of up to BLOCK_H inputs. Every head
  is kept as its low and high halves (weight columns loaded by halves), so RoPE needs no concatenation in registers.
  Each program reads its heads' projection columns, i.e. every sequence re-reads them: when they exceed
  PROJECT_MAX_BYTES (a large hidden size) the projections run in XLA before the kernel, one product each over all
  rows (`reference.drafter_projections`), and the kernel loads them (`_load_projections`).
* Load order. The loads that need no earlier result (the input norm's gain, every tile of it when there are at
  most HOISTED_GAIN_TILES; the q / k norm weights and the program's RoPE rows) are issued at the program's start, so
  their latency overlaps the projection's loads instead of following them.
* Per-head q / k RMS norm (the sum of squares of both halves) and rotate-half RoPE on the halves; a score is
  q_lo k_lo^T + q_hi k_hi^T, the context cache's K loaded by halves too.
* Attention (`_attend`): online softmax in f32 over the context tiles below ctx_len[b] (slots past it are never
  read: the cost follows the context used, not the allocation), then the block.
* Context splits (`split_count`): when B * nh programs leave the GPU short of PROGRAMS, the context is cut into
  splits of whole tiles, a third grid axis. Each split's program writes its unnormalised partial with its running
  max and sum (split 0 also attends to the block), and `_merge` combines them in split order in XLA. A batch-1 call
  at 1024 slots then runs 4 programs of 4 tiles per head, not one of 16.
* The stacked caches `[layers, B, L, kvh, hd]` and kv_proj `[layers, 2, H, kvh*hd]` are passed whole with the layer
  in the block index map, so no per-layer slice of them is materialised.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.reference import DrafterAttentionWeights, drafter_projections

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start: a fully masked tile never produces inf - inf
MIN_DIM = 16  # Triton dots take operands of at least 16 rows and columns
BLOCK_L = 64  # context slots per tile
BLOCK_H = 128  # inputs per projection tile
HOISTED_GAIN_TILES = 4  # up to this many projection tiles, the norm gain's tiles are all loaded before the loops
SPLIT_SLOTS = 256  # context slots per split at least (a whole number of tiles)
PROGRAMS = 128  # programs a call aims for: about one per SM of an H100 (132)
PROJECT_MAX_BYTES = 1 << 19  # a program's projection columns above this: the projections run in XLA
NUM_WARPS = 4  # warps per program
NUM_STAGES = 2  # software-pipelining stages of the loops over tiles

Halves = tuple[jax.Array, jax.Array]  # one head's (low, high) halves `[R, hd/2]`


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of a call: S block rows (R with padding), head dim, G query heads per KV head, hidden size H and
    its tile, the cache tile, and the norms' eps and the softmax scale."""

    rows: int
    block_rows: int
    head_dim: int
    group: int
    hidden: int
    block_h: int
    block_l: int
    eps: float
    scale: float
    splits: int
    split_tiles: int


def project_in_kernel(x: jax.Array, w: DrafterAttentionWeights) -> bool:
    """Whether each program projects its own rows: its projection columns (one query, one K and one V head,
    `[H, 3 * hd]`) take at most PROJECT_MAX_BYTES."""
    return x.shape[-1] * 3 * w.q_norm.shape[0] * x.dtype.itemsize <= PROJECT_MAX_BYTES


def unsupported(x: jax.Array, w: DrafterAttentionWeights, ctx_k: jax.Array) -> str:
    """Why the kernel cannot take these inputs ('' when it can): x, weights and cache of one dtype, a power-of-two
    head dim >= 32 (its halves are dot operands), a cache of at least 16 slots, and when projecting in the kernel a
    hidden size that is a multiple of 16."""
    dtypes = sorted({str(a.dtype) for a in (x, *w, ctx_k)})
    hd, length, hidden = w.q_norm.shape[0], ctx_k.shape[2], x.shape[-1]
    if len(dtypes) > 1:
        return f"the Pallas drafter attention takes x, weights and cache of one dtype, not {dtypes}"
    if hd < 2 * MIN_DIM or hd & (hd - 1):
        return f"the Pallas drafter attention takes a power-of-two head dim >= {2 * MIN_DIM}, not {hd}"
    if length < MIN_DIM:
        return f"the Pallas drafter attention takes a cache of at least {MIN_DIM} slots, not {length}"
    if project_in_kernel(x, w) and hidden % MIN_DIM:
        return f"the Pallas drafter attention takes a hidden size that is a multiple of {MIN_DIM}, not {hidden}"
    return ""


def _dot(a: jax.Array, b: jax.Array, transpose_b: bool = False) -> jax.Array:
    """a @ b (a @ b.T when transpose_b) accumulated in f32. f32 operands multiply in IEEE f32 (Triton's default for
    them is TF32); bf16 ones need no setting."""
    dims = (((1,), (1,)) if transpose_b else ((1,), (0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _row_mask(d: _Dims) -> jax.Array:
    """`[R]` bool: which of the program's rows are the block's (the first S)."""
    return jnp.arange(d.block_rows, dtype=jnp.int32) < d.rows


def _load_rows(ref, row0: jax.Array, d: _Dims, cols: pl.Slice) -> jax.Array:
    """R rows from `row0` of `ref [B*S, C]` at columns `cols`; rows past the first S read as 0."""
    return pltriton.load(ref.at[pl.ds(row0, d.block_rows), cols], mask=_row_mask(d)[:, None], other=0)


def _store_rows(ref, row0: jax.Array, d: _Dims, cols: pl.Slice, value: jax.Array) -> None:
    """Write the first S of `value [R, C]`'s rows to rows `row0..` of `ref [B*S, ...]` at columns `cols`."""
    pltriton.store(ref.at[pl.ds(row0, d.block_rows), cols], value, mask=_row_mask(d)[:, None])


def _kv_col(d: _Dims) -> jax.Array:
    """The first column of the program's KV head in a `[..., kvh*hd]` array."""
    return pl.program_id(1) // d.group * d.head_dim


def _project(x_ref, g_ref, wq_ref, wk_ref, wv_ref, d: _Dims) -> tuple[Halves, Halves, jax.Array]:
    """The program's projections of its rows. x_ref `[B*S, H]`, g_ref `[H]` (input norm), wq_ref `[H, hd]` (the
    query head's columns), wk_ref, wv_ref `[H, kvh*hd]` (the layer's kv_proj) -> Q and K as halves `[R, hd/2]` and
    V `[R, hd]`, rounded to x.dtype: a = rms_norm(x) in x.dtype, a @ W accumulated in f32."""
    dtype, half, n_tiles = x_ref.dtype, d.head_dim // 2, d.hidden // d.block_h
    row0, kv_col = pl.program_id(0) * d.rows, _kv_col(d)  # outside the loops for interpret mode
    # The norm's gain: in the tile loop its load was not prefetched and each tile waited on it (Nsight Compute,
    # experiments/results/ncu_drafter_stalls), so up to HOISTED_GAIN_TILES tiles it is loaded before the loops.
    hoisted = n_tiles <= HOISTED_GAIN_TILES
    gains = [g_ref[pl.ds(t * d.block_h, d.block_h)].astype(dtype) for t in range(n_tiles if hoisted else 0)]

    def gain(i):
        """The gain's tile i `[block_h]`: a chain of selects among the loaded tiles, else a load."""
        if not hoisted:
            return g_ref[pl.ds(i * d.block_h, d.block_h)].astype(dtype)
        g = gains[0]
        for t in range(1, n_tiles):
            g = jnp.where(i == t, gains[t], g)
        return g

    def x_tile(i):
        return _load_rows(x_ref, row0, d, pl.ds(i * d.block_h, d.block_h)).astype(jnp.float32)

    def sum_squares(i, acc):
        xt = x_tile(i)
        return acc + jnp.sum(xt * xt, axis=1)

    sumsq = lax.fori_loop(0, n_tiles, sum_squares, jnp.zeros((d.block_rows,), jnp.float32))
    inv = lax.rsqrt(sumsq / d.hidden + d.eps)[:, None]

    def tile(i, accs):
        ins = pl.ds(i * d.block_h, d.block_h)
        a = gain(i)[None, :] * (x_tile(i) * inv).astype(dtype)
        weights = [wq_ref[ins, pl.ds(p * half, half)] for p in (0, 1)]
        weights += [wk_ref[ins, pl.ds(kv_col + p * half, half)] for p in (0, 1)]
        weights.append(wv_ref[ins, pl.ds(kv_col, d.head_dim)])
        return tuple(acc + _dot(a, w) for acc, w in zip(accs, weights, strict=True))

    zeros = [jnp.zeros((d.block_rows, half), jnp.float32)] * 4 + [jnp.zeros((d.block_rows, d.head_dim), jnp.float32)]
    q_lo, q_hi, k_lo, k_hi, v = (acc.astype(dtype) for acc in lax.fori_loop(0, n_tiles, tile, tuple(zeros)))
    return (q_lo, q_hi), (k_lo, k_hi), v


def _load_projections(q_ref, k_ref, v_ref, d: _Dims) -> tuple[Halves, Halves, jax.Array]:
    """The program's projections computed before the kernel: q_ref `[B*S, hd]` (the query head's columns),
    k_ref, v_ref `[B*S, kvh*hd]` -> as `_project`."""
    half, row0, kv_col = d.head_dim // 2, pl.program_id(0) * d.rows, _kv_col(d)
    q = tuple(_load_rows(q_ref, row0, d, pl.ds(p * half, half)) for p in (0, 1))
    k = tuple(_load_rows(k_ref, row0, d, pl.ds(kv_col + p * half, half)) for p in (0, 1))
    return q, k, _load_rows(v_ref, row0, d, pl.ds(kv_col, d.head_dim))


def _norm_rope(head: Halves, weight: Halves, cos: jax.Array, sin: jax.Array, d: _Dims) -> Halves:
    """rms_norm (weight halves `[hd/2]`) then rotate-half RoPE (cos, sin `[R, hd/2]` f32) of one head given as halves
    in the input dtype -> its rotated halves in that dtype."""
    dtype = head[0].dtype
    lo, hi = (t.astype(jnp.float32) for t in head)
    inv = lax.rsqrt((jnp.sum(lo * lo, axis=1) + jnp.sum(hi * hi, axis=1)) / d.head_dim + d.eps)[:, None]
    lo, hi = (
        (w.astype(dtype)[None, :] * (t * inv).astype(dtype)).astype(jnp.float32)
        for w, t in zip(weight, (lo, hi), strict=True)
    )
    return (lo * cos - hi * sin).astype(dtype), (hi * cos + lo * sin).astype(dtype)


def split_count(b: int, nh: int, length: int, block_l: int) -> tuple[int, int]:
    """(splits, tiles per split) of a call: the context of `length` slots cut into up to ceil(length / SPLIT_SLOTS)
    splits of whole tiles, as many as keep b * nh * splits within PROGRAMS (1: no split, at 32 rows and 8 heads)."""
    tiles = pl.cdiv(length, block_l)
    splits = max(1, min(pl.cdiv(length, SPLIT_SLOTS), PROGRAMS // (b * nh)))
    per_split = pl.cdiv(tiles, splits)
    return pl.cdiv(tiles, per_split), per_split


def _attend(len_ref, ck_ref, cv_ref, out_refs, q: Halves, k: Halves, v: jax.Array, d: _Dims) -> None:
    """Attention of the query head `q` over the context slots below ctx_len (len_ref, a scalar; ck_ref, cv_ref
    `[L, hd]`, the KV head's cache row) of the program's split (program axis 2: tiles [s * split_tiles,
    (s + 1) * split_tiles)) and, in split 0, the block (keys `k`, values v `[R, hd]`, its S real rows visible).
    One split: out_refs is (o `[B*S, hd]`, the query head's columns), the S rows normalised. Several: (acc `[B*S, hd]`
    f32, m `[B*S]`, l `[B*S]`), the split's unnormalised partial with its running max (log2 units) and sum, merged by
    `_merge`; a split past ctx_len writes the empty partial (acc 0, m _NEG_INIT, l 0)."""
    ctx_len, length, half, row0 = len_ref[()], ck_ref.shape[0], d.head_dim // 2, pl.program_id(0) * d.rows
    split = pl.program_id(2)
    qk_scale = d.scale * _LOG2E
    q_lo, q_hi = q

    def update(carry, k_lo, k_hi, vals, seen):
        acc, m_i, l_i = carry
        s = (_dot(q_lo, k_lo, transpose_b=True) + _dot(q_hi, k_hi, transpose_b=True)) * qk_scale
        s = jnp.where(seen[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        return acc * alpha[:, None] + _dot(p.astype(vals.dtype), vals), m_new, l_i * alpha + jnp.sum(p, 1)

    cols = jnp.arange(d.block_l, dtype=jnp.int32)

    def tile(t, carry):
        start = jnp.minimum(t * d.block_l, length - d.block_l)  # the last tile may overlap its predecessor
        slot = start + cols
        seen = (slot >= t * d.block_l) & (slot < ctx_len)
        keys = pl.ds(start, d.block_l)
        return update(carry, ck_ref[keys, pl.ds(0, half)], ck_ref[keys, pl.ds(half, half)], cv_ref[keys, :], seen)

    carry = (
        jnp.zeros((d.block_rows, d.head_dim), jnp.float32),
        jnp.full((d.block_rows,), _NEG_INIT, jnp.float32),
        jnp.zeros((d.block_rows,), jnp.float32),
    )
    first = split * d.split_tiles
    carry = lax.fori_loop(first, jnp.minimum(pl.cdiv(ctx_len, d.block_l), first + d.split_tiles), tile, carry)
    acc, m_i, l_i = update(carry, *k, v, _row_mask(d) & (split == 0))  # masked out past split 0: exact no-op
    if d.splits == 1:  # l_i >= 1: every row sees its block
        (o_ref,) = out_refs
        _store_rows(o_ref, row0, d, pl.ds(0, d.head_dim), (acc / l_i[:, None]).astype(o_ref.dtype))
        return
    acc_ref, m_ref, l_ref = out_refs
    _store_rows(acc_ref, row0, d, pl.ds(0, d.head_dim), acc)
    for ref, value in ((m_ref, m_i), (l_ref, l_i)):
        pltriton.store(ref.at[pl.ds(row0, d.block_rows)], value, mask=_row_mask(d))


def _merge(acc: jax.Array, m: jax.Array, l_sum: jax.Array, dtype) -> jax.Array:
    """The splits' partials, acc `[splits, B*S, nh, hd]` f32, m and l_sum `[splits, B*S, nh]` (running max in log2
    units and sum) -> the attention output `[B*S, nh, hd]` in dtype: rescaled to the largest max and summed in split
    order, then divided."""
    w = jnp.exp2(m - jnp.max(m, axis=0))
    return (jnp.sum(w[..., None] * acc, axis=0) / jnp.sum(w * l_sum, axis=0)[..., None]).astype(dtype)


def _load_tables(qn_ref, kn_ref, cos_ref, sin_ref, d: _Dims) -> tuple[Halves, Halves, jax.Array, jax.Array]:
    """The q and k norm weights as halves `[hd/2]` and the program's RoPE rows cos, sin `[R, hd/2]` in f32; the
    kernels load them before the projections, so that their loads overlap the projections' rather than follow."""
    row0, half = pl.program_id(0) * d.rows, d.head_dim // 2
    q_norm, k_norm = (tuple(ref[pl.ds(p * half, half)] for p in (0, 1)) for ref in (qn_ref, kn_ref))
    cos, sin = (_load_rows(ref, row0, d, pl.ds(0, half)).astype(jnp.float32) for ref in (cos_ref, sin_ref))
    return q_norm, k_norm, cos, sin


def _attention_block(projections, tables, len_ref, ck_ref, cv_ref, *out_refs, d: _Dims):
    """Norms and RoPE of the program's projections (`_project` / `_load_projections`) with `_load_tables`'s
    tables, then `_attend`."""
    (q, k, v), (q_norm, k_norm, cos, sin) = projections, tables
    q, k = (_norm_rope(head, w, cos, sin, d) for head, w in ((q, q_norm), (k, k_norm)))
    _attend(len_ref, ck_ref, cv_ref, out_refs, q, k, v, d)


def _fused_kernel(len_ref, x_ref, g_ref, wq_ref, wk_ref, wv_ref, qn_ref, kn_ref, cos_ref, sin_ref, *refs, d: _Dims):
    """One (sequence, query head, context split) program projecting its own rows; refs: cache K, cache V, the
    outputs (see `_attend` and `drafter_attention_pallas`)."""
    tables = _load_tables(qn_ref, kn_ref, cos_ref, sin_ref, d)
    _attention_block(_project(x_ref, g_ref, wq_ref, wk_ref, wv_ref, d), tables, len_ref, *refs, d=d)


def _projected_kernel(len_ref, q_ref, k_ref, v_ref, qn_ref, kn_ref, cos_ref, sin_ref, *refs, d: _Dims):
    """One (sequence, query head, context split) program on projections computed before the kernel; refs as
    `_fused_kernel`'s."""
    tables = _load_tables(qn_ref, kn_ref, cos_ref, sin_ref, d)
    _attention_block(_load_projections(q_ref, k_ref, v_ref, d), tables, len_ref, *refs, d=d)


@functools.partial(jax.jit, static_argnames=("layer", "eps", "scale", "project", "interpret"))
def drafter_attention_pallas(
    x: jax.Array,
    w: DrafterAttentionWeights,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_len: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    layer: int,
    eps: float,
    scale: float,
    *,
    project: bool | None = None,
    interpret: bool = False,
) -> jax.Array:
    """One drafter layer's attention block; see `reference.drafter_attention_reference` for the arguments.

    x `[B, S, H]`; w (kv_proj `[layers, 2, H, kvh*hd]`, layer `layer` read); ctx_k, ctx_v `[layers, B, L, kvh, hd]`
    (layer `layer`, slots `< ctx_len[b]` only); ctx_len `[B]` int32; cos, sin `[B, S, hd/2]` f32 -> `[B, S, nh, hd]`
    in x.dtype. `layer`, `eps` and `scale` are compile-time constants; project: whether the programs project their
    rows (None: `project_in_kernel`). Inputs must pass `unsupported`.
    """
    if why := unsupported(x, w, ctx_k):
        raise ValueError(why)
    b, s, hidden = x.shape
    hd, length = w.q_norm.shape[0], ctx_k.shape[2]
    kvh, nh = w.kv_proj.shape[3] // hd, w.q_proj.shape[1] // hd
    block_l = min(BLOCK_L, 1 << (length.bit_length() - 1))  # a power of two <= L
    splits, split_tiles = split_count(b, nh, length, block_l)
    d = _Dims(
        rows=s,
        block_rows=max(MIN_DIM, pl.next_power_of_2(s)),
        head_dim=hd,
        group=nh // kvh,
        hidden=hidden,
        block_h=math.gcd(hidden, BLOCK_H),
        block_l=block_l,
        eps=eps,
        scale=scale,
        splits=splits,
        split_tiles=split_tiles,
    )
    n = b * s

    def whole(a: jax.Array) -> pl.BlockSpec:
        return pl.BlockSpec(a.shape, lambda i, j, c: (0,) * a.ndim)

    head_cols = pl.BlockSpec((n, hd), lambda i, j, c: (0, j))  # query head j's columns
    cache = pl.BlockSpec((None, None, length, None, hd), lambda i, j, c: (layer, i, 0, j // d.group, 0))
    cos, sin = cos.reshape(n, hd // 2), sin.reshape(n, hd // 2)
    if project is None:
        project = project_in_kernel(x, w)
    if project:
        kernel, rows = _fused_kernel, x.reshape(n, hidden)
        args = (rows, w.input_norm, w.q_proj, w.kv_proj, w.kv_proj)
        specs = [whole(rows), whole(w.input_norm), pl.BlockSpec((hidden, hd), lambda i, j, c: (0, j))]
        specs += [pl.BlockSpec((None, None, hidden, kvh * hd), lambda i, j, c, t=t: (layer, t, 0, 0)) for t in (0, 1)]
    else:
        q, kv = drafter_projections(x, w, layer, eps)
        kv = kv.reshape(2, n, kvh * hd)
        kernel, args = _projected_kernel, (q.reshape(n, nh * hd), kv, kv)
        specs = [head_cols, *(pl.BlockSpec((None, n, kvh * hd), lambda i, j, c, t=t: (t, 0, 0)) for t in (0, 1))]
    if splits == 1:
        out_specs, out_shape = head_cols, jax.ShapeDtypeStruct((n, nh * hd), x.dtype)
    else:  # partials: acc `[splits, B*S, nh*hd]`, m and l `[splits, nh, B*S]`
        stat = pl.BlockSpec((None, None, n), lambda i, j, c: (c, j, 0))
        out_specs = (pl.BlockSpec((None, n, hd), lambda i, j, c: (c, 0, j)), stat, stat)
        out_shape = (
            jax.ShapeDtypeStruct((splits, n, nh * hd), jnp.float32),
            *(jax.ShapeDtypeStruct((splits, nh, n), jnp.float32),) * 2,
        )
    o = pl.pallas_call(
        functools.partial(kernel, d=d),
        grid=(b, nh, splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, j, c: (i,)),
            *specs,
            *map(whole, (w.q_norm, w.k_norm, cos, sin)),
            cache,
            cache,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name="drafter_attention",
    )(ctx_len.astype(jnp.int32), *args, w.q_norm, w.k_norm, cos, sin, ctx_k, ctx_v)
    if splits > 1:
        acc, m, l_sum = o
        stats = (jnp.swapaxes(t, 1, 2) for t in (m, l_sum))
        o = _merge(acc.reshape(splits, n, nh, hd), *stats, x.dtype)
    return o.reshape(b, s, nh, hd)
