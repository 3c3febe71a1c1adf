"""Mosaic GPU (Hopper, sm_90a) kernel for absorbed-MLA decode and tree-verify attention.

Semantics are those of `reference.mla_attention_reference`; the entry points mirror `mla_attention.py`
(`mla_attention_mosaic` ~ `mla_attention_pallas`, `mla_attention_mosaic_split` ~ `mla_attention_split`).

Work layout (FlashMLA-like):

* The `N * Hq` query rows of one sequence (row = node * Hq + head) are padded to blocks of 64 rows; one CTA
  handles one 64-row block against one split (a contiguous range of `block_k`-slot KV tiles, only tiles below
  `prefix_len[b] + N` are read), so grid = (row blocks, splits, batch).
* Three warpgroups per CTA: a memory warpgroup streams Q `[64, 576]` once and the KV tiles `[block_k, 576]` by
  TMA into a `num_stages` SMEM ring; two compute warpgroups each own half of the 512 value columns (a `[64, 256]`
  f32 accumulator = 128 registers per thread).
* Three ways to split the S / softmax work between them (`MosaicMLAConfig.softmax`):
  - "split" (the default): each warpgroup computes S for half of every tile's slots; they exchange row maxima and
    P halves through SMEM, and each adds P V for its columns over the whole tile. No MMA work is repeated. One
    meeting per tile (the halves are rescaled after it; `meetings=2`: two), and a row's running maximum moves only
    past a threshold, the accumulator's rescale skipped in every thread whose rows did not move (`lazy_rescale`);
  - "duplicate": both warpgroups compute S = Q K^T and the masked online softmax of every tile (a third of the MMA
    work is then repeated, at 576 / 512 dims) with an FA3 ping-pong schedule barrier between them;
  - "shared": the tiles alternate between the warpgroups; the owner of a tile computes S and the softmax and
    publishes P (bf16) and the running max / sum in SMEM; each adds P V for its columns, the owner from registers,
    the other from SMEM at the start of its next tile.
* Tiles wholly inside the prefix run unmasked; the last tiles (those touching the N-node block) mask by the slot
  bound and the tree mask, given per row as 32-bit words of ancestor bits (`mla_attention.tree_inputs`; decode
  folds its one node into the prefix and takes no words).
* Each CTA writes a normalised bf16 partial `[64, 512]` (staged in Q's SMEM) and its f32 log-sum-exp;
  `mla_combine.merge_splits` merges the splits.
* `MosaicMLAConfig.schedule="persistent"` (1.1-1.4x slower on the H200; notes_mla, tenth round) launches one CTA
  per SM instead; each takes an equal contiguous range of (sequence, row block, tile) units (`persistent_schedule`,
  FlashMLA-like) and runs the per-row-block work above once per row block its range touches, writing one partial
  each.

SMEM: Q 72 KiB + num_stages * block_k * 1152 B (block_k 64 x 2 stages: 144 KiB) + P 8 KiB + 1 KiB each for the tree
words and the max / sum / LSE rows + barriers = 231,496 B of the 232,448 an H200 CTA may use (every buffer starts at
a 1 KiB boundary, and the kernel reserves no cross-warp reduction scratch: its row reductions stay inside a warp);
`smem_bytes` checks it before lowering. Splits: `wave_splits` (one CTA per SM fits, so whole waves matter), with a
CTA's fixed cost fitted on the H200 (`SPLIT_OVERHEAD_SLOTS`).
"""

from __future__ import annotations

import dataclasses
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

from pallas_kernels import mosaic_interpret
from pallas_kernels.mla_attention import tree_inputs
from pallas_kernels.mla_combine import check_combine, merge_splits

BLOCK_R = 64  # query rows per CTA (one wgmma M tile)
SMEM_LIMIT = 232_448  # bytes of shared memory one CTA may use on an H100 / H200
_LOG2E = math.log2(math.e)
_NEG_INIT = -1e30  # finite running-max start: fully masked tiles never produce inf - inf
_ROW = plgpu.Layout.WGMMA.reduce(1)
RESCALE_THRESHOLD = 8.0  # lazy_rescale: log2 units a row's scores may pass its running maximum (P <= 2^8)
SOFTMAX_MODES = ("split", "duplicate", "shared")  # MosaicMLAConfig.softmax
SCHEDULES = ("grid", "persistent")  # MosaicMLAConfig.schedule
# Registers per thread the 384-thread CTA launches with: 64K per SM, in steps of 8 (168, as ncu reports).
LAUNCH_REGISTERS = 65536 // (3 * 128) // 8 * 8
# Interpret mode as the hardware behaves here: TMA reads past the cache end give zeros.
INTERPRET_PARAMS = plgpu.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


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


# Interpret mode (`mosaic_interpret`) runs this instead: the same values, with no branch.
_scale_moved_rows.interpret_as = lambda alpha, acc: acc * alpha[:, None]


def scale_rows(acc: jax.Array, alpha: jax.Array) -> jax.Array:
    """acc `[64, n]` f32 (WGMMA layout) times alpha `[64]` (its row layout) row by row, where a thread whose rows
    all have alpha == 1 skips its multiplies (`MosaicMLAConfig.lazy_rescale`)."""
    out = plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=plgpu.Layout.WGMMA)
    return plgpu.inline_mgpu(arg_types=(_ROW, plgpu.Layout.WGMMA), return_type=out)(_scale_moved_rows)(alpha, acc)


