"""Mosaic GPU (Hopper, sm_90a) kernel for absorbed-MLA decode and tree-verify attention.

Semantics are those of `reference.mla_attention_reference`; `mla_attention_mosaic` is a drop-in for
`mla_attention.mla_attention_pallas`. Work layout (FlashMLA-like):

* The `N * Hq` query rows of one sequence (row = node * Hq + head) are padded to blocks of 64 rows; one CTA
  handles one 64-row block against one split (a contiguous range of 64-slot KV tiles; only tiles below
  `prefix_len[b] + N` are read): grid = (row blocks, splits, batch), the split count from
  `mla_mosaic_config.default_config`.
* Three warpgroups per CTA: a memory warpgroup streams Q `[64, 576]` once and the KV tiles `[64, 576]` by TMA
  into a `num_stages` SMEM ring; two compute warpgroups each own half of the 512 value columns (a `[64, 256]` f32
  accumulator = 128 registers per thread).
* S and the softmax are split by slots: each compute warpgroup computes S = Q K^T and P for its half of every
  tile's slots against its own reference maximum and publishes P (bf16) and that maximum in SMEM; after one meeting
  per tile each reads the other's half, rescales both halves to the agreed maximum and adds P V for its columns
  over the whole tile. No MMA work is repeated.
* Lazy rescale: a row's running maximum moves only when a tile's maximum passes it by more than
  RESCALE_THRESHOLD (log2 units; P <= 2^8 otherwise, exact either way), so after the first tiles nearly every row's
  rescale factor is 1, and a thread whose rows did not move skips the accumulator's rescale (`scale_rows`).
* Tiles wholly inside the prefix run unmasked; the last tiles (those touching the N-node block) mask by the slot
  bound and the tree mask, given per row as 32-bit words of ancestor bits (`mla_attention.tree_inputs`; decode
  folds its one node into the prefix and takes no words).
* Each CTA writes a normalised bf16 partial `[64, 512]` (staged in Q's SMEM) and its f32 log-sum-exp;
  `mla_combine.merge_splits` merges the splits.

Shared memory, registers and the split model: `mla_mosaic_config`. Interpret mode needs jax's GPU interpreter
extended for this kernel (run_state accumulators, register-LHS wgmma, `scale_rows`), which the test harness does
(`tests/mosaic_interpret.py`); the product takes its `InterpretGPUParams` but does not patch jax itself.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, scf, vector
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_attention import tree_inputs
from pallas_kernels.mla_combine import merge_splits
from pallas_kernels.mla_mosaic_config import (
    BLOCK_K,
    BLOCK_R,
    SMEM_LIMIT,
    SWIZZLE,
    MosaicMLAConfig,
    default_config,
    smem_bytes,
)

_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start: fully masked tiles never produce inf - inf
_ROW = plgpu.Layout.WGMMA.reduce(1)
RESCALE_THRESHOLD = 8.0  # log2 units a row's scores may pass its running maximum before it moves (P <= 2^8)


def _scale_moved_rows(ctx, alpha: mgpu.FragmentedArray, acc: mgpu.FragmentedArray) -> mgpu.FragmentedArray:
    """`inline_mgpu` body of `scale_rows`: each thread multiplies its accumulator registers by its rows' alpha
    only if one of those (two) rows has alpha != 1; the others branch around the multiplies."""
    del ctx
    f32 = ir.F32Type.get()
    one = arith.constant(f32, ir.FloatAttr.get(f32, 1.0))
    moved = None
    for reg in alpha.registers.flat:
        width = reg.type.shape[0] if isinstance(reg.type, ir.VectorType) else 0
        for value in [vector.extract(reg, [], [i]) for i in range(width)] or [reg]:
            differs = arith.cmpf(arith.CmpFPredicate.UNE, value, one)
            moved = differs if moved is None else arith.ori(moved, differs)
    branch = scf.IfOp(moved, [r.type for r in acc.registers.flat], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scaled = acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout)
        scf.yield_(list(scaled.registers.flat))
    with ir.InsertionPoint(branch.else_block):
        scf.yield_(list(acc.registers.flat))
    registers = np.empty(acc.registers.shape, dtype=object)
    for i, result in enumerate(branch.results):
        registers.flat[i] = result
    return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)


# The test harness's interpreter (`tests/mosaic_interpret.py`) runs this instead: the same values, no branch.
_scale_moved_rows.interpret_as = lambda alpha, acc: acc * alpha[:, None]


def scale_rows(acc: jax.Array, alpha: jax.Array) -> jax.Array:
    """acc `[64, n]` f32 (WGMMA layout) times alpha `[64]` (its row layout) row by row, where a thread whose rows
    all have alpha == 1 skips its multiplies (the lazy rescale)."""
    out = plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=plgpu.Layout.WGMMA)
    return plgpu.inline_mgpu(arg_types=(_ROW, plgpu.Layout.WGMMA), return_type=out)(_scale_moved_rows)(alpha, acc)


def _kernel(*refs, scale: float, n_nodes: int, value_dim: int, config: MosaicMLAConfig, num_splits: int) -> None:
    """One CTA of three warpgroups ("wg" 0, 1: compute; 2: memory): one (row block, split, sequence).

    GMEM: prefix_ref `[B]` int32, q_ref `[B, R, dk]`, kv_ref `[B, L, dk]`, words_ref `[B, W, R]` int32 (only when
    n_nodes > 0, with words_smem); outputs o_ref `[B, S, R, dv]` bf16 (normalised partials of the S splits), lse_ref
    `[B, S, R]` f32. SMEM: q_o_smem = (Q `[64, dk]`, the output `[2, 64, dv / 2]` in the same memory), kv_smem
    `[stages, 64, dk]`, words_smem `[W, 64]`, p_smem: the two P halves `[2, 64, 32]`, stat_smem
    `[3, 64]` f32 (rows 0, 1: each compute warpgroup's reference maximum, at the end its row sum; row 2: the output
    LSE). Barriers: q_bar (Q and the words landed), kv_bars / free_bars (a ring slot is full / free), meet_bar (the
    compute warpgroups' meeting), done_bar (both are done reading Q), p_bars[h] (the other warpgroup has read P half
    h and reference maximum h).
    """
    refs = list(refs)
    words_ref, words_smem = (refs.pop(3), refs.pop(7)) if n_nodes else (None, None)
    prefix_ref, q_ref, kv_ref, o_ref, lse_ref, q_o_smem, kv_smem, p_smem, stat_smem, *bars = refs
    q_bar, kv_bars, free_bars, meet_bar, done_bar, p_bars = bars
    stages, hk = config.num_stages, BLOCK_K // 2  # hk: the slots of a tile half
    q_smem, o_smem = q_o_smem
    half_dv = value_dim // 2
    wg = lax.axis_index("wg")
    qk_scale = scale * _LOG2E

    def locate():
        """(b, prefix_ref[b], row0, split, t_lo, t_hi): this CTA's sequence, first row and KV tiles [t_lo, t_hi).
        The epilogue calls it again, so these scalars need not stay live across the tile loop."""
        b, split = lax.axis_index("batch"), lax.axis_index("split")
        prefix = prefix_ref[b]
        n_tiles = lax.div(prefix + n_nodes + (BLOCK_K - 1), BLOCK_K)
        per_split = lax.div(n_tiles + (num_splits - 1), num_splits)
        t_lo = jnp.minimum(split * per_split, n_tiles)
        t_hi = jnp.minimum(t_lo + per_split, n_tiles)
        return b, prefix, lax.axis_index("rows") * BLOCK_R, split, t_lo, t_hi

    def run(role: int):
        """Warpgroup `role`'s work: compute warpgroup 0 or 1, or (2) the memory warpgroup."""
        b, prefix, row0, _, t_lo, t_hi = locate()
        total = prefix + n_nodes
        t_full = jnp.clip(lax.div(prefix, BLOCK_K), t_lo, t_hi)  # tiles [t_lo, t_full) lie wholly inside the prefix

        def meet():
            plgpu.barrier_arrive(meet_bar)
            plgpu.barrier_wait(meet_bar)

        def row_bcast(v, like):
            return lax.broadcast_in_dim(v, like.shape, [0])

        def scores(t, slot, words, masked: bool, first: int):
            """S = Q K^T * scale * log2(e) `[64, hk]` f32 over slots [first, first + hk) of tile t once it has landed
            in `slot`; masked: slots past the visible length and tree slots that are not ancestors are -inf."""
            plgpu.barrier_wait(kv_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kv_smem.at[slot, pl.ds(first, hk)].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_R, hk), jnp.float32)) * qk_scale
            if not masked:
                return s
            slot_ids = t * BLOCK_K + first + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            rel = slot_ids - prefix
            word_idx = lax.shift_right_arithmetic(rel, 5)
            word = jnp.zeros_like(rel)
            for k, w in enumerate(words):
                word = jnp.where(word_idx == k, lax.broadcast_in_dim(w, s.shape, [0]), word)
            tree = lax.shift_right_logical(word, rel & 31) & 1
            visible = (slot_ids < total) & ((rel < 0) | (tree == 1))
            return jnp.where(visible, s, -jnp.inf)

        def compute(half: int):
            """Compute warpgroup `half`: S and P of slots [half * hk, (half + 1) * hk) of every tile, and the output
            columns [half * dv / 2, (half + 1) * dv / 2)."""
            cols = pl.ds(half * half_dv, half_dv)
            own, other = pl.ds(half * hk, hk), pl.ds((1 - half) * hk, hk)
            plgpu.barrier_wait(q_bar)
            words = [plgpu.load(words_smem.at[k], layout=_ROW) for k in range(words_smem.shape[0])] if n_nodes else []

            def tile(t, carry, masked: bool):
                """One tile with one meeting: the P half against its reference maximum (the running maximum unless
                the tile's passes it by more than RESCALE_THRESHOLD), published with it; after the meeting both
                halves are rescaled to the agreed maximum in registers (each warpgroup computes the same maximum and
                factors, so the two use the same bf16 P)."""
                acc, m_i, l_i = carry
                slot = lax.rem(t - t_lo, stages)
                s = scores(t, slot, words, masked, first=half * hk)
                m_tile = s.max(axis=1)
                m_ref = jnp.where(m_tile > m_i + RESCALE_THRESHOLD, m_tile, m_i)
                p = jnp.exp2(s - row_bcast(m_ref, s))
                p_sum, p16 = p.sum(axis=1), p.astype(kv_smem.dtype)  # the f32 P is dead from here

                @pl.when(t > t_lo)
                def _():  # the other warpgroup has read the half and maximum published at the previous tile
                    plgpu.barrier_wait(p_bars.at[half])

                p_smem.at[half][...] = p16
                stat_smem.at[half][...] = m_ref
                meet()  # the one meeting: ordinary stores before it, ordinary loads after (no async-proxy fence)
                m_other = plgpu.load(stat_smem.at[1 - half], layout=_ROW)
                p_other = plgpu.load(p_smem.at[1 - half], layout=plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(p_bars.at[1 - half])
                m_new = jnp.maximum(m_ref, m_other)
                alpha, c_own = jnp.exp2(m_i - m_new), jnp.exp2(m_ref - m_new)
                c_other = jnp.exp2(m_other - m_new)
                # In bf16 (packed HMUL2; exact when the factor is 1, the common case): far fewer instructions per
                # tile than through f32.
                rescale = lambda x, c: x * row_bcast(c.astype(x.dtype), x)
                p_own, p_other = rescale(p16, c_own), rescale(p_other, c_other)

                def body(acc_ref):
                    plgpu.wgmma(acc_ref, p_own, kv_smem.at[slot, own, cols])
                    plgpu.wgmma(acc_ref, p_other, kv_smem.at[slot, other, cols])

                acc = pl.run_state(body)(plgpu.ACC.init(scale_rows(acc, alpha)))
                plgpu.barrier_arrive(free_bars.at[slot])
                return acc, m_new, l_i * alpha + p_sum * c_own

            init = (
                plgpu.layout_cast(jnp.zeros((BLOCK_R, half_dv), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((BLOCK_R,), _NEG_INIT, jnp.float32), _ROW),
                plgpu.layout_cast(jnp.zeros((BLOCK_R,), jnp.float32), _ROW),
            )
            carry = lax.fori_loop(t_lo, t_full, functools.partial(tile, masked=False), init)
            acc, m_i, l_i = lax.fori_loop(t_full, t_hi, functools.partial(tile, masked=True), carry)

            @pl.when(t_hi > t_lo)
            def _():  # the other warpgroup has read the last tile's maximum before its row is reused below
                plgpu.barrier_wait(p_bars.at[half])

            stat_smem.at[half][...] = l_i  # the row sums, added across the halves
            meet()
            l_i = l_i + plgpu.load(stat_smem.at[1 - half], layout=_ROW)

            seen = l_i > 0.0
            l_safe = jnp.where(seen, l_i, 1.0)
            out = acc * row_bcast(jnp.where(seen, 1.0 / l_safe, 0.0), acc)
            plgpu.barrier_arrive(done_bar)  # both warpgroups are done reading Q before it is overwritten
            plgpu.barrier_wait(done_bar)
            o_smem.at[half][...] = out.astype(o_smem.dtype)
            if half == 0:
                stat_smem.at[2][...] = jnp.where(seen, m_i / _LOG2E + jnp.log(l_safe), -jnp.inf)
            plgpu.commit_smem()
            b, _, row0, split, _, _ = locate()  # afresh: not kept live across the tiles
            plgpu.copy_smem_to_gmem(o_smem.at[half], o_ref.at[b, split, pl.ds(row0, BLOCK_R), cols])
            if half == 0:
                plgpu.copy_smem_to_gmem(stat_smem.at[2], lse_ref.at[b, split, pl.ds(row0, BLOCK_R)])
            # SMEM must outlive the stores' reads; their writes land before the kernel completes (as in CUTLASS's
            # epilogues): waiting for the writes showed up as a stall in the compute warps.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def memory():
            """Q (and the words), then the CTA's KV tiles through the ring."""

            def load(t):
                step = t - t_lo
                slot = lax.rem(step, stages)

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(free_bars.at[slot])

                # The last tile may run past the cache end: TMA fills those rows with zeros (masked anyway).
                plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(t * BLOCK_K, BLOCK_K)], kv_smem.at[slot], kv_bars.at[slot])

            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, BLOCK_R)], q_smem, q_bar)
            if n_nodes:
                plgpu.copy_gmem_to_smem(words_ref.at[b, :, pl.ds(row0, BLOCK_R)], words_smem, q_bar)
            pl.loop(t_lo, t_hi)(load)
            n = t_hi - t_lo

            @pl.loop(jnp.maximum(n - stages, 0), n)
            def _(step):  # observe the last releases too, so every barrier phase is consumed at the end
                plgpu.barrier_wait(free_bars.at[lax.rem(step, stages)])

        if role == 2:
            memory()
        else:
            compute(role)

    def compute_warpgroup(half: int):
        plgpu.set_max_registers(config.compute_registers, action="increase")
        run(half)

    pl.when(wg == 0)(functools.partial(compute_warpgroup, 0))
    pl.when(wg == 1)(functools.partial(compute_warpgroup, 1))

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(config.memory_registers, action="decrease")
        run(2)


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "config", "interpret"))
def mla_attention_mosaic_split(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array,
    scale: float,
    value_dim: int = 512,
    *,
    config: MosaicMLAConfig,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """`mla_attention_mosaic` with an explicit tiling (its split count chosen for the shapes unless it sets one):
    `[B, N, Hq, value_dim]` in q.dtype.

    interpret: the `InterpretGPUParams` of the test harness (`tests/mosaic_interpret.py`), which extends jax's GPU
    interpreter for this kernel; True is refused (jax's own interpreter cannot run it).
    """
    if interpret is True:
        raise NotImplementedError(
            "interpret mode of the Mosaic MLA kernel needs the test harness's extended GPU interpreter "
            "(tests/mosaic_interpret.py: pass its params()); use the Triton kernel (DDTREE_MLA_KERNEL=triton) instead"
        )
    b, n, heads, dk = q.shape
    length = latent_cache.shape[1]
    if latent_cache.dtype != jnp.bfloat16 or value_dim % 128 or dk % 64:
        raise ValueError(f"need a bf16 cache, value_dim % 128 == 0, dk % 64 == 0; got {latent_cache.dtype} {dk}")
    # TMA of a tiled [8, 64] SMEM layout needs L % 8 == 0, and no box may exceed the cache: other lengths are padded
    # (a copy of the whole cache; allocate caches with L % 8 == 0 and L >= 64 to avoid it).
    if length % 8 or length < BLOCK_K:
        padded = max(BLOCK_K, pl.cdiv(length, 8) * 8)
        logging.warning("mla_mosaic: slow path: cache length %d padded to %d (a cache copy per call)", length, padded)
        latent_cache = jnp.pad(latent_cache, ((0, 0), (0, padded - length), (0, 0)))
        length = padded
    rows = n * heads
    rows_pad = pl.cdiv(rows, BLOCK_R) * BLOCK_R
    qr = jnp.pad(q.reshape(b, rows, dk).astype(latent_cache.dtype), ((0, 0), (0, rows_pad - rows), (0, 0)))
    prefix, tree, n_nodes = tree_inputs(tree_mask, prefix_len, heads, rows_pad)
    n_words = sum(w.shape[1] for w in tree)
    if (need := smem_bytes(config, dk, value_dim, n_words)) > SMEM_LIMIT:
        raise ValueError(f"{config} needs {need} B of shared memory (> {SMEM_LIMIT})")
    splits = config.num_splits or default_config(b, rows, length, config).num_splits

    swizzled = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    kernel = plgpu.kernel(
        functools.partial(
            _kernel, scale=float(scale), n_nodes=n_nodes, value_dim=value_dim, config=config, num_splits=splits
        ),
        out_type=(
            jax.ShapeDtypeStruct((b, splits, rows_pad, value_dim), latent_cache.dtype),
            jax.ShapeDtypeStruct((b, splits, rows_pad), jnp.float32),
        ),
        scratch_types=[
            plgpu.RefUnion(
                plgpu.SMEM((BLOCK_R, dk), latent_cache.dtype, transforms=swizzled),
                plgpu.SMEM((2, BLOCK_R, value_dim // 2), latent_cache.dtype, transforms=swizzled),
            ),
            plgpu.SMEM((config.num_stages, BLOCK_K, dk), latent_cache.dtype, transforms=swizzled),
            *[plgpu.SMEM((w.shape[1], BLOCK_R), jnp.int32) for w in tree],
            plgpu.SMEM((2, BLOCK_R, BLOCK_K // 2), latent_cache.dtype, transforms=swizzled),
            plgpu.SMEM((3, BLOCK_R), jnp.float32),
            plgpu.Barrier(num_arrivals=1 + len(tree)),  # Q and the words land on one barrier
            plgpu.Barrier(num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(rows_pad // BLOCK_R, splits, b),
        grid_names=("rows", "split", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),  # row reductions in-warp
        interpret=interpret,
    )
    o_part, lse = kernel(prefix, qr, latent_cache, *tree)
    return merge_splits(o_part, lse, rows, q.dtype).reshape(b, n, heads, value_dim)


def mla_attention_mosaic(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array,
    scale: float,
    value_dim: int = 512,
    *,
    tiling: MosaicMLAConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """Absorbed-MLA attention of N new nodes over the latent cache; see `reference.mla_attention_reference`.

    q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]` bf16 (new nodes at slots prefix_len[b] + j, prefix_len + N <= L),
    prefix_len `[B]` int32, tree_mask `[B, N, N]` bool -> `[B, N, Hq, value_dim]` in q.dtype. `scale` must be a
    Python float. Drop-in for `mla_attention.mla_attention_pallas`. `tiling`: the kernel's tiling (default
    `MosaicMLAConfig()`), its split count chosen for these shapes unless it sets one. `interpret`: as for
    `mla_attention_mosaic_split`.
    """
    b, n, heads, _ = q.shape
    config = tiling if tiling and tiling.num_splits else default_config(b, n * heads, latent_cache.shape[1], tiling)
    return mla_attention_mosaic_split(
        q, latent_cache, prefix_len, tree_mask, float(scale), value_dim, config=config, interpret=interpret
    )
