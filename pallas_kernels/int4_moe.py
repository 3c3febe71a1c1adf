"""Mosaic GPU (Hopper) kernels for the routed-expert SwiGLU with INT4 group-32 experts.

Semantics: `reference.moe_swiglu_reference`, in the model's load-time layout: gate_up_q int4 `[E, 2I, H]`
(gate rows 0..I-1, up rows I..2I-1) and down_q int4 `[E, H, I]`; bf16 scales group-major, `[E, H/32, 2I]` and
`[E, I/32, H]`: the kernel needs the 64 scales of one 32-column group of a 64-row weight block contiguous in SMEM
(a per-row vector broadcast over the group).

Plan (decode: few tokens per expert, bound by reading the expert weights from HBM):
1. XLA (`route`): group the T*k (token, expert) pairs by expert into tiles of `bt` rows (`choose_bt`); an expert
   with n_e pairs owns ceil(n_e / bt) tiles, padding rows are zero. Activations are gathered group-major,
   xs `[H/32, NT*bt, 32]`. Only experts that received tokens are ever read.
2. Kernel A (`gate_up_pallas`, grid tiles x I/64, one warpgroup per CTA): swap-AB. Per pipeline step (TMA,
   `stages` deep) the CTA gets 64 gate rows and the matching 64 up rows of its tile's expert (`block_k` int4
   columns each), upcasts them to bf16 in registers, multiplies each 32-column group by its scales and issues
   one wgmma per group with the weights as the register LHS (M = 64) and the tile's tokens as N = bt (B = the xs
   group from SMEM, transposed). Epilogue: silu(gate) * up -> hT `[I, NT*bt]` bf16 via SMEM + TMA.
3. Kernel B (`down_pallas`, grid tiles x H/64): the same scheme over K = I -> yT `[H, NT*bt]` f32.
4. XLA (`combine`): out[t] = sum_j w[t, j] * y[row(t, j)] in f32, cast to x.dtype.

Exact mode (`exact=True`, the batch-invariant numerics of docs/exactness.md): every tile has EXACT_BT rows whatever
T is, so a token's row goes through the same wgmma sequence in a call of 1 token as of 1000, and the combine sums a
token's k expert outputs in rank order (`reference.combine_in_rank_order`) instead of an einsum over k.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.reference import combine_in_rank_order

GROUP = 32  # quantization group along the input dim
BLOCK_N = 64  # weight rows per warpgroup (wgmma M)
EXACT_BT = 8  # tokens per tile in exact mode: the smallest wgmma N for bf16, and choose_bt's choice at decode


@dataclasses.dataclass(frozen=True)
class Config:
    """Static tiling: `bt` tokens per tile (wgmma N; None: by T, see `choose_bt`), `block_k` input columns per
    pipeline step, `stages` pipeline steps in flight. 2 stages keep SMEM small (~44 KB per CTA), so several CTAs
    share an SM (timings of other tilings: experiments/notes_moe.md)."""

    bt: int | None = None
    block_k: int = 256
    stages: int = 2


class Grouping(NamedTuple):
    """Expert-grouped layout of the (token, expert) pairs.

    tile_expert: `[NT]` int32 expert of each tile (E-1 for unused tiles); num_tiles: `[1]` int32 tiles in use;
    row_of_pair: `[T*k]` int32 row of each pair (pair p = t*k + j) in the tiled layout `[NT*bt]`.
    """

    tile_expert: jax.Array
    num_tiles: jax.Array
    row_of_pair: jax.Array


def max_tiles(num_pairs: int, num_experts: int, bt: int) -> int:
    """Static bound on the tiles: sum_e ceil(n_e / bt) <= floor(P / bt) + min(P, E)."""
    return num_pairs // bt + min(num_pairs, num_experts)


def group_pairs(topk_ids: jax.Array, num_experts: int, bt: int) -> Grouping:
    """Group the pairs of `topk_ids [T, k]` by expert into tiles of `bt` rows (see `Grouping`).

    Built from dense comparisons ([P, P], [E, P], [E, E], [NT, E]) that XLA fuses into a few kernels: no sort,
    no scan, no data-dependent loop (decode sizes: P = T*k <= 2048).
    """
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    num_pairs = ids.shape[0]
    pairs = jnp.arange(num_pairs, dtype=jnp.int32)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    earlier = (ids[:, None] == ids[None, :]) & (pairs[:, None] > pairs[None, :])
    rank = jnp.sum(earlier, axis=1, dtype=jnp.int32)  # [P] position of the pair among its expert's pairs
    counts = jnp.sum(experts[:, None] == ids[None, :], axis=1, dtype=jnp.int32)
    tiles_per_expert = (counts + bt - 1) // bt
    tile_start = jnp.sum(jnp.where(experts[:, None] > experts[None, :], tiles_per_expert[None, :], 0), axis=1)
    tile_end = tile_start + tiles_per_expert
    tiles = jnp.arange(max_tiles(num_pairs, num_experts, bt), dtype=jnp.int32)
    tile_expert = jnp.sum(tile_end[None, :] <= tiles[:, None], axis=1, dtype=jnp.int32)
    row_of_pair = tile_start[ids] * bt + rank
    num_tiles = jnp.sum(tiles_per_expert, keepdims=True, dtype=jnp.int32)
    return Grouping(jnp.minimum(tile_expert, num_experts - 1), num_tiles, row_of_pair)


def _swizzle_transforms(cols: int, bits: int) -> tuple[plgpu.TilingTransform, plgpu.SwizzleTransform]:
    """Tiling + swizzle for an SMEM tile whose rows hold `cols` elements of `bits` bits (swizzle = row bytes)."""
    swizzle = cols * bits // 8
    return plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(swizzle)


def _scaled_mma(acc_ref, w_smem, s_smem, x_smem, lhs_via_smem: bool) -> None:
    """acc[64, bt] += dequant(w[64, bk] int4, s[bk/32, 64]) @ x[bk/32, bt, 32], one wgmma per 32-column group.

    The dequantized group is the wgmma register LHS. GPU interpret mode only models SMEM wgmma operands, so with
    `lhs_via_smem` (interpret mode) the group is staged through an SMEM buffer instead; the arithmetic is the same.
    """
    w = w_smem[...].astype(jnp.bfloat16)
    for g in range(w.shape[1] // GROUP):
        lhs = w[:, g * GROUP : (g + 1) * GROUP] * s_smem[g][:, None]
        if lhs_via_smem:
            pl.run_scoped(
                functools.partial(_smem_wgmma, acc_ref, lhs, x_smem.at[g].T),
                plgpu.SMEM(lhs.shape, lhs.dtype, transforms=_swizzle_transforms(GROUP, 16)),
            )
        else:
            plgpu.wgmma(acc_ref, lhs, x_smem.at[g].T)
    plgpu.wgmma_wait(0)


def _smem_wgmma(acc_ref, lhs: jax.Array, rhs_ref, lhs_smem) -> None:
    lhs_smem[...] = lhs
    plgpu.commit_smem()
    plgpu.wgmma(acc_ref, lhs_smem, rhs_ref)
    plgpu.wgmma_wait(0)


def _store_tile(value: jax.Array, o_smem, o_gmem_tile) -> None:
    """Write a `[64, bt]` register tile to GMEM through SMEM and TMA."""
    o_smem[...] = value.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem_tile)
    plgpu.wait_smem_to_gmem(0)


def _gate_up_kernel(cfg: Config, lhs_via_smem: bool, tile_expert, num_tiles, xs, wq, ws, h_t, o_smem) -> None:
    """One CTA: tile `t`, intermediate block `nb` -> hT[nb*64:(nb+1)*64, t*bt:(t+1)*bt] = silu(g) * u."""
    t = lax.axis_index("t")
    nb = lax.axis_index("n")
    hidden = xs.shape[0] * GROUP
    inter_blocks = wq.shape[1] // 2 // BLOCK_N
    bk, bt = min(cfg.block_k, hidden), cfg.bt

    @pl.when(t < num_tiles[0])
    def _():
        e = tile_expert[t]
        w_tr = _swizzle_transforms(bk, 4)
        x_tr = _swizzle_transforms(GROUP, 16)

        def compute(acc_g, acc_u):
            specs = [
                plgpu.BlockSpec((BLOCK_N, bk), lambda k: (nb, k), transforms=w_tr),
                plgpu.BlockSpec((BLOCK_N, bk), lambda k: (nb + inter_blocks, k), transforms=w_tr),
                plgpu.BlockSpec((bk // GROUP, BLOCK_N), lambda k: (k, nb)),
                plgpu.BlockSpec((bk // GROUP, BLOCK_N), lambda k: (k, nb + inter_blocks)),
                plgpu.BlockSpec((bk // GROUP, bt, GROUP), lambda k: (k, t, 0), transforms=x_tr),
            ]
            plgpu.emit_pipeline(
                functools.partial(_pipeline_body_gu, acc_g=acc_g, acc_u=acc_u, lhs_via_smem=lhs_via_smem),
                grid=(hidden // bk,),
                in_specs=specs,
                max_concurrent_steps=cfg.stages,
            )(wq.at[e], wq.at[e], ws.at[e], ws.at[e], xs)
            g = acc_g[...]
            u = acc_u[...]
            return g / (1.0 + jnp.exp(-g)) * u

        h = pl.run_scoped(compute, plgpu.ACC((BLOCK_N, bt)), plgpu.ACC((BLOCK_N, bt)))
        _store_tile(h, o_smem, h_t.at[pl.ds(nb * BLOCK_N, BLOCK_N), pl.ds(t * bt, bt)])


def _pipeline_body_gu(_, wg_smem, wu_smem, sg_smem, su_smem, x_smem, *, acc_g, acc_u, lhs_via_smem) -> None:
    """One pipeline step of kernel A: gate and up blocks against the same xs group tiles."""
    _scaled_mma(acc_g, wg_smem, sg_smem, x_smem, lhs_via_smem)
    _scaled_mma(acc_u, wu_smem, su_smem, x_smem, lhs_via_smem)


def _down_kernel(cfg: Config, lhs_via_smem: bool, tile_expert, num_tiles, h, wq, ws, y_t, o_smem) -> None:
    """One CTA: tile `t`, hidden block `nb` -> yT[nb*64:(nb+1)*64, t*bt:(t+1)*bt] = Wd h (f32)."""
    t = lax.axis_index("t")
    nb = lax.axis_index("n")
    inter = h.shape[0] * GROUP
    bk, bt = min(cfg.block_k, inter), cfg.bt

    @pl.when(t < num_tiles[0])
    def _():
        e = tile_expert[t]
        w_tr = _swizzle_transforms(bk, 4)
        x_tr = _swizzle_transforms(GROUP, 16)

        def compute(acc):
            specs = [
                plgpu.BlockSpec((BLOCK_N, bk), lambda k: (nb, k), transforms=w_tr),
                plgpu.BlockSpec((bk // GROUP, BLOCK_N), lambda k: (k, nb)),
                plgpu.BlockSpec((bk // GROUP, bt, GROUP), lambda k: (k, t, 0), transforms=x_tr),
            ]
            plgpu.emit_pipeline(
                lambda _, w_smem, s_smem, x_smem: _scaled_mma(acc, w_smem, s_smem, x_smem, lhs_via_smem),
                grid=(inter // bk,),
                in_specs=specs,
                max_concurrent_steps=cfg.stages,
            )(wq.at[e], ws.at[e], h)
            return acc[...]

        y = pl.run_scoped(compute, plgpu.ACC((BLOCK_N, bt)))
        _store_tile(y, o_smem, y_t.at[pl.ds(nb * BLOCK_N, BLOCK_N), pl.ds(t * bt, bt)])


def gate_up_pallas(cfg: Config, grouping: Grouping, xs, gate_up_q, gate_up_s, interpret=None) -> jax.Array:
    """Kernel A: hT `[I, NT*bt]` bf16 = silu(gate x) * (up x) for the tiles in use (other columns unwritten).

    xs `[H/32, NT*bt, 32]` from `route`; gate_up_s packed `[E, H/32, 2I]`; interpret: None or InterpretGPUParams.
    """
    _, rows, _ = xs.shape
    inter = gate_up_q.shape[1] // 2
    kernel = plgpu.kernel(
        functools.partial(_gate_up_kernel, cfg, interpret is not None),
        out_type=jax.ShapeDtypeStruct((inter, rows), jnp.bfloat16),
        scratch_types=[plgpu.SMEM((BLOCK_N, cfg.bt), jnp.bfloat16)],
        grid=(rows // cfg.bt, inter // BLOCK_N),
        grid_names=("t", "n"),
        interpret=interpret,
    )
    return kernel(grouping.tile_expert, grouping.num_tiles, xs, gate_up_q, gate_up_s)


def down_pallas(cfg: Config, grouping: Grouping, h_t, down_q, down_s, interpret=None) -> jax.Array:
    """Kernel B: yT `[H, NT*bt]` f32 = Wd h for the tiles in use; h_t `[I, NT*bt]` from `gate_up_pallas`."""
    h = _group_major(h_t.T)
    _, rows, _ = h.shape
    hidden = down_q.shape[1]
    kernel = plgpu.kernel(
        functools.partial(_down_kernel, cfg, interpret is not None),
        out_type=jax.ShapeDtypeStruct((hidden, rows), jnp.float32),
        scratch_types=[plgpu.SMEM((BLOCK_N, cfg.bt), jnp.float32)],
        grid=(rows // cfg.bt, hidden // BLOCK_N),
        grid_names=("t", "n"),
        interpret=interpret,
    )
    return kernel(grouping.tile_expert, grouping.num_tiles, h, down_q, down_s)


def _group_major(a: jax.Array) -> jax.Array:
    """`[R, K]` -> `[K/32, R, 32]`: each 32-column group of a tile is then one contiguous SMEM block."""
    rows, cols = a.shape
    return a.reshape(rows, cols // GROUP, GROUP).transpose(1, 0, 2)


def choose_bt(num_tokens: int, k: int, num_experts: int) -> int:
    """Tokens per tile: the expected load per expert m = T*k/E plus two standard deviations, rounded up to 8, at
    most 64. Few experts get a second tile (each re-reads the expert's weights) and the padded wgmma N stays small.
    """
    m = num_tokens * k / num_experts
    return int(min(64, 8 * math.ceil((m + 2 * math.sqrt(m) + 1) / 8)))


def route(x: jax.Array, topk_ids: jax.Array, num_experts: int, cfg: Config) -> tuple[Grouping, jax.Array]:
    """Grouping of the pairs and the gathered activations xs `[H/32, NT*bt, 32]` (zero rows for padding)."""
    t, k = topk_ids.shape
    grouping = group_pairs(topk_ids, num_experts, cfg.bt)
    rows = max_tiles(t * k, num_experts, cfg.bt) * cfg.bt
    pair_of_row = jnp.full((rows,), t * k, jnp.int32).at[grouping.row_of_pair].set(jnp.arange(t * k, dtype=jnp.int32))
    x_pad = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    return grouping, _group_major(x_pad[jnp.minimum(pair_of_row // k, t)])


def combine(y_t: jax.Array, grouping: Grouping, topk_weights: jax.Array, dtype, exact: bool = False) -> jax.Array:
    """out[t] = sum_j w[t, j] * y[row(t, j)] in f32 -> `[T, H]` in dtype; exact: summed in rank order j = 0..k-1
    (`combine_in_rank_order`), else an einsum over k."""
    t, k = topk_weights.shape
    y = y_t.T[grouping.row_of_pair].reshape(t, k, -1)
    if exact:
        return combine_in_rank_order(y, topk_weights).astype(dtype)
    return jnp.einsum("tkh,tk->th", y, topk_weights.astype(jnp.float32)).astype(dtype)


def resolve_config(config: Config | None, num_tokens: int, k: int, num_experts: int, exact: bool = False) -> Config:
    """`config` (default `Config()`) with bt filled in when unset: EXACT_BT under `exact` (a config with another bt
    is a ValueError), else by `choose_bt`."""
    cfg = config or Config()
    if exact and cfg.bt not in (None, EXACT_BT):
        raise ValueError(f"exact mode runs tiles of {EXACT_BT} tokens, not {cfg.bt}")
    if cfg.bt:
        return cfg
    return dataclasses.replace(cfg, bt=EXACT_BT if exact else choose_bt(num_tokens, k, num_experts))


def _check_inputs(x, gate_up_q, gate_up_s, down_q, down_s, block_k: int) -> None:
    """Shapes as documented in `moe_swiglu_pallas`; H and I multiples of 64 and of min(block_k, dim)."""
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 (the wgmma B operand), got {x.dtype}")
    hidden = x.shape[1]
    num_experts, two_inter, _ = gate_up_q.shape
    inter = two_inter // 2
    want = {
        "gate_up_q": (gate_up_q.shape, (num_experts, two_inter, hidden)),
        "gate_up_s": (gate_up_s.shape, (num_experts, hidden // GROUP, two_inter)),
        "down_q": (down_q.shape, (num_experts, hidden, inter)),
        "down_s": (down_s.shape, (num_experts, inter // GROUP, hidden)),
    }
    for name, (got, expected) in want.items():
        if tuple(got) != expected:
            raise ValueError(f"{name}: shape {got}, expected {expected} (scales are group-major [E, K/32, N])")
    for dim in (hidden, inter):
        if dim % BLOCK_N or dim % min(block_k, dim):
            raise ValueError(f"H={hidden} and I={inter} must be multiples of {BLOCK_N} and of min({block_k}, dim)")


@functools.partial(jax.jit, static_argnames=("interpret", "config", "exact"))
def moe_swiglu_pallas(
    x,
    topk_ids,
    topk_weights,
    gate_up_q,
    gate_up_s,
    down_q,
    down_s,
    *,
    interpret=False,
    config: Config | None = None,
    exact: bool = False,
):
    """Routed-expert SwiGLU with the semantics of `reference.moe_swiglu_reference` -> `[T, H]` in x.dtype.

    x `[T, H]` bf16, topk_ids `[T, k]` int32, topk_weights `[T, k]` f32, gate_up_q int4 `[E, 2I, H]`,
    down_q int4 `[E, H, I]`; gate_up_s `[E, H/32, 2I]` and down_s `[E, I/32, H]` bf16 (group-major scales).
    interpret=True runs the Mosaic GPU kernels in GPU interpret mode (CPU); config: tiling (default: `Config()`,
    bt by `choose_bt`); exact: tiles of EXACT_BT tokens and the rank-order combine (a token's row independent of T).
    """
    t, k = topk_ids.shape
    num_experts = gate_up_q.shape[0]
    cfg = resolve_config(config, t, k, num_experts, exact)
    _check_inputs(x, gate_up_q, gate_up_s, down_q, down_s, cfg.block_k)
    interpret = plgpu.InterpretGPUParams() if interpret else None
    grouping, xs = route(x, topk_ids, num_experts, cfg)
    h_t = gate_up_pallas(cfg, grouping, xs, gate_up_q, gate_up_s, interpret)
    y_t = down_pallas(cfg, grouping, h_t, down_q, down_s, interpret)
    return combine(y_t, grouping, topk_weights, x.dtype, exact)