@dataclasses.dataclass(frozen=True)
class MosaicMLAConfig:
    """Tiling of the kernel. `num_splits=0` picks the split count from the problem size (`wave_splits`).

    softmax: how the two compute warpgroups divide S = Q K^T and the softmax of each tile (timings:
    experiments/notes_mla.md).
      "split" (default): each computes S and P for its half of every tile's slots, the two exchange the row maxima
        and their P halves through SMEM, and each adds P V for its value columns with the whole P
        (`compute_split`): no MMA work is repeated. P V then runs in two K = block_k / 2 halves, so the swizzle is
        64 bytes for 64-slot tiles.
      "duplicate": both compute S for every tile (`compute_duplicated`, FA3 ping-pong with `schedule_barrier`).
      "shared": tiles alternate between them; the owner of a tile computes S and the softmax once and passes P
        (bf16, SMEM) and the running max / sum to the other (`compute_shared`).
    swap_fence: True runs `commit_smem` (an async-proxy fence and a warpgroup barrier) before the split softmax's
      row-maximum swap. The maxima are read by ordinary loads after every thread's release-arrive on the meeting
      barrier, so the fence is not needed: off by default (1-8 % faster, bench_mla_tilings_verify).
    overlap: software-pipeline the split softmax's tiles (`compute_split`): each step's own-half P V runs on the
      tensor cores under the next tile's softmax, and S of the next tile is issued beside the other half's P V.
      The first two versions were serialised by ptxas (C7513; notes_mla, sixth round); this one is not
      (`experiments.ptxas_report`) but is still 1.1-1.4x slower than the default at decode and verify on the H200
      (more registers, spills; bench_mla_overlap_verify, notes_mla seventh round).
    meetings: warpgroup meetings per tile of the split softmax (`compute_split`); None (default): 1 for the split
      softmax without overlap, else 2. 2: the row maxima are agreed at the first and the P halves exchanged at the
      second (the other's half then read by wgmma from SMEM). 1: each publishes its P half computed against
      max(running maximum, its tile maximum), together with that maximum, and after the one meeting reads the other's
      half into registers and rescales both halves to the agreed maximum (a bf16 multiply by a factor of 1 unless a
      row's maximum grew); a one-way barrier per half (`p_bars`) keeps a warpgroup from overwriting a half the other
      has not read yet.
    lazy_rescale: (split softmax, no overlap; None (default): on there, off elsewhere) FA4's conditional rescaling: a
      row's running maximum moves only when the tile's maximum passes it by more than RESCALE_THRESHOLD (log2 units;
      P <= 2^8 otherwise, exact either way), so after the first tiles alpha is 1 for nearly every row, and the
      `[64, 256]` accumulator's rescale (128 FMULs per thread per tile, on the path to the P V wgmma) is skipped by
      every thread whose rows did not move (`scale_rows`). With `meetings=1` and 240 registers (the defaults) 3-8 %
      faster than the two-meeting, eager-rescale kernel at 232 registers in 7 of 8 verify cells at 8192 slots, the
      same at B8 decode (bench_mla_adopt_verify / _decode, notes_mla tenth round).
    compute_registers: `setmaxnreg` of the compute warpgroups; the memory warpgroup gets `memory_registers`. At
      240 (default) the split softmax's tile loops spill nothing (ptxas_sass).
    schedule: how the work is laid out on CTAs.
      "grid" (default): one CTA per (row block, split, sequence); `num_splits` splits of the context.
      "persistent": `ctas` CTAs (0: one per SM) each take an equal contiguous range of the (sequence, row block,
        tile) units, FlashMLA-like (`persistent_schedule`): no wave quantisation, one Q load and one partial per
        row block a CTA touches (typically one or two) instead of one per split. `num_splits` then caps the
        partials per row block (0: `persistent_pieces`). 1.1-1.4x slower than "grid" on the H200 at decode and
        verify (bench_mla_schedule_*).
    combine: how the splits are merged (`mla_combine.merge_splits`): "xla" (three small XLA kernels), "fused" (the
      same sums split by split, so XLA can fuse them; as fast as "xla" at decode) or "pallas" (one Pallas kernel;
      slower but with many splits, bench_mla_combine_*).
    """

    block_k: int = 64
    num_stages: int = 2
    num_splits: int = 0
    schedule_barrier: bool = True
    softmax: str = "split"
    swap_fence: bool = False
    compute_registers: int = 240
    overlap: bool = False
    combine: str = "xla"
    meetings: int | None = None
    lazy_rescale: bool | None = None
    schedule: str = "grid"
    ctas: int = 0

    def __post_init__(self):
        plain_split = self.softmax == "split" and not self.overlap  # where one meeting and the lazy rescale apply
        if self.meetings is None:
            object.__setattr__(self, "meetings", 1 if plain_split else 2)
        if self.lazy_rescale is None:
            object.__setattr__(self, "lazy_rescale", plain_split)
        if self.softmax not in SOFTMAX_MODES:
            raise ValueError(f"softmax must be one of {SOFTMAX_MODES}: {self}")
        if self.compute_registers % 8 or not 128 <= self.compute_registers <= 240:
            raise ValueError(f"compute_registers must be a multiple of 8 in [128, 240]: {self}")
        check_combine(self.combine, self)
        if self.schedule not in SCHEDULES or self.ctas < 0 or self.num_splits < 0:
            raise ValueError(f"schedule must be one of {SCHEDULES}, ctas and num_splits >= 0: {self}")
        if self.schedule == "persistent" and self.num_splits == 1:
            raise ValueError(f"the persistent schedule needs num_splits (partials per row block) 0 or >= 2: {self}")
        if self.overlap and self.softmax != "split":
            raise ValueError(f"overlap pipelines the split softmax only: {self}")
        if self.meetings not in (1, 2) or (self.meetings == 1 and (self.softmax != "split" or self.overlap)):
            raise ValueError(f"meetings is 2, or 1 with the split softmax and no overlap: {self}")
        if self.lazy_rescale and (self.softmax != "split" or self.overlap):
            raise ValueError(f"lazy_rescale needs the split softmax without overlap: {self}")
        if self.pv_k % 32 or self.num_stages < 1:  # P V's K dim fills whole swizzle tiles (32 or 64 columns)
            raise ValueError(f"P V's K dim (block_k, halved by the split softmax) must be a multiple of 32: {self}")

    @classmethod
    def from_text(cls, text: str) -> MosaicMLAConfig:
        """'field=value,...' -> the config with those fields set, the others at their defaults ('' -> the
        default; `meetings` and `lazy_rescale` then follow the softmax and overlap given); a ValueError
        naming the problem for an unknown field, a value of the wrong type or an impossible tiling."""
        default, names = cls(), sorted(f.name for f in dataclasses.fields(cls))
        changes: dict[str, object] = {}
        for item in filter(None, text.split(",")):
            name, eq, value = item.partition("=")
            if not eq or name not in names:
                raise ValueError(f"tiling {text!r}: {item!r} is not FIELD=VALUE with FIELD one of {names}")
            kind = type(getattr(default, name))
            if kind is bool and value.lower() not in ("true", "false"):
                raise ValueError(f"tiling {text!r}: {name} takes true or false, not {value!r}")
            try:
                changes[name] = value.lower() == "true" if kind is bool else kind(value)
            except ValueError:
                raise ValueError(f"tiling {text!r}: {name} takes an {kind.__name__}, not {value!r}") from None
        try:
            return cls(**changes)
        except ValueError as e:
            raise ValueError(f"tiling {text!r}: {e}") from None

    @property
    def pv_k(self) -> int:
        """K dim of one P V product: the tile's slots, or half of them with the split softmax."""
        return self.block_k // 2 if self.softmax == "split" else self.block_k

    @property
    def memory_registers(self) -> int:
        """Registers per thread left to the memory warpgroup, at most 40 (FA3 gives its producer 24-40). The CTA
        is launched with LAUNCH_REGISTERS per thread, and `setmaxnreg` only moves registers between its warpgroups:
        an increase past the pool waits forever (240 / 32, asking 1,024 more than the pool, hung on the H200)."""
        return min(40, 3 * LAUNCH_REGISTERS - 2 * self.compute_registers)

    @property
    def swizzle(self) -> int:
        """Bytes of the SMEM swizzle of Q, the KV ring and P: 128, or 64 when P V's K dim is 32 (one wgmma takes
        one swizzle for both operands, and K must fill whole swizzle tiles)."""
        return 64 if self.pv_k % 64 else 128


