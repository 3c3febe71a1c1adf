"""How the Mosaic MLA kernel lays its work out on the SMs under its two schedules, per cell: computed from the
schedule code itself (`mla_mosaic.default_config`, `persistent_schedule`), no GPU and no timing.

Per (context, nodes, batch, heads) cell, with the cache length `bench_mla` uses and every sequence at the full
context:
  grid: the split count, the CTAs and waves, the most KV tiles and CTAs one SM gets when the CTAs go in launch
    order to the SM that frees first, and the partials the merge reads (MB, bf16 rows + f32 LSE);
  persistent: the partials allowed per row block, units per CTA, busy CTAs, the most segments (Q loads) in one
    CTA, and the partials written and read by the merge;
and for both the modelled makespan in tile-times, each CTA or segment charged `--overhead_tiles` more (the model
`wave_splits` minimises). A model to check against `run_gpu_matrix.sh STAGES=mla_schedule`, not a measurement.

    .venv/bin/python -m experiments.mla_schedule
"""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.experimental import pallas as pl

from ddtree_jax.errors import UserError, cli_main
from ddtree_jax.sizing import CACHE_ALIGN
from experiments import common
from experiments.mla_common import DV, parse_cell
from pallas_kernels import mla_mosaic
from pallas_kernels.mla_attention import tree_inputs

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "cells",
    ["4096/1/8/64", "8192/1/32/64", "32768/1/8/64", "8192/17/1/64", "8192/17/8/64", "8192/17/8/8", "8192/33/8/64"],
    "context/nodes/batch/heads cells",
)
flags.DEFINE_integer("sms", 132, "SMs (one CTA per SM fits)", lower_bound=1)
flags.DEFINE_integer(
    "overhead_tiles",
    mla_mosaic.split_overhead_tiles(mla_mosaic.MosaicMLAConfig().block_k),
    "tile-times charged per CTA or segment (Q load, epilogue; default: what the kernel's split choice assumes)",
    lower_bound=0,
)
flags.DEFINE_string("out_dir", None, "results folder (default experiments/results)")
flags.DEFINE_string("name", "mla_schedule", "record name")

PARTIAL_BYTES = DV * 2 + 4  # one row of a partial: bf16 output and f32 log-sum-exp


def grid_layout(tiles: int, batch: int, row_blocks: int, splits: int, sms: int, overhead: int) -> dict[str, float]:
    """The grid schedule's CTAs, in launch order (row blocks fastest, then splits, then sequences), each on the SM
    that frees first; `row_blocks` per sequence."""
    per_split = pl.cdiv(tiles, splits)
    split_tiles = [min(per_split, max(0, tiles - s * per_split)) for s in range(splits)]
    cta_tiles = [n for _ in range(batch) for n in split_tiles for _ in range(row_blocks)]
    free = [(0, 0, 0, sm) for sm in range(sms)]  # (modelled time, tiles, CTAs, SM)
    for n in cta_tiles:
        t, got, ctas, sm = heapq.heappop(free)
        heapq.heappush(free, (t + n + overhead, got + n, ctas + 1, sm))
    return {
        "grid_splits": splits,
        "grid_ctas": len(cta_tiles),
        "grid_waves": pl.cdiv(len(cta_tiles), sms),
        "grid_max_tiles": max(f[1] for f in free),
        "grid_max_ctas": max(f[2] for f in free),
        "grid_makespan": max(f[0] for f in free),
    }


def persistent_layout(
    tiles: int, visible: jax.Array, n_nodes: int, row_blocks: int, pieces: int, sms: int, overhead: int
) -> dict[str, float]:
    """The persistent schedule's ranges: `visible` `[B]` is each sequence's visible prefix (`tree_inputs`)."""
    block_k = mla_mosaic.MosaicMLAConfig().block_k
    sched, valid = mla_mosaic.persistent_schedule(visible, n_nodes, block_k, row_blocks, sms, pieces)
    total, per_cta = int(sched[-2]), int(sched[-1])
    ranges = [(c * per_cta, min((c + 1) * per_cta, total)) for c in range(pl.cdiv(total, per_cta))]
    segments = [(hi - 1) // tiles - lo // tiles + 1 for lo, hi in ranges]  # every row block has `tiles` units
    return {
        "pers_pieces": pieces,
        "pers_per_cta": per_cta,
        "pers_busy_ctas": len(ranges),
        "pers_max_segments": max(segments),
        "pers_makespan": max(hi - lo + overhead * s for (lo, hi), s in zip(ranges, segments, strict=True)),
        "pers_written_mb": int(valid.sum()) * mla_mosaic.BLOCK_R * PARTIAL_BYTES / 1e6,
    }


def layout(cell: tuple[int, int, int, int], sms: int, overhead: int) -> dict[str, object]:
    context, nodes, batch, heads = cell
    length = pl.cdiv(context + nodes, CACHE_ALIGN) * CACHE_ALIGN
    rows = nodes * heads
    rows_pad = pl.cdiv(rows, mla_mosaic.BLOCK_R) * mla_mosaic.BLOCK_R
    row_blocks = rows_pad // mla_mosaic.BLOCK_R
    tiles = pl.cdiv(context + nodes, mla_mosaic.MosaicMLAConfig().block_k)
    grid_cfg = mla_mosaic.default_config(batch, rows, length)
    pers_cfg = mla_mosaic.default_config(batch, rows, length, mla_mosaic.MosaicMLAConfig(schedule="persistent"))
    # What the kernel sees of an all-visible tree (decode folds its one node into the prefix).
    visible, _, n_nodes = tree_inputs(
        jnp.ones((batch, nodes, nodes), bool), jnp.full((batch,), context, jnp.int32), heads, rows_pad
    )
    merge_mb = lambda pieces: batch * pieces * rows_pad * PARTIAL_BYTES / 1e6 if pieces > 1 else 0.0  # 1: no merge
    grid = grid_layout(tiles, batch, row_blocks, grid_cfg.num_splits, sms, overhead)
    pers = persistent_layout(tiles, visible, n_nodes, row_blocks, pers_cfg.num_splits, sms, overhead)
    return {
        "cell": "/".join(map(str, cell)),
        "tiles": tiles,
        "row_blocks": batch * row_blocks,
        **grid,
        "grid_merge_mb": merge_mb(grid_cfg.num_splits),
        **pers,
        "pers_merge_mb": merge_mb(pers_cfg.num_splits),
        "makespan_ratio": pers["pers_makespan"] / grid["grid_makespan"],
    }


@cli_main
def main(argv: list[str]) -> None:
    del argv
    if mla_mosaic.sm_count() != FLAGS.sms:
        raise UserError(f"--sms={FLAGS.sms}, but the schedules are sized for {mla_mosaic.sm_count()} SMs here")
    records = [layout(parse_cell(c), FLAGS.sms, FLAGS.overhead_tiles) for c in FLAGS.cells]
    extra = {"model": {"sms": FLAGS.sms, "overhead_tiles": FLAGS.overhead_tiles}}
    out = common.write_results(FLAGS.name, records, list(records[0]), FLAGS.out_dir, extra=extra)
    print(common.markdown_table(records, list(records[0])))
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
