"""How fast the Mosaic MLA kernel's memory pipeline alone streams the latent cache (no attention math).

A two-warpgroup Mosaic GPU kernel with the memory side of `pallas_kernels/mla_mosaic.py`: one warpgroup TMA-loads
`[block_k, 576]` bf16 tiles (128-byte swizzled `(8, 64)` tiles, as the attention kernel does) into a `stages`-deep
SMEM ring; the other waits for each tile and frees its slot at once. Grid = (splits, batch): each CTA streams one
contiguous range of the `[B, L, 576]` cache. Read bandwidth is compared with the device copy bandwidth measured in
the same run. It separates "the TMA ring cannot fetch fast enough" from "the math does not overlap the loads" when
the attention kernel's decode falls short of the copy bandwidth.

    python -m experiments.bench_mla_stream --batches=8,32 --contexts=8192,32768
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import flags, logging  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from ddtree_jax.errors import run_app  # noqa: E402
from experiments import common  # noqa: E402
from experiments.mla_common import DK, copy_bandwidth  # noqa: E402
from pallas_kernels.mla_mosaic import SMEM_LIMIT, sm_count  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["8192", "32768"], "cache lengths")
flags.DEFINE_list("batches", ["8", "32"], "batch sizes")
flags.DEFINE_list("rings", ["64x2", "64x3", "32x4", "128x1", "64x1"], "block_k x stages of the SMEM ring")
flags.DEFINE_list("ctas_per_sm", ["1", "2"], "CTAs per SM the split count aims for (whole waves)")
flags.DEFINE_integer("inner", 10, "kernel calls per timed jitted loop")
flags.DEFINE_list("unroll", ["true"], "time with the loop unrolled (true) and/or as an XLA while loop (false)")
flags.DEFINE_integer("ceiling_size", 8192, "the copy moves ceiling_size^2 * 16 bf16 values")
flags.DEFINE_string("out_dir", None, "results directory (default experiments/results)")
flags.DEFINE_string("name", "bench_mla_stream", "results file stem")


def _stream_kernel(token_ref, kv_ref, o_ref, kv_smem, kv_bars, free_bars, *, block_k: int, stages: int, tiles: int):
    """CTA (split, batch) streams tiles [split * tiles, (split + 1) * tiles) of kv_ref `[B, L, dk]` through the
    ring kv_smem `[stages, block_k, dk]`; o_ref `[B, splits]` f32 gets one value per CTA."""
    wg = lax.axis_index("wg")
    b = lax.axis_index("batch")
    split = lax.axis_index("split")
    t_lo = split * tiles

    @pl.when(wg == 0)
    def _consume():
        @pl.loop(0, tiles)
        def _(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            plgpu.barrier_arrive(free_bars.at[slot])

    @pl.when(wg == 1)
    def _memory():
        @pl.loop(0, tiles)
        def _(step):
            slot = lax.rem(step, stages)

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(free_bars.at[slot])

            t = t_lo + step
            plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(t * block_k, block_k)], kv_smem.at[slot], kv_bars.at[slot])

        @pl.loop(jnp.maximum(tiles - stages, 0), tiles)
        def _(step):
            plgpu.barrier_wait(free_bars.at[lax.rem(step, stages)])

    del token_ref, o_ref  # token: a loop-carried input, so a timing loop cannot hoist the call; o_ref: unwritten


@functools.partial(jax.jit, static_argnames=("block_k", "stages", "splits"))
def stream(token: jax.Array, cache: jax.Array, *, block_k: int, stages: int, splits: int) -> jax.Array:
    """Stream `cache` `[B, L, dk]` (L divisible by splits * block_k) once through the ring; token `[1]` f32 is
    unused; -> `[B, splits]` (unwritten)."""
    b, length, dk = cache.shape
    tiles = length // (splits * block_k)
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        functools.partial(_stream_kernel, block_k=block_k, stages=stages, tiles=tiles),
        out_type=jax.ShapeDtypeStruct((b, splits), jnp.float32),
        scratch_types=[
            plgpu.SMEM((stages, block_k, dk), cache.dtype, transforms=swizzled),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ],
        grid=(splits, b),
        grid_names=("split", "batch"),
        num_threads=2,
        thread_name="wg",
    )
    return kernel(token, cache)


def whole_wave_splits(batch: int, n_tiles: int, slots: int) -> int:
    """The largest split count s dividing n_tiles with batch * s <= slots (CTAs in one wave), at least 1."""
    fits = [s for s in range(1, n_tiles + 1) if n_tiles % s == 0 and batch * s <= slots]
    return max(fits, default=1)


def time_stream(cache: jax.Array, block_k: int, stages: int, splits: int, unroll: bool) -> float:
    """Seconds per `stream` call, from a jitted loop of FLAGS.inner calls chained through the token."""
    fn = functools.partial(stream, block_k=block_k, stages=stages, splits=splits)

    def loop(c):
        return lax.fori_loop(0, FLAGS.inner, lambda _, tok: tok + fn(tok, c)[0, :1], jnp.zeros(1), unroll=unroll)

    loop = jax.jit(loop)
    return common.time_fn(lambda: loop(cache), warmup=1, repeats=5) / FLAGS.inner


def main(argv: Sequence[str]) -> None:
    del argv
    t0 = time.time()
    bw = copy_bandwidth(FLAGS.ceiling_size)
    copy_tbps = bw.get("torch_copy_tbps", bw["xla_add_tbps"])
    sms = sm_count()
    records: list[dict[str, Any]] = []
    columns = ["context", "batch", "block_k", "stages", "splits", "ctas", "smem_KiB", "unroll", "us", "TB/s", "of_copy"]
    for context, batch in itertools.product(map(int, FLAGS.contexts), map(int, FLAGS.batches)):
        cache = jax.random.normal(jax.random.key(context + batch), (batch, context, DK), jnp.bfloat16)
        unrolls = [u.lower() == "true" for u in FLAGS.unroll]
        for ring, per_sm, unroll in itertools.product(FLAGS.rings, map(int, FLAGS.ctas_per_sm), unrolls):
            block_k, stages = map(int, ring.split("x"))
            smem = stages * block_k * DK * 2
            if smem * per_sm > SMEM_LIMIT:
                continue
            splits = whole_wave_splits(batch, context // block_k, per_sm * sms)
            try:
                t = time_stream(cache, block_k, stages, splits, unroll)
            except Exception as e:  # noqa: BLE001 - one failing ring must not end the run
                logging.warning("ring %s at %s x %s failed: %s", ring, context, batch, str(e)[:300])
                continue
            tbps = cache.nbytes / t / 1e12
            records.append(
                {
                    "context": context,
                    "batch": batch,
                    "block_k": block_k,
                    "stages": stages,
                    "splits": splits,
                    "ctas": splits * batch,
                    "smem_KiB": smem / 1024,
                    "unroll": unroll,
                    "us": t * 1e6,
                    "TB/s": tbps,
                    "of_copy": tbps / copy_tbps,
                }
            )
            logging.info("%s", records[-1])
            path = common.write_results(
                FLAGS.name, records, columns, FLAGS.out_dir, {"ceilings": bw, "wall_s": time.time() - t0}
            )
        cache.delete()
    print(f"copy: {bw}")
    print(common.markdown_table(records, columns))
    print(f"wrote {path} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    run_app(main)
