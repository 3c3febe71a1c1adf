"""Split-KV (flash-decoding) Pallas GPU kernel for absorbed-MLA decode and tree-verify attention.

Semantics are those of `reference.mla_attention_reference`. Layout of the work:

* The `N * Hq` query rows of one sequence (row r = node r // Hq, head r % Hq) share the one latent K/V, so
  they are processed together as an `[block_r, 576]` matrix against `[block_k, 576]` KV tiles (tensor-core
  dots).
* Each sequence's visible length `prefix_len[b] + N` is cut into `num_splits` contiguous ranges of KV tiles
  (one program each), so short batches still fill the GPU; only tiles below `prefix_len[b] + N` are read.
* Tiles entirely inside the prefix run unmasked; only the last tiles (those touching the N-node block) apply
  the tree mask, given per row as 32-bit words of ancestor bits.
* Each program writes a normalised bf16 partial output and its f32 log-sum-exp; `mla_combine.merge_splits`
  merges the splits (skipped when there is one split).

Lowering: Pallas-Triton (`pl.pallas_call`), any head dims; the Mosaic GPU kernel (`mla_mosaic.py`) takes the calls
of 64 query rows or more on Hopper (`dispatch.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from absl import logging
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.exact_matmul import ieee_dot
from pallas_kernels.mla_combine import merge_splits

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start: fully masked tiles never produce inf - inf


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Tiling of the kernel. `num_splits=0` picks the split count from the problem size."""

    block_r: int = 64
    block_k: int = 64
    num_splits: int = 0
    num_warps: int = 8
    num_stages: int = 2


def default_config(batch: int, rows: int, max_len: int) -> MLAConfig:
    """Heuristic tiling for `rows = N * Hq` query rows per sequence and a cache of `max_len` slots.

    More than 32 rows: 64-row blocks with 8 warps and 2 stages of 64-slot tiles, splits for about 264 programs.
    Fewer (decode with few heads): 16-row blocks with 4 warps and 3 stages of 32-slot tiles (110 KiB of SMEM, so two
    programs share an SM), splits for at most 264 programs (one wave of two per SM). Tilings are timed by
    `experiments.bench_mla --sweep=mixed|decode`.
    """
    if rows > 32:
        config = MLAConfig(block_r=64, block_k=64, num_warps=8, num_stages=2)
        splits = _auto_splits(batch * pl.cdiv(rows, 64), max_len, 64)
    else:
        config = MLAConfig(block_r=16, block_k=32, num_warps=4, num_stages=3)
        splits = _auto_splits(batch * pl.cdiv(rows, 16), max_len, 32, whole_wave=True)
    return dataclasses.replace(config, num_splits=splits)


def _auto_splits(programs: int, max_len: int, block_k: int, target: int = 264, whole_wave: bool = False) -> int:
    """Enough KV splits for ~`target` programs (2 per SM on an H200; at most `target` if whole_wave), at least 4
    tiles each."""
    by_occupancy = target // programs if whole_wave else pl.cdiv(target, programs)
    by_length = max(1, max_len // (4 * block_k))
    return max(1, min(by_occupancy, by_length))


def _tree_words(tree_mask: jax.Array, heads: int, rows_pad: int) -> jax.Array:
    """`[B, N, N]` bool -> `[B, W, rows_pad]` int32: bit j % 32 of word j // 32 of row r is
    tree_mask[r // heads, j].

    W is a power of two >= ceil(N / 32); padded rows and words are 0. Written as one reduction over the 32 bits of
    a broadcast of the (small) mask, laid out as the result, so that XLA can run it as one kernel.
    """
    b, n, _ = tree_mask.shape
    n_words = pl.next_power_of_2(pl.cdiv(n, 32))
    bits = jnp.pad(tree_mask.astype(jnp.uint32), ((0, 0), (0, 0), (0, n_words * 32 - n)))
    bits = jnp.swapaxes(bits.reshape(b, n, n_words, 32), 1, 2) << jnp.arange(32, dtype=jnp.uint32)  # [B, W, N, 32]
    bits = jnp.pad(jnp.repeat(bits, heads, axis=2), ((0, 0), (0, 0), (0, rows_pad - n * heads), (0, 0)))
    return lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)


