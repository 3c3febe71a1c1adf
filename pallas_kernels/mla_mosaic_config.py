"""Tiling of the Mosaic GPU MLA kernel (`mla_mosaic.py`): its fields, shared-memory budget, register split and the
split-count model.

SMEM of one CTA: Q 72 KiB (aliased with the bf16 output) + num_stages * 72 KiB of KV ring (64-slot tiles x
2 stages: 144 KiB) + the two P halves 8 KiB + 1 KiB each for the tree words and the max / sum / LSE rows + barriers =
231,496 B of the 232,448 an H100 / H200 CTA may use (every buffer starts at a 1 KiB boundary; the kernel reserves no
cross-warp reduction scratch, its row reductions stay inside a warp). `smem_bytes` checks it before lowering.

Splits: one CTA per SM fits, so whole waves matter; `wave_splits` minimises the modelled makespan, with a CTA's fixed
cost (Q load, pipeline fill, epilogue, its part of the merge) put at `SPLIT_OVERHEAD_SLOTS` KV slots.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl

BLOCK_R = 64  # query rows per CTA (one wgmma M tile)
# KV slots per tile. Each compute warpgroup computes S for half of a tile's slots, so P V runs with K = 32, one
# 64-byte swizzle tile (the swizzle of Q, the KV ring and P); 128 slots would not fit two stages in SMEM.
BLOCK_K = 64
SWIZZLE = 64
SMEM_LIMIT = 232_448  # bytes of shared memory one CTA may use on an H100 / H200
# Registers per thread the 384-thread CTA launches with: 64K per SM, in steps of 8 (168).
LAUNCH_REGISTERS = 65536 // (3 * 128) // 8 * 8
# A CTA's fixed cost in KV slots (Q load, pipeline fill, epilogue, its part of the merge), fitted to H200 timings of
# 8192-slot verify and decode calls at several split counts (experiments/notes_mla.md).
SPLIT_OVERHEAD_SLOTS = 256


@dataclasses.dataclass(frozen=True)
class MosaicMLAConfig:
    """Tiling of the kernel: BLOCK_K-slot KV tiles in a `num_stages` ring; `num_splits` KV splits (0: chosen for the
    shape by `default_config`); `compute_registers`: `setmaxnreg` of the two compute warpgroups (at 240 their tile
    loops spill nothing), the memory warpgroup gets `memory_registers`."""

    num_stages: int = 2
    num_splits: int = 0
    compute_registers: int = 240

    def __post_init__(self):
        if self.compute_registers % 8 or not 128 <= self.compute_registers <= 240:
            raise ValueError(f"compute_registers must be a multiple of 8 in [128, 240]: {self}")
        if self.num_splits < 0 or self.num_stages < 1:
            raise ValueError(f"num_splits must be >= 0 and num_stages >= 1: {self}")

    @classmethod
    def from_text(cls, text: str) -> MosaicMLAConfig:
        """'field=value,...' -> the config with those fields set, the others at their defaults ('' -> the default);
        a ValueError naming the problem for an unknown field, a value that is not an int or an impossible tiling."""
        names = sorted(f.name for f in dataclasses.fields(cls))
        changes: dict[str, int] = {}
        for item in filter(None, text.split(",")):
            name, eq, value = item.partition("=")
            if not eq or name not in names:
                raise ValueError(f"tiling {text!r}: {item!r} is not FIELD=VALUE with FIELD one of {names}")
            try:
                changes[name] = int(value)
            except ValueError:
                raise ValueError(f"tiling {text!r}: {name} takes an int, not {value!r}") from None
        try:
            return cls(**changes)
        except ValueError as e:
            raise ValueError(f"tiling {text!r}: {e}") from None

    @property
    def memory_registers(self) -> int:
        """Registers per thread left to the memory warpgroup, at most 40. The CTA is launched with LAUNCH_REGISTERS
        per thread and `setmaxnreg` only moves registers between its warpgroups: an increase past the pool hangs."""
        return min(40, 3 * LAUNCH_REGISTERS - 2 * self.compute_registers)


def smem_bytes(config: MosaicMLAConfig, dk: int = 576, value_dim: int = 512, n_words: int = 1) -> int:
    """Shared memory of one CTA: Q (aliased with the bf16 output), the KV ring, the tree words, the two P halves
    `[64, BLOCK_K]` bf16 in all, the max / sum / LSE rows, each at a 1 KiB boundary, then the barriers (8 B each)."""
    kib = lambda n: pl.cdiv(n, 1024) * 1024
    buffers = (
        2 * BLOCK_R * max(dk, value_dim),
        2 * dk * config.num_stages * BLOCK_K,
        4 * n_words * BLOCK_R,
        2 * BLOCK_R * BLOCK_K,
        4 * 3 * BLOCK_R,
    )
    barriers = 1 + 2 * config.num_stages + 4  # Q; the ring's full and free; the meeting, done, the two P halves
    return sum(map(kib, buffers)) + 8 * barriers


def sm_count() -> int:
    """Streaming multiprocessors of the default GPU (132 on an H200; also the count assumed off a GPU)."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132) if device.platform == "gpu" else 132


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
    """`tiling` (default `MosaicMLAConfig()`) with its split count chosen by `wave_splits` for `batch` sequences of
    `rows` query rows over `max_len` cache slots on this GPU's SMs."""
    config = tiling or MosaicMLAConfig()
    row_blocks, tiles = batch * pl.cdiv(rows, BLOCK_R), pl.cdiv(max_len, BLOCK_K)
    overhead = SPLIT_OVERHEAD_SLOTS // BLOCK_K
    return dataclasses.replace(config, num_splits=wave_splits(row_blocks, tiles, sm_count(), overhead))
