"""One call of the Mosaic MLA kernel per (cell, tiling), for a hardware profiler to capture.

Inputs are built on the host and copied over, so the only GPU kernels are the call's own (the query pad, the
ancestor words, the kernel, the split merge). Run under Nsight Compute, e.g.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu -k regex:mosaic --section SpeedOfLight --section WarpStateStats \\
        python -m experiments.profile_mla --cells=8192/1/32/64,8192/17/8/64 --tiling= --tiling=compute_registers=232

(without the preallocation flag ncu saves and restores most of the GPU's memory around every replay; without the
kernel filter it profiles every XLA kernel too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from ddtree_jax.errors import cli_main
from ddtree_jax.sizing import cache_slots
from experiments.mla_common import DK, DV, SCALE, parse_cell, parse_tiling, random_tree_mask
from pallas_kernels import mla_mosaic
from pallas_kernels.mla_mosaic_config import default_config

FLAGS = flags.FLAGS
flags.DEFINE_list("cells", ["8192/1/32/64"], "context/nodes/batch/heads cells")
flags.DEFINE_multi_string(
    "tiling",
    [""],
    "MosaicMLAConfig fields per profiled variant (repeatable; '' is the default), e.g. compute_registers=232",
)


@cli_main
def main(argv: list[str]) -> None:
    del argv
    cells = [parse_cell(c) for c in FLAGS.cells]
    tilings = [parse_tiling(t) for t in FLAGS.tiling]
    rng = np.random.default_rng(0)
    for context, nodes, batch, heads in cells:
        length = cache_slots(context + nodes)
        q = jax.device_put(rng.standard_normal((batch, nodes, heads, DK), np.float32).astype(jnp.bfloat16))
        cache = jax.device_put(rng.standard_normal((batch, length, DK), np.float32).astype(jnp.bfloat16))
        prefix = jax.device_put(np.full((batch,), context, np.int32))
        mask = jax.device_put(random_tree_mask(rng, batch, nodes))
        for tiling in tilings:
            config = default_config(batch, nodes * heads, length, tiling)
            out = mla_mosaic.mla_attention_mosaic_split(
                q, cache, prefix, mask, SCALE, DV, config=config
            ).block_until_ready()
            logging.info("cell %d/%d/%d/%d %s -> %s", context, nodes, batch, heads, config, out.shape)


if __name__ == "__main__":
    app.run(main)