def tree_inputs(
    tree_mask: jax.Array, prefix_len: jax.Array, heads: int, rows_pad: int
) -> tuple[jax.Array, list[jax.Array], int]:
    """What the kernels take of the tree: (visible prefix `[B]` int32, the kernel's tree inputs: [ancestor words
    `[B, W, rows_pad]` int32] or [], tree nodes the kernel masks). One node (decode) needs no words: its one tree
    slot is folded into the prefix (prefix_len + tree_mask[:, 0, 0]) and the kernel sees no tree block."""
    prefix_len = prefix_len.astype(jnp.int32)
    n = tree_mask.shape[1]
    if n == 1:
        return prefix_len + tree_mask[:, 0, 0].astype(jnp.int32), [], 0
    return prefix_len, [_tree_words(tree_mask, heads, rows_pad)], n


def _tree_visible(words: list[jax.Array], rel: jax.Array, n_nodes: int) -> jax.Array:
    """Row r sees block slot rel[c] iff 0 <= rel < N and the ancestor bit is set: `[block_r, block_k]` bool.

    words: W arrays `[block_r]` int32; rel: `[block_k]` int32 slot index relative to prefix_len.
    """
    word_idx = rel >> 5
    shift = (rel & 31)[None, :]
    bit = jnp.zeros((words[0].shape[0], rel.shape[0]), jnp.int32)
    for k, w in enumerate(words):
        bit = jnp.where((word_idx == k)[None, :], (w[:, None] >> shift) & 1, bit)
    in_block = (rel >= 0) & (rel < n_nodes)
    return in_block[None, :] & (bit == 1)


def _kernel(
    prefix_ref,
    q_ref,
    kv_ref,
    *refs,
    scale: float,
    n_nodes: int,
    value_dim: int,
    block_k: int,
    num_splits: int,
):
    """One (row block, split, sequence) program.

    prefix_ref: scalar int32; q_ref `[block_r, dv + dr]`; kv_ref `[L, dv + dr]` (whole cache row); refs: words_ref
    `[W, block_r]` int32 when n_nodes > 0, then the outputs o_ref `[block_r, dv]` bf16 (normalised) and lse_ref
    `[block_r]` f32, preceded by their poisoned initial values when those are aliased in.
    """
    o_ref, lse_ref = refs[-2:]
    words = [refs[0][k, :] for k in range(refs[0].shape[0])] if n_nodes else []
    split = pl.program_id(1)
    length = kv_ref.shape[0]
    rope_dim = kv_ref.shape[1] - value_dim
    prefix = prefix_ref[()]
    total = prefix + n_nodes
    n_tiles = pl.cdiv(total, block_k)
    per_split = pl.cdiv(n_tiles, num_splits)
    t_lo = jnp.minimum(split * per_split, n_tiles)
    t_hi = jnp.minimum(t_lo + per_split, n_tiles)
    t_full = jnp.clip(prefix // block_k, t_lo, t_hi)  # tiles [t_lo, t_full) lie wholly inside the prefix

    qn = q_ref[:, pl.ds(0, value_dim)]
    qp = q_ref[:, pl.ds(value_dim, rope_dim)]
    qk_scale = scale * _LOG2E
    cols = jnp.arange(block_k, dtype=jnp.int32)
    dot = ieee_dot(kv_ref.dtype)

    def tile(t, carry, masked: bool):
        acc, m_i, l_i = carry
        start = jnp.minimum(t * block_k, length - block_k)  # the last tile may overlap its predecessor
        kn = kv_ref[pl.ds(start, block_k), pl.ds(0, value_dim)]
        kp = kv_ref[pl.ds(start, block_k), pl.ds(value_dim, rope_dim)]
        s = dot(qn, kn.T)
        s += dot(qp, kp.T)
        s *= qk_scale
        if masked:
            slot = start + cols
            own = (slot >= t * block_k) & (slot < total)
            seen = (slot < prefix)[None, :]
            if n_nodes:
                seen = seen | _tree_visible(words, slot - prefix, n_nodes)
            s = jnp.where(own[None, :] & seen, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(kn.dtype), kn)
        return acc, m_new, l_i

    block_r = qn.shape[0]
    carry = (
        jnp.zeros((block_r, value_dim), jnp.float32),
        jnp.full((block_r,), _NEG_INIT, jnp.float32),
        jnp.zeros((block_r,), jnp.float32),
    )
    carry = lax.fori_loop(t_lo, t_full, functools.partial(tile, masked=False), carry)
    acc, m_i, l_i = lax.fori_loop(t_full, t_hi, functools.partial(tile, masked=True), carry)
    seen = l_i > 0.0
    inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
    o_ref[...] = (acc * inv_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_i / _LOG2E + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "config", "interpret", "poison"))