def smem_bytes(config: MosaicMLAConfig, dk: int = 576, value_dim: int = 512, n_words: int = 1) -> int:
    """Shared memory of one CTA: Q (aliased with the bf16 output), the KV ring, the tree words, the shared P
    `[64, block_k]` bf16 (allocated either way), the running max / sum / LSE rows, each at a 1 KiB boundary, then
    the barriers (8 B each)."""
    kib = lambda n: pl.cdiv(n, 1024) * 1024
    buffers = (
        2 * BLOCK_R * max(dk, value_dim),
        2 * dk * config.num_stages * config.block_k,
        4 * n_words * BLOCK_R,
        2 * BLOCK_R * config.block_k,
        4 * 3 * BLOCK_R,
    )
    barriers = 1 + 2 * config.num_stages + 2 + 2 + (config.schedule == "persistent")
    return sum(map(kib, buffers)) + 8 * barriers


def _kernel(
    prefix_ref,
    sched_ref,
    q_ref,
    kv_ref,
    words_ref,
    o_ref,
    lse_ref,
    q_o_smem,
    kv_smem,
    words_smem,
    p_smem,
    stat_smem,
    q_bar,
    kv_bars,
    free_bars,
    sched_bar,
    done_bar,
    p_bars,
    q_free,
    *,
    scale: float,
    n_nodes: int,
    value_dim: int,
    config: MosaicMLAConfig,
    num_splits: int,
):
    """One CTA of three warpgroups ("wg" 0, 1: compute; 2: memory): one (row block, split, sequence) on the grid
    schedule, a contiguous range of (sequence, row block, tile) units on the persistent one (`for_each_segment`).

    GMEM: prefix_ref `[B]` int32, sched_ref `[B + 2]` int32 (persistent schedule, else None), q_ref `[B, R, dk]`,
    kv_ref `[B, L, dk]`, words_ref `[B, W, R]` int32 (None, with words_smem, when n_nodes == 0: no tree block);
    outputs o_ref `[B, S, R, dv]` bf16 (normalised partials: S splits or pieces), lse_ref `[B, S, R]` f32.
    SMEM: q_o_smem = (Q `[64, dk]`, the output `[2, 64, dv / 2]` in the same memory), kv_smem
    `[stages, block_k, dk]`, words_smem `[W, 64]`, p_smem (shared softmax: the last published P `[64, block_k]`;
    split: the two P halves `[2, 64, block_k / 2]`) and stat_smem `[3, 64]` f32 (rows 0, 1: shared: that P's
    running max and sum; split: each warpgroup's row maximum, at the end its row sum; row 2: the output LSE).
    Every SMEM buffer is placed at a 1 KiB boundary, so the small ones share one. p_bars[h]: shared softmax:
    warpgroup h published P; split with one meeting: the other warpgroup has read P half h and row maximum h.
    q_free (persistent schedule, else None): both compute warpgroups' output stores have read SMEM.
    """
    block_k, stages = config.block_k, config.num_stages
    q_smem, o_smem = q_o_smem
    half_dv = value_dim // 2
    wg = lax.axis_index("wg")
    qk_scale = scale * _LOG2E

    def tiles_of(prefix):
        """KV tiles of a sequence with this visible prefix: the prefix and the tree block."""
        return lax.div(prefix + n_nodes + (block_k - 1), block_k)

    def for_each_segment(body) -> jax.Array:
        """body(locate, first) for each segment (tiles [t_lo, t_hi) of one row block) of this CTA, where locate()
        gives (b, prefix_ref[b], row0, piece, t_lo, t_hi) afresh (the epilogue calls it again, so those scalars
        need not stay live across the tile loop); returns whether any segment ran. Grid: the CTA's (row block,
        split, sequence), piece = split. Persistent (sched_ref = [unit offsets of the B sequences, total units,
        units per CTA]): units are (sequence, row block, tile) in that order; CTA c takes units
        [c * per_cta, (c + 1) * per_cta) and piece = c minus the first CTA of the row block (`persistent_schedule`)."""
        if sched_ref is None:

            def locate_split():
                b, split = lax.axis_index("batch"), lax.axis_index("split")  # one segment
                prefix = prefix_ref[b]
                n_tiles = tiles_of(prefix)
                per_split = lax.div(n_tiles + (num_splits - 1), num_splits)
                t_lo = jnp.minimum(split * per_split, n_tiles)
                t_hi = jnp.minimum(t_lo + per_split, n_tiles)
                return b, prefix, lax.axis_index("rows") * BLOCK_R, split, t_lo, t_hi

            body(locate_split, True)
            return jnp.bool_(True)
        batch = prefix_ref.shape[0]
        cta = lax.axis_index("cta")
        u_hi = lambda: jnp.minimum(cta * sched_ref[batch + 1] + sched_ref[batch + 1], sched_ref[batch])

        def locate_unit(u):
            """(b, prefix, row0, piece, t_lo, t_hi) of the segment starting at unit u, and its end unit."""
            # The last sequence starting at or before u (a sequence with no tiles starts where the next one does).
            b = functools.reduce(jnp.add, [(sched_ref[j] <= u).astype(jnp.int32) for j in range(1, batch)], 0)
            start, prefix = sched_ref[b], prefix_ref[b]
            n_tiles = tiles_of(prefix)
            row_block = lax.div(u - start, n_tiles)
            block_start = start + row_block * n_tiles
            end = jnp.minimum(u_hi(), block_start + n_tiles)
            piece = cta - lax.div(block_start, sched_ref[batch + 1])
            return (b, prefix, row_block * BLOCK_R, piece, u - block_start, end - block_start), end

        u_lo = lambda: cta * sched_ref[batch + 1]

        def segment(u):  # u: the segment's first unit
            body(lambda: locate_unit(u)[0], u == u_lo())
            return locate_unit(u)[1]

        lax.while_loop(lambda u: u < u_hi(), segment, u_lo())
        return u_lo() < u_hi()

    def run_segment(role: int, locate, first_segment):
        """Warpgroup `role`'s work on one segment: tiles [t_lo, t_hi) of sequence b's row block at row0, written
        as partial `piece` (`for_each_segment`)."""
        b, prefix, row0, _, t_lo, t_hi = locate()
        total = prefix + n_nodes
        t_full = jnp.clip(lax.div(prefix, block_k), t_lo, t_hi)  # tiles [t_lo, t_full) lie wholly inside the prefix

        def schedule():
            plgpu.barrier_arrive(sched_bar)
            plgpu.barrier_wait(sched_bar)

        def row_bcast(v, like):
            return lax.broadcast_in_dim(v, like.shape, [0])

        def scores(t, slot, words, masked: bool, ping_pong: bool, first: int = 0, width: int = block_k):
            """S = Q K^T * scale * log2(e) `[64, width]` f32 over slots [first, first + width) of tile t once it has
            landed in `slot`; masked: slots past the visible length and tree slots that are not ancestors are -inf."""
            plgpu.barrier_wait(kv_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, kv_smem.at[slot, pl.ds(first, width)].transpose((1, 0)))
                if ping_pong:
                    schedule()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_R, width), jnp.float32)) * qk_scale
            return mask_scores(t, s, words, first) if masked else s

        def mask_scores(t, s, words, first: int):
            """S `[64, width]` of slots [first, first + width) of tile t with the invisible slots at -inf."""
            slot_ids = t * block_k + first + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
            rel = slot_ids - prefix
            word_idx = lax.shift_right_arithmetic(rel, 5)
            word = jnp.zeros_like(rel)
            for k, w in enumerate(words):
                word = jnp.where(word_idx == k, lax.broadcast_in_dim(w, s.shape, [0]), word)
            tree = lax.shift_right_logical(word, rel & 31) & 1
            visible = (slot_ids < total) & ((rel < 0) | (tree == 1))
            return jnp.where(visible, s, -jnp.inf)

        def pv(acc, p, slot, cols):
            """acc += P V_slot[:, cols] (P in registers or SMEM); then this warpgroup is done with the slot."""

            def body(acc_ref):
                plgpu.wgmma(acc_ref, p, kv_smem.at[slot, :, cols])

            acc = pl.run_state(body)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(free_bars.at[slot])
            return acc

        def init_carry():
            return (
                plgpu.layout_cast(jnp.zeros((BLOCK_R, half_dv), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((BLOCK_R,), _NEG_INIT, jnp.float32), _ROW),
                plgpu.layout_cast(jnp.zeros((BLOCK_R,), jnp.float32), _ROW),
            )

        def compute_duplicated(half: int, words, cols):
            """Both warpgroups compute S and the softmax of every tile (FA3 ping-pong between them)."""
            ping_pong = config.schedule_barrier

            def tile(t, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(t - t_lo, stages)
                s = scores(t, slot, words, masked, ping_pong)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - row_bcast(m_new, s))
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(kv_smem.dtype)
                if ping_pong:
                    schedule()
                return pv(acc * row_bcast(alpha, acc), p16, slot, cols), m_new, l_i

            if ping_pong and half == 1:
                schedule()
            carry = lax.fori_loop(t_lo, t_full, functools.partial(tile, masked=False), init_carry())
            carry = lax.fori_loop(t_full, t_hi, functools.partial(tile, masked=True), carry)
            if ping_pong and half == 0:
                schedule()
            return carry

        def compute_shared(half: int, words, cols):
            """Step i = t - t_lo belongs to warpgroup i % 2: it computes S and the softmax of that tile once, publishes
            P and the running (max, sum) in SMEM, then adds its half of P V. The other warpgroup adds its half of P V
            from SMEM at the start of its next step (or at the end), so P is computed once per tile."""
            n = t_hi - t_lo

            def consume(i, carry):
                """acc += P_i V_i[:, cols] with step i's published P; (max, sum) become step i's."""
                acc, m_i, _ = carry
                plgpu.barrier_wait(p_bars.at[1 - half])
                m_new = plgpu.load(stat_smem.at[0], layout=_ROW)
                l_new = plgpu.load(stat_smem.at[1], layout=_ROW)
                acc = pv(acc * row_bcast(jnp.exp2(m_i - m_new), acc), p_smem, lax.rem(i, stages), cols)
                return acc, m_new, l_new

            def own(k, carry, masked: bool):
                i = 2 * k + half
                slot = lax.rem(i, stages)
                s = scores(t_lo + i, slot, words, masked, ping_pong=False)
                acc, m_i, l_i = lax.fori_loop(0, jnp.minimum(i, 1), lambda _, c: consume(i - 1, c), carry)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - row_bcast(m_new, s))
                l_new = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(kv_smem.dtype)
                p_smem[...] = p16  # the other warpgroup read the previous P before it published what we consumed
                stat_smem.at[0][...] = m_new
                stat_smem.at[1][...] = l_new
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_bars.at[half])
                return pv(acc * row_bcast(alpha, acc), p16, slot, cols), m_new, l_new

            own_steps = lambda steps: lax.div(jnp.maximum(steps - half, 0) + 1, 2)  # own steps i < steps
            k_full, k_end = own_steps(t_full - t_lo), own_steps(n)
            carry = lax.fori_loop(0, k_full, functools.partial(own, masked=False), init_carry())
            carry = lax.fori_loop(k_full, k_end, functools.partial(own, masked=True), carry)
            last_is_other = (n >= 1) & (lax.rem(n + 1, 2) != half)  # step n - 1 belongs to the other warpgroup
            return lax.fori_loop(0, last_is_other.astype(jnp.int32), lambda _, c: consume(n - 1, c), carry)

        def compute_split(half: int, words, cols):
            """Warpgroup `half` computes S and P for slots [half * block_k / 2, (half + 1) * block_k / 2) of every tile;
            the two exchange their row maxima (stat_smem rows 0, 1) and P halves (p_smem) at two meetings on sched_bar
            (`schedule`) per tile, and each adds P V for its columns: its own P half from registers, the other's from
            SMEM. The row sums stay per half until the end. config.overlap: `overlapped` runs the tiles instead;
            config.meetings == 1: `tile_one_meeting`."""
            hk = block_k // 2
            own, other = pl.ds(half * hk, hk), pl.ds((1 - half) * hk, hk)

            def swap(row_value):
                """Publish this warpgroup's `[64]` f32 row value and return the other's."""
                stat_smem.at[half][...] = row_value
                if config.swap_fence:
                    plgpu.commit_smem()
                schedule()  # both warpgroups meet (no ping-pong here: sched_bar is free)
                return plgpu.load(stat_smem.at[1 - half], layout=_ROW)

            def reference_max(m_i, m_tile):
                """The row maximum this warpgroup's P half is computed against: max(m_i, m_tile); with lazy_rescale
                m_i unless the tile's maximum passes it by more than RESCALE_THRESHOLD (alpha then stays 1)."""
                if config.lazy_rescale:
                    return jnp.where(m_tile > m_i + RESCALE_THRESHOLD, m_tile, m_i)
                return jnp.maximum(m_i, m_tile)

            def rescale_acc(acc, alpha):
                return scale_rows(acc, alpha) if config.lazy_rescale else acc * row_bcast(alpha, acc)

            def softmax(s, m_i):
                """This warpgroup's S half of a tile -> (running max, rescale alpha, P half in f32); the row maxima
                are agreed with the other warpgroup at a meeting."""
                m_own = reference_max(m_i, s.max(axis=1))
                m_new = jnp.maximum(m_own, swap(m_own))
                alpha = jnp.exp2(m_i - m_new)
                return m_new, alpha, jnp.exp2(s - row_bcast(m_new, s))

            def publish(p):
                """P half -> bf16, also in p_smem[half] once both warpgroups meet. The other warpgroup's reads of that
                buffer must be complete."""
                p16 = p.astype(kv_smem.dtype)
                p_smem.at[half][...] = p16
                plgpu.commit_smem()
                schedule()  # both warpgroups meet (no ping-pong here: sched_bar is free)
                return p16

            def tile(t, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(t - t_lo, stages)
                s = scores(t, slot, words, masked, ping_pong=False, first=half * hk, width=hk)
                # The other warpgroup's last P V, which read p_smem[half], completed before its meeting in `swap`.
                m_new, alpha, p = softmax(s, m_i)
                l_i = l_i * alpha + p.sum(axis=1)  # before the meeting: the f32 P is dead after publish
                p16 = publish(p)

                def body(acc_ref):
                    plgpu.wgmma(acc_ref, p16, kv_smem.at[slot, own, cols])
                    plgpu.wgmma(acc_ref, p_smem.at[1 - half], kv_smem.at[slot, other, cols])

                acc = pl.run_state(body)(plgpu.ACC.init(rescale_acc(acc, alpha)))
                plgpu.barrier_arrive(free_bars.at[slot])
                return acc, m_new, l_i

            def tile_one_meeting(t, carry, masked: bool):
                """`tile` with one meeting: P half against its reference maximum (`reference_max`), published with
                it; after the meeting both halves are rescaled to the agreed maximum in registers (each warpgroup
                computes the same maximum and factors, so the two use the same bf16 P)."""
                acc, m_i, l_i = carry
                slot = lax.rem(t - t_lo, stages)
                s = scores(t, slot, words, masked, ping_pong=False, first=half * hk, width=hk)
                m_ref = reference_max(m_i, s.max(axis=1))
                p = jnp.exp2(s - row_bcast(m_ref, s))
                p_sum, p16 = p.sum(axis=1), p.astype(kv_smem.dtype)  # the f32 P is dead from here

                @pl.when(t > t_lo)
                def _():  # the other warpgroup has read the half and maximum published at the previous tile
                    plgpu.barrier_wait(p_bars.at[half])

                p_smem.at[half][...] = p16
                stat_smem.at[half][...] = m_ref
                schedule()  # the one meeting: ordinary stores before it, ordinary loads after (no async-proxy fence)
                m_other = plgpu.load(stat_smem.at[1 - half], layout=_ROW)
                p_other = plgpu.load(p_smem.at[1 - half], layout=plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(p_bars.at[1 - half])
                m_new = jnp.maximum(m_ref, m_other)
                alpha, c_own = jnp.exp2(m_i - m_new), jnp.exp2(m_ref - m_new)
                c_other = jnp.exp2(m_other - m_new)
                # In bf16 (packed HMUL2; exact when the factor is 1, the common case): through f32 it took 115
                # more instructions per tile than `tile`, this 27 (`ptxas_report --sass`, record ptxas_sass).
                rescale = lambda x, c: x * row_bcast(c.astype(x.dtype), x)
                p_own, p_other = rescale(p16, c_own), rescale(p_other, c_other)

                def body(acc_ref):
                    plgpu.wgmma(acc_ref, p_own, kv_smem.at[slot, own, cols])
                    plgpu.wgmma(acc_ref, p_other, kv_smem.at[slot, other, cols])

                acc = pl.run_state(body)(plgpu.ACC.init(rescale_acc(acc, alpha)))
                plgpu.barrier_arrive(free_bars.at[slot])
                return acc, m_new, l_i * alpha + p_sum * c_own

            def overlapped():
                """The tiles software-pipelined: step t issues S of tile t + 1, P_t V_t for the other warpgroup's P half
                (SMEM), then P_t V_t for its own half (registers), and waits only for the first two (wgmma groups
                complete in order) before the softmax of tile t + 1; the own-half P V runs on under it. The other's
                P buffer is free again at the max swap, since both warpgroups have read it by then."""

                def first_tile(t, carry):
                    acc, m_i, l_i, _, _ = carry
                    s = scores(t, 0, words, masked=True, ping_pong=False, first=half * hk, width=hk)
                    m_new, alpha, p = softmax(s, m_i)
                    return acc, m_new, l_i * alpha + p.sum(axis=1), alpha, publish(p)

                def step(t, carry, next_masked: bool | None):
                    """P V of tile t, and S and the softmax of tile t + 1 unless next_masked is None (the last)."""
                    acc, m_i, l_i, alpha, p16 = carry
                    slot, nxt = lax.rem(t - t_lo, stages), lax.rem(t + 1 - t_lo, stages)
                    if next_masked is not None:  # the wait loop must not sit between the wgmma fence and the wgmmas
                        plgpu.barrier_wait(kv_bars.at[nxt])  # (ptxas then injects its own fence, C7519)

                    def body(acc_ref, s_ref):
                        acc_ref[...] = acc * row_bcast(alpha, acc)
                        if next_masked is not None:
                            plgpu.wgmma(s_ref, q_smem, kv_smem.at[nxt, own].transpose((1, 0)))
                        plgpu.wgmma(acc_ref, p_smem.at[1 - half], kv_smem.at[slot, other, cols])
                        plgpu.wgmma(acc_ref, p16, kv_smem.at[slot, own, cols])
                        if next_masked is None:
                            return acc_ref[...], m_i, l_i, alpha, p16
                        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1) * qk_scale
                        s = mask_scores(t + 1, s, words, half * hk) if next_masked else s
                        m_new, alpha_new, p = softmax(s, m_i)
                        # The next P is made bf16 only once the P V reading this one from registers has completed:
                        # LLVM gives it the same registers, and a write to a running wgmma's operand makes ptxas
                        # serialise every wgmma (C7513). The barrier (side-effecting asm) keeps p after the wait.
                        acc_out, p = lax.optimization_barrier((acc_ref[...], p))
                        return acc_out, m_new, l_i * alpha_new + p.sum(axis=1), alpha_new, publish(p)

                    out = pl.run_scoped(
                        body, plgpu.ACC((BLOCK_R, half_dv), jnp.float32), plgpu.ACC((BLOCK_R, hk), jnp.float32)
                    )
                    plgpu.barrier_arrive(free_bars.at[slot])
                    return out

                p0 = plgpu.layout_cast(jnp.zeros((BLOCK_R, hk), kv_smem.dtype), plgpu.Layout.WGMMA)
                carry = (*init_carry(), plgpu.layout_cast(jnp.ones((BLOCK_R,), jnp.float32), _ROW), p0)
                carry = lax.fori_loop(t_lo, jnp.minimum(t_lo + 1, t_hi), first_tile, carry)
                mid = jnp.maximum(t_lo, t_full - 1)  # steps before mid have their next tile wholly inside the prefix
                carry = lax.fori_loop(t_lo, mid, functools.partial(step, next_masked=False), carry)
                carry = lax.fori_loop(mid, t_hi - 1, functools.partial(step, next_masked=True), carry)
                carry = lax.fori_loop(
                    jnp.maximum(t_hi - 1, t_lo), t_hi, functools.partial(step, next_masked=None), carry
                )
                return carry[:3]

            if config.overlap:
                acc, m_i, l_i = overlapped()
            else:
                step = tile_one_meeting if config.meetings == 1 else tile
                carry = lax.fori_loop(t_lo, t_full, functools.partial(step, masked=False), init_carry())
                acc, m_i, l_i = lax.fori_loop(t_full, t_hi, functools.partial(step, masked=True), carry)
                if config.meetings == 1:  # the other warpgroup has read the last tile maximum before swap reuses it

                    @pl.when(t_hi > t_lo)
                    def _():
                        plgpu.barrier_wait(p_bars.at[half])

            return acc, m_i, l_i + swap(l_i)

        def compute(half: int):
            """Compute warpgroup `half`: output columns [half * dv / 2, (half + 1) * dv / 2)."""
            cols = pl.ds(half * half_dv, half_dv)
            plgpu.barrier_wait(q_bar)
            words = [plgpu.load(words_smem.at[k], layout=_ROW) for k in range(words_smem.shape[0])] if n_nodes else []
            run = {"split": compute_split, "duplicate": compute_duplicated, "shared": compute_shared}[config.softmax]
            acc, m_i, l_i = run(half, words, cols)

            seen = l_i > 0.0
            l_safe = jnp.where(seen, l_i, 1.0)
            out = acc * row_bcast(jnp.where(seen, 1.0 / l_safe, 0.0), acc)
            plgpu.barrier_arrive(done_bar)  # both warpgroups are done reading Q before it is overwritten
            plgpu.barrier_wait(done_bar)
            o_smem.at[half][...] = out.astype(o_smem.dtype)
            if half == 0:
                stat_smem.at[2][...] = jnp.where(seen, m_i / _LOG2E + jnp.log(l_safe), -jnp.inf)
            plgpu.commit_smem()
            b, _, row0, piece, _, _ = locate()  # afresh: not kept live across the tiles
            plgpu.copy_smem_to_gmem(o_smem.at[half], o_ref.at[b, piece, pl.ds(row0, BLOCK_R), cols])
            if half == 0:
                plgpu.copy_smem_to_gmem(stat_smem.at[2], lse_ref.at[b, piece, pl.ds(row0, BLOCK_R)])
            # SMEM must outlive the stores' reads; their writes land before the kernel completes (CUTLASS's epilogues
            # wait the same way). Waiting for the writes took 4.8 % of the verify kernel's compute-warp samples
            # (ncu_mla_stalls).
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if q_free is not None:  # the memory warpgroup may load the next segment's Q (and words) now
                plgpu.barrier_arrive(q_free)

        def memory():
            """Q (and the words), then the segment's KV tiles through the ring; with a persistent schedule, a later
            segment's first `stages` tiles go before its Q, whose SMEM waits for the last segment's epilogue."""

            def load(t):
                step = t - t_lo
                slot = lax.rem(step, stages)

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(free_bars.at[slot])

                # The last tile may run past the cache end: TMA fills those rows with zeros (masked anyway).
                plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(t * block_k, block_k)], kv_smem.at[slot], kv_bars.at[slot])

            t_early = t_lo  # tiles [t_lo, t_early) go before Q
            if q_free is not None:  # the ring is empty between segments
                t_early = jnp.where(first_segment, t_lo, jnp.minimum(t_lo + stages, t_hi))
                pl.loop(t_lo, t_early)(load)
                pl.when(jnp.logical_not(first_segment))(lambda: plgpu.barrier_wait(q_free))
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, BLOCK_R)], q_smem, q_bar)
            if n_nodes:
                plgpu.copy_gmem_to_smem(words_ref.at[b, :, pl.ds(row0, BLOCK_R)], words_smem, q_bar)
            pl.loop(t_early, t_hi)(load)

            n = t_hi - t_lo

            @pl.loop(jnp.maximum(n - stages, 0), n)
            def _(step):  # observe the last releases too, so every barrier phase is consumed at the segment's end
                plgpu.barrier_wait(free_bars.at[lax.rem(step, stages)])

        if role == 2:
            memory()
        else:
            compute(role)

    def compute_warpgroup(half: int):
        plgpu.set_max_registers(config.compute_registers, action="increase")
        for_each_segment(functools.partial(run_segment, half))

    pl.when(wg == 0)(functools.partial(compute_warpgroup, 0))
    pl.when(wg == 1)(functools.partial(compute_warpgroup, 1))

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(config.memory_registers, action="decrease")
        ran = for_each_segment(functools.partial(run_segment, 2))
        if q_free is not None:  # observe the last epilogue's arrival too
            pl.when(ran)(lambda: plgpu.barrier_wait(q_free))


