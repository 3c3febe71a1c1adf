"""The drafter's forward alone: what its attention blocks cost by implementation, and whether that cost follows the
context used or the cache allocated.

    python -m experiments.bench_drafter                          # one GPU: allocations 2K and 8K, a 60-token context
    python -m experiments.bench_drafter --drafter_config=checkpoints/kimi-mini-dflash --allocations=256  # mini drafter
    python -m experiments.bench_drafter --tiny --modes=reference,interpret --allocations=32,64 --context=10  # CPU

Builds the Kimi DFlash drafter (experiments/configs/kimi-k2.5-dflash; --tiny: toy dimensions) with random bf16 weights.
Per (implementation of its attention blocks of `--modes`, a `Kernels.drafter_attention` mode, its other ops on `auto`;
concurrency B; allocation L): a drafter cache `[layers, B, L, kv_heads, head_dim]` of random values whose first
`--context` slots are valid, and drafter forwards on a block of random embeddings (`--projections=xla`: the Pallas
block's projections in XLA whatever their size). Timed inside one jitted program: a `lax.fori_loop` of k forwards whose
carry is the whole input state (the block embeddings and the drafter cache k, v), each pass's output hidden `[B, S, H]`
the next pass's block embeddings, the carry through an optimization barrier every pass (XLA can neither hoist a
forward's work out of the loop nor fuse passes); positions and cache_len stay fixed, so every pass attends to the same
`--context` slots. ms per forward = (median of the 2N-pass program - median of the N-pass one) / N
(`mla_common.per_call_time`, N = `--inner`, each program compiled once, on threads beside the plain forward, and run
`--repeats` times after a warm-up), which leaves out what a program pays once (dispatch, the sync, the copy of the
un-donated cache into the loop). `max_diff`: one plain forward's output (outside the timing), its largest difference
from the first mode's at the same cell (the kernel checked against the reference on the device). Results:
<out_dir>/<--name>.json and .md, written after every cell.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx
from jax import lax

from ddtree_jax.config import load_dflash_config
from ddtree_jax.errors import run_app
from ddtree_jax.models.dflash import DFlashDrafter, DrafterCache
from experiments import common
from experiments.mla_common import per_call_time
from pallas_kernels.dispatch import Kernels

FLAGS = flags.FLAGS
flags.DEFINE_string("drafter_config", str(common.RELEASED_CONFIGS / "kimi-k2.5-dflash"), "DFlash drafter config")
flags.DEFINE_list("modes", ["reference", "pallas"], "drafter attention block implementations (Kernels modes)")
flags.DEFINE_list("concurrency", ["1", "32"], "batch rows")
flags.DEFINE_list("allocations", ["2048", "8192"], "drafter cache slots allocated per row")
flags.DEFINE_integer("context", 60, "valid context slots per row")
flags.DEFINE_integer("inner", 20, "forwards N of the shorter timed loop (the other runs 2N)")
flags.DEFINE_integer("repeats", 5, "timed runs of each loop program (median)")
common.define_projections_flag()
flags.DEFINE_bool("tiny", False, "toy dimensions (CPU smoke test of this script)")
flags.DEFINE_string("name", "bench_drafter", "results file name")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["mode", "projections", "concurrency", "allocation", "context", "ms", "max_diff"]


def drafter_config():
    cfg = load_dflash_config(FLAGS.drafter_config)
    if not FLAGS.tiny:
        return cfg
    small = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    return dataclasses.replace(cfg, **small, num_key_value_heads=2, head_dim=32, vocab_size=256, mask_token_id=255)


def time_forward(drafter: DFlashDrafter, mode: str, batch: int, allocation: int) -> tuple[float, jax.Array]:
    """(milliseconds per drafter forward, output `[B, S, H]` of one plain forward) of B rows over an
    `allocation`-slot cache, `--context` slots valid: `per_call_time` over loops of k forwards carrying the block
    embeddings and the cache."""
    c = drafter.config
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (c.num_hidden_layers, batch, allocation, c.num_key_value_heads, c.head_dim)
    cache = DrafterCache(*(jax.random.normal(k, shape, jnp.bfloat16) for k in keys[:2]))
    embeds = jax.random.normal(keys[2], (batch, c.block_size, c.hidden_size), jnp.bfloat16)
    cache_len = jnp.full((batch,), FLAGS.context, jnp.int32)
    positions = cache_len[:, None] + jnp.arange(c.block_size)[None, :]
    kernels = Kernels().with_mode(mode, op="drafter_attention")
    graphdef, state = nnx.split(drafter)

    def forward(st, x, pos, kv, n):
        return nnx.merge(graphdef, st)(x, pos, kv, n, kernels)

    def loop(k, st, x, pos, kv, n):
        def one(_, carry):
            x, kv = lax.optimization_barrier(carry)
            return forward(st, x, pos, kv, n).astype(x.dtype), kv

        return lax.fori_loop(0, k, one, (x, kv))

    args = (state, embeds, positions, cache, cache_len)
    fns = {k: functools.partial(loop, k) for k in (FLAGS.inner, 2 * FLAGS.inner)} | {"plain": forward}
    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:  # each compiled once, before anything is timed
        futures = {k: pool.submit(lambda f: jax.jit(f).lower(*args).compile(), f) for k, f in fns.items()}
    programs = {k: f.result() for k, f in futures.items()}
    per, _ = per_call_time(lambda k: functools.partial(programs[k], *args), FLAGS.inner, FLAGS.repeats)
    return 1e3 * per, programs["plain"](*args)


def main(_) -> None:
    common.use_projections(FLAGS.projections)
    cfg = drafter_config()
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    records, first = [], {}
    extra = {"tiny": FLAGS.tiny, "inner": FLAGS.inner, "repeats": FLAGS.repeats}
    for mode in FLAGS.modes:
        for batch in map(int, FLAGS.concurrency):
            for allocation in map(int, FLAGS.allocations):
                ms, out = time_forward(drafter, mode, batch, allocation)
                out = first.setdefault((batch, allocation), out).astype(jnp.float32) - out.astype(jnp.float32)
                records.append({"mode": mode, "projections": FLAGS.projections, "concurrency": batch})
                records[-1] |= {"allocation": allocation, "ms": ms}
                records[-1] |= {"context": FLAGS.context, "max_diff": float(jnp.abs(out).max())}
                print(common.markdown_table(records[-1:], COLUMNS).splitlines()[-1], flush=True)
                path = common.write_results(FLAGS.name, records, COLUMNS, FLAGS.out_dir, extra=extra)  # every cell
    print(f"wrote {path}")


if __name__ == "__main__":
    run_app(main)