def mla_attention_split(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array,
    scale: float,
    value_dim: int = 512,
    *,
    config: MLAConfig,
    interpret: bool = False,
    poison: bool = False,
) -> jax.Array:
    """`mla_attention_pallas` with an explicit tiling (for benchmarks and tests): `[B, N, Hq, value_dim]`.

    poison: the kernel's partial outputs start as NaN (aliased in), so any block it fails to write shows up.
    """
    b, n, heads, dk = q.shape
    length = latent_cache.shape[1]
    rope_dim = dk - value_dim
    for d in (value_dim, rope_dim):
        if d & (d - 1):
            raise ValueError(f"value_dim {value_dim} and rope dim {rope_dim} must be powers of two")
    block_r, block_k = config.block_r, config.block_k
    if length < block_k:  # tiny caches only: keep every KV tile in bounds
        logging.warning("mla_attention: slow path: cache length %d padded to %d (a copy per call)", length, block_k)
        latent_cache = jnp.pad(latent_cache, ((0, 0), (0, block_k - length), (0, 0)))
        length = block_k
    rows = n * heads
    rows_pad = pl.cdiv(rows, block_r) * block_r
    num_splits = config.num_splits or _auto_splits(b * rows_pad // block_r, length, block_k)
    qr = jnp.pad(q.reshape(b, rows, dk).astype(latent_cache.dtype), ((0, 0), (0, rows_pad - rows), (0, 0)))
    prefix, tree, n_nodes = tree_inputs(tree_mask, prefix_len, heads, rows_pad)

    kernel = functools.partial(
        _kernel, scale=float(scale), n_nodes=n_nodes, value_dim=value_dim, block_k=block_k, num_splits=num_splits
    )
    grid = (rows_pad // block_r, num_splits, b)
    out_specs = [
        pl.BlockSpec((None, None, block_r, value_dim), lambda i, s, bb: (bb, s, i, 0)),
        pl.BlockSpec((None, None, block_r), lambda i, s, bb: (bb, s, i)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, num_splits, rows_pad, value_dim), latent_cache.dtype),
        jax.ShapeDtypeStruct((b, num_splits, rows_pad), jnp.float32),
    ]
    poisoned = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape] if poison else []
    o_part, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None,), lambda i, s, bb: (bb,)),
            pl.BlockSpec((None, block_r, dk), lambda i, s, bb: (bb, i, 0)),
            pl.BlockSpec((None, length, dk), lambda i, s, bb: (bb, 0, 0)),
            *[pl.BlockSpec((None, w.shape[1], block_r), lambda i, s, bb: (bb, 0, i)) for w in tree],
            *(out_specs if poison else []),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={3 + len(tree): 0, 4 + len(tree): 1} if poison else {},
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="mla_attention",
    )(prefix, qr, latent_cache, *tree, *poisoned)
    o = merge_splits(o_part, lse, rows, q.dtype)
    return o.reshape(b, n, heads, value_dim)


def mla_attention_pallas(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array,
    scale: float,
    value_dim: int = 512,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed-MLA attention of N new nodes over the latent cache; see `reference.mla_attention_reference`.

    q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]` (new nodes at slots prefix_len[b] + j, prefix_len + N <= L),
    prefix_len `[B]` int32, tree_mask `[B, N, N]` bool -> `[B, N, Hq, value_dim]` in q.dtype. `scale` must be a
    Python float (it is a compile-time constant of the kernel).
    """
    b, n, heads, _ = q.shape
    config = default_config(b, n * heads, latent_cache.shape[1])
    return mla_attention_split(
        q, latent_cache, prefix_len, tree_mask, float(scale), value_dim, config=config, interpret=interpret
    )
