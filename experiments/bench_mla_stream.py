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

from ddtree_jax.errors import UserError, run_app  # noqa: E402
from experiments import common  # noqa: E402
from experiments.mla_common import (  # noqa: E402
    DK,
    calls_per_program,
    copy_bandwidth,
    per_call_time,
    stream,
    whole_wave_splits,
)
from pallas_kernels.mla_mosaic_config import SMEM_LIMIT, sm_count  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["8192", "32768"], "cache lengths")
flags.DEFINE_list("batches", ["8", "32"], "batch sizes")
flags.DEFINE_list("rings", ["64x2", "64x3", "32x4", "128x1", "64x1"], "block_k x stages of the SMEM ring")
flags.DEFINE_list("ctas_per_sm", ["1", "2"], "CTAs per SM the split count aims for (whole waves)")
flags.DEFINE_integer(
    "inner", None, "time a call from programs of --inner and 2 x --inner calls (default 50, unrolled 10)", lower_bound=1
)
flags.DEFINE_multi_enum(
    "loop", ["unrolled"], ["unrolled", "while"], "how the timed calls are chained (bench_mla --loop); repeatable"
)
flags.DEFINE_integer("ceiling_size", 8192, "the copy moves ceiling_size^2 * 16 bf16 values")
flags.DEFINE_string("out_dir", None, "results directory (default experiments/results)")
flags.DEFINE_string("name", "bench_mla_stream", "results file stem")


def time_stream(cache: jax.Array, block_k: int, stages: int, splits: int, loop: str) -> float:
    """Seconds per `stream` call: `per_call_time` over calls chained through the token, unrolled or in a while
    loop (of static length: `mla_common.looped`)."""
    fn = functools.partial(stream, block_k=block_k, stages=stages, splits=splits)

    def run(c, k):
        body = lambda _, tok: tok + fn(tok, c)[0, :1]  # noqa: E731
        return lax.fori_loop(0, k, body, jnp.zeros(1), unroll=loop == "unrolled")

    run = jax.jit(run, static_argnums=(1,))
    return per_call_time(lambda k: functools.partial(run, cache, k), calls_per_program(loop, FLAGS.inner))[0]


def parse_rings(raw: Sequence[str]) -> list[tuple[int, int]]:
    """ "BLOCKxSTAGES" entries -> (block_k, stages), block_k a multiple of 8, stages >= 1."""
    rings = []
    for ring in raw:
        parts = ring.split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) % 8 or int(parts[1]) < 1:
            raise UserError(f"--rings: {ring!r} is not BLOCKxSTAGES (block_k a multiple of 8, stages >= 1)")
        rings.append((int(parts[0]), int(parts[1])))
    return rings


def main(argv: Sequence[str]) -> None:
    del argv
    rings = parse_rings(FLAGS.rings)
    t0 = time.time()
    bw = copy_bandwidth(FLAGS.ceiling_size)
    copy_tbps = bw.get("torch_copy_tbps", bw["xla_add_tbps"])
    sms = sm_count()
    records: list[dict[str, Any]] = []
    columns = ["context", "batch", "block_k", "stages", "splits", "ctas", "smem_KiB", "loop", "us", "TB/s", "of_copy"]
    for context, batch in itertools.product(map(int, FLAGS.contexts), map(int, FLAGS.batches)):
        cache = jax.random.normal(jax.random.key(context + batch), (batch, context, DK), jnp.bfloat16)
        for (block_k, stages), per_sm, loop in itertools.product(rings, map(int, FLAGS.ctas_per_sm), FLAGS.loop):
            smem = stages * block_k * DK * 2
            if smem * per_sm > SMEM_LIMIT:
                continue
            splits = whole_wave_splits(batch, context // block_k, per_sm * sms)
            try:
                t = time_stream(cache, block_k, stages, splits, loop)
            except Exception as e:  # noqa: BLE001 - one failing ring must not end the run
                logging.warning("ring %dx%d at %s x %s failed: %s", block_k, stages, context, batch, str(e)[:300])
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
                    "loop": loop,
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