def _kernel_entry(*refs, persistent: bool, **params):
    """`_kernel` with None for what this call does not take: the schedule and q_free (grid schedule), the words
    input and SMEM (no tree block, n_nodes == 0)."""
    refs, words = list(refs), params["n_nodes"] > 0
    take = lambda present: refs.pop(0) if present else None
    ins = [take(True), take(persistent), take(True), take(True), take(words)]
    outs_and_smem = [take(True) for _ in range(4)] + [take(words)]
    scratch = [take(True) for _ in range(8)] + [take(persistent)]
    assert not refs, len(refs)
    _kernel(*ins, *outs_and_smem, *scratch, **params)


def sm_count() -> int:
    """Streaming multiprocessors of the default GPU (132 on an H200; also the count assumed off a GPU)."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132) if device.platform == "gpu" else 132


# A CTA's fixed cost (Q load, pipeline fill, epilogue, its part of the merge) in KV slots, for `wave_splits`. Fitted
# on the H200 to verify 8192 / 17 / 8 / 64 (136 CTAs a split) timed at 6, 8, 10, 13 and 16 splits in one run
# (bench_mla_verify_splits): time / modelled tile-times ranges over 4.5 % at 256 slots, 11 % at 128 (the earlier
# value, which picked 10 splits, 417 us, where 6 took 391 us). Checked after: at 8192 slots the count it picks was
# the fastest (or within 0.1 % of it) of those timed in 1-10 at 17 and 33 nodes, B1 and B8, 64 and 8 heads
# (bench_mla_split_model_more, bench_mla_split_model_verify), and within 3 % of the best of 2-26 for B8 decode
# (bench_mla_decode_splits).
SPLIT_OVERHEAD_SLOTS = 256


def split_overhead_tiles(block_k: int) -> int:
    """`SPLIT_OVERHEAD_SLOTS` in tiles of `block_k` slots (at least one): the overhead `wave_splits` is given."""
    return max(1, SPLIT_OVERHEAD_SLOTS // block_k)


def wave_splits(ctas: int, n_tiles: int, sms: int, overhead_tiles: int) -> int:
    """KV splits minimising the modelled time waves * (tiles per split + overhead) with one CTA per SM: `ctas`
    CTAs per split run in ceil(ctas * s / sms) waves of ceil(n_tiles / s) + overhead_tiles tile-times each (the
    overhead stands for the Q load, the output write and the combine). Ties go to fewer splits."""
    best, best_cost = 1, None
    for s in range(1, max(1, n_tiles // 2) + 1):
        cost = pl.cdiv(ctas * s, sms) * (pl.cdiv(n_tiles, s) + overhead_tiles)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def default_config(batch: int, rows: int, max_len: int, tiling: MosaicMLAConfig | None = None) -> MosaicMLAConfig:
    """`tiling` (default: 64-slot tiles in a 2-stage ring, S split between the warpgroups) with its split count
    chosen by `wave_splits` for this GPU's SM count (the fixed per-CTA overhead is `SPLIT_OVERHEAD_SLOTS` slots'
    worth of tiles), or on the persistent schedule its cap on partials per row block (`persistent_pieces`)."""
    config = tiling or MosaicMLAConfig()
    row_blocks, tiles = batch * pl.cdiv(rows, BLOCK_R), pl.cdiv(max_len, config.block_k)
    if config.schedule == "persistent":
        splits = persistent_pieces(row_blocks, tiles, config.ctas or sm_count())
    else:
        splits = wave_splits(row_blocks, tiles, sm_count(), split_overhead_tiles(config.block_k))
    return dataclasses.replace(config, num_splits=splits)


def persistent_pieces(row_blocks: int, max_tiles: int, ctas: int) -> int:
    """Partials per row block the persistent schedule allows by default: with every one of `row_blocks` row blocks
    (all sequences) at `max_tiles` tiles, a CTA takes ceil(row_blocks * max_tiles / ctas) units, and a row block
    then spans at most ceil(max_tiles / that) + 1 CTAs."""
    return pl.cdiv(max_tiles, pl.cdiv(row_blocks * max_tiles, ctas)) + 1


def persistent_schedule(
    prefix: jax.Array, n_nodes: int, block_k: int, row_blocks: int, ctas: int, pieces: int
) -> tuple[jax.Array, jax.Array]:
    """The persistent schedule's inputs, from the visible prefix `[B]` int32 (`tree_inputs`).

    Sequence b has T_b = ceil((prefix[b] + n_nodes) / block_k) tiles per row block and `row_blocks` row blocks;
    its units are numbered from start_b = sum of the earlier sequences' row_blocks * T. CTA c takes units
    [c * per_cta, (c + 1) * per_cta), per_cta = max(ceil(total / ctas), ceil(max_b T_b / (pieces - 1))), so no row
    block spans more than `pieces` CTAs. Returns (sched `[B + 2]` int32: start_0..start_B (= total), per_cta;
    valid `[B, pieces, row_blocks]` bool: which partials of each row block the kernel writes)."""
    tiles = (prefix + (n_nodes + block_k - 1)) // block_k
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(row_blocks * tiles, dtype=jnp.int32)])
    per_cta = jnp.maximum(pl.cdiv(starts[-1], ctas), pl.cdiv(jnp.max(tiles), pieces - 1))
    per_cta = jnp.maximum(per_cta, 1)
    block_starts = starts[:-1, None] + jnp.arange(row_blocks) * tiles[:, None]  # [B, row_blocks]
    spanned = jnp.where(
        tiles[:, None] > 0, (block_starts + tiles[:, None] - 1) // per_cta - block_starts // per_cta + 1, 0
    )
    valid = jnp.arange(pieces)[None, :, None] < spanned[:, None, :]
    return jnp.concatenate([starts, per_cta[None]]).astype(jnp.int32), valid


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
    """`mla_attention_mosaic` with an explicit tiling: `[B, N, Hq, value_dim]` in q.dtype.

    interpret: run in Mosaic GPU interpret mode on CPU; True means `INTERPRET_PARAMS`. The interpreter is patched
    for this kernel first (`mosaic_interpret.install`).
    """
    b, n, heads, dk = q.shape
    length = latent_cache.shape[1]
    if interpret:
        mosaic_interpret.install()
    if latent_cache.dtype != jnp.bfloat16 or value_dim % 128 or dk % 64:
        raise ValueError(f"need a bf16 cache, value_dim % 128 == 0, dk % 64 == 0; got {latent_cache.dtype} {dk}")
    block_k = config.block_k
    # TMA of a tiled [8, 64] SMEM layout needs L % 8 == 0, and no box may exceed the cache: other lengths are padded
    # (a copy of the whole cache; allocate caches with L % 8 == 0 and L >= block_k to avoid it).
    if length % 8 or length < block_k:
        padded = max(block_k, pl.cdiv(length, 8) * 8)
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
    persistent, row_blocks = config.schedule == "persistent", rows_pad // BLOCK_R
    pieces = config.num_splits or default_config(b, rows, length, config).num_splits
    if persistent:
        ctas = config.ctas or sm_count()
        sched, valid = persistent_schedule(prefix, n_nodes, block_k, row_blocks, ctas, pieces)
        schedule_in, grid, grid_names = [sched], (ctas,), ("cta",)
    else:
        schedule_in, grid, grid_names = [], (row_blocks, pieces, b), ("rows", "split", "batch")

    swizzled = (plgpu.TilingTransform((8, config.swizzle // 2)), plgpu.SwizzleTransform(config.swizzle))
    kernel = plgpu.kernel(
        functools.partial(
            _kernel_entry,
            persistent=persistent,
            scale=float(scale),
            n_nodes=n_nodes,
            value_dim=value_dim,
            config=config,
            num_splits=pieces,
        ),
        out_type=(
            jax.ShapeDtypeStruct((b, pieces, rows_pad, value_dim), latent_cache.dtype),
            jax.ShapeDtypeStruct((b, pieces, rows_pad), jnp.float32),
        ),
        scratch_types=[
            plgpu.RefUnion(
                plgpu.SMEM((BLOCK_R, dk), latent_cache.dtype, transforms=swizzled),
                plgpu.SMEM((2, BLOCK_R, value_dim // 2), latent_cache.dtype, transforms=swizzled),
            ),
            plgpu.SMEM((config.num_stages, block_k, dk), latent_cache.dtype, transforms=swizzled),
            *[plgpu.SMEM((w.shape[1], BLOCK_R), jnp.int32) for w in tree],
            plgpu.SMEM(
                (2, BLOCK_R, block_k // 2) if config.softmax == "split" else (BLOCK_R, block_k),
                latent_cache.dtype,
                transforms=swizzled,
            ),
            plgpu.SMEM((3, BLOCK_R), jnp.float32),
            plgpu.Barrier(num_arrivals=1 + len(tree)),  # Q and the words land on one barrier
            plgpu.Barrier(num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_barriers=2),
            *[plgpu.Barrier(num_arrivals=2) for _ in schedule_in],  # q_free
        ],
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=0
        ),  # row reductions stay in-warp
        interpret=INTERPRET_PARAMS if interpret is True else interpret,
    )
    o_part, lse = kernel(prefix, *schedule_in, qr, latent_cache, *tree)
    if persistent:  # partials no CTA wrote are garbage: they weigh nothing (a select, fused into the XLA merge)
        written = jnp.repeat(valid, BLOCK_R, axis=2)
        o_part, lse = jnp.where(written[..., None], o_part, 0), jnp.where(written, lse, -jnp.inf)
    o = merge_splits(o_part, lse, rows, q.dtype, config.combine, interpret=bool(interpret))
    return o.reshape(b, n, heads, value_dim)


def mla_attention_mosaic(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array,
    scale: float,
    value_dim: int = 512,
    *,
    tiling: MosaicMLAConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed-MLA attention of N new nodes over the latent cache; see `reference.mla_attention_reference`.

    q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]` bf16 (new nodes at slots prefix_len[b] + j, prefix_len + N <= L),
    prefix_len `[B]` int32, tree_mask `[B, N, N]` bool -> `[B, N, Hq, value_dim]` in q.dtype. `scale` must be a
    Python float. Drop-in for `mla_attention.mla_attention_pallas`. `tiling`: the kernel's tiling (default
    `MosaicMLAConfig()`), its split count chosen for these shapes unless it sets one.
    """
    b, n, heads, _ = q.shape
    config = tiling if tiling and tiling.num_splits else default_config(b, n * heads, latent_cache.shape[1], tiling)
    return mla_attention_mosaic_split(
        q, latent_cache, prefix_len, tree_mask, float(scale), value_dim, config=config, interpret=interpret
    )
