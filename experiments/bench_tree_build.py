"""The one-launch Pallas tree build against the plain-JAX build (~20 XLA kernels), side by side in one run.

    python -m experiments.bench_tree_build [--budgets=4,8,16,32,64] [--batches=1,8,32] [--e2e_budgets=8,16,32]

Part 1, `build`: top-K + tree + ancestor mask from random draft logits `[B, D, V]` (the shipped drafter's D and
vocabulary), each implementation jitted alone and dispatched back to back (so no host round trip per call), plus
whether the two return identical trees and masks. Part 2, `e2e`: generation on the shipped pair at concurrency 1
with each build (two Generators, programs compiled up front, timed runs alternating between them), with AR and the
DFlash chain of the same run for reference: tokens/s, tokens/round and whether the outputs are identical.
Writes <out_dir>/bench_tree_build.json and .md.
"""

from __future__ import annotations

import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import common, workload
from experiments.progress import Progress

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("budgets", ["4", "8", "16", "32", "64"], "budgets of the isolated build")
flags.DEFINE_list("batches", ["1", "8", "32"], "batch rows of the isolated build")
flags.DEFINE_list("e2e_budgets", ["8", "16", "32"], "DDTree budgets of the generation A/B (empty: skip it)")
flags.DEFINE_integer("steps", 200, "back-to-back calls per isolated timing")
flags.DEFINE_integer("repeats", 5, "timed generations per program (median)")
flags.DEFINE_integer("context", 60, "prompt tokens (generation A/B)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per row (generation A/B; stop tokens ignored)")
flags.DEFINE_integer("compile_workers", min(8, os.cpu_count() or 1), "threads compiling the generation programs")
flags.DEFINE_enum("kernel_mode", "pallas", ["pallas", "interpret"], "how the kernel runs (interpret: CPU smoke test)")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

IMPLS = ("pallas", "reference")  # record columns; "pallas" runs as --kernel_mode


def _using(impl: str):
    from pallas_kernels import dispatch

    return dispatch.use_kernels(FLAGS.kernel_mode if impl == "pallas" else impl, op="build_tree")


COLUMNS = ["part", "method", "budget", "batch", "pallas", "reference", "speedup", "identical", "unit"]


def build_records(gen, meta: dict) -> list[dict]:
    """Isolated top-K + build + mask: ms per call for each implementation at every (budget, batch)."""
    from ddtree_jax import engine

    d, vocab = gen.drafter.config.num_draft, gen.target_config.vocab_size
    cells = [(int(b), int(n)) for b in FLAGS.budgets for n in FLAGS.batches]
    records, bar = [], Progress(len(cells), "build")
    for budget, batch in cells:
        bar.step(f"b={budget} B={batch}")
        key = jax.random.key(budget * 1000 + batch)
        logits = 3.0 * jax.random.normal(key, (batch, d, vocab), jnp.float32)
        root = jnp.arange(batch, dtype=jnp.int32)
        spec = engine.GenSpec("ddtree", batch, 1, 1, budget=budget)
        ms, outs = {}, {}
        for impl in IMPLS:
            with _using(impl):
                fn = jax.jit(lambda lg, r, spec=spec: engine.build_trees(spec, gen.drafter, lg, r))
                outs[impl] = jax.block_until_ready(fn(logits, root))
            ms[impl] = 1e3 * common.time_back_to_back(lambda fn=fn, lg=logits, r=root: fn(lg, r), 3, FLAGS.steps)
        same = all(np.array_equal(a, b) for a, b in zip(*(jax.tree.leaves(outs[i]) for i in IMPLS), strict=True))
        records.append(_record("build", "ddtree", budget, batch, ms, same, "ms/call", meta))
    bar.done()
    return records


def e2e_records(meta: dict) -> list[dict]:
    """Generation at concurrency 1 with each build; AR and the chain from the Pallas-build Generator."""
    from ddtree_jax.api import Generator

    gens = {impl: Generator.load(FLAGS.target, FLAGS.drafter) for impl in IMPLS}
    base, _ = workload.load_prompts(gens["pallas"], FLAGS.prompts, 1)
    prompts = workload.at_length(base, FLAGS.context, 1)
    depth = gens["pallas"].drafter.config.num_draft
    kw = lambda m, b: {
        "method": m,
        "budget": b,
        "max_new_tokens": FLAGS.max_new_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    runs = [("ddtree", int(b)) for b in FLAGS.e2e_budgets]
    for impl, gen in gens.items():
        extra = [("ar", 1), ("dflash", depth)] if impl == "pallas" else []
        with _using(impl):
            gen.precompile([gen.spec_for(prompts, **kw(m, b)) for m, b in runs + extra], FLAGS.compile_workers)

    def timed(gen, m, b):
        first = gen.generate(prompts, **kw(m, b))
        walls = [gen.generate(prompts, **kw(m, b)).wall_s for _ in range(FLAGS.repeats)]
        return first, sum(len(t) for t in first.tokens) / statistics.median(walls)

    records = []
    ar, ar_tps = timed(gens["pallas"], "ar", 1)
    chain, chain_tps = timed(gens["pallas"], "dflash", depth)
    for name, res, tps in (("ar", ar, ar_tps), ("dflash", chain, chain_tps)):
        rec = _record("e2e", name, 0, 1, {"pallas": tps, "reference": tps}, res.tokens == ar.tokens, "tok/s", meta)
        records.append({**rec, "tokens_per_round": res.stats[0]["tokens_per_round"]})
    bar = Progress(len(runs), "e2e")
    for m, b in runs:
        bar.step(f"{m} b={b}")
        res, tps = zip(*(timed(gens[impl], m, b) for impl in IMPLS), strict=True)
        same = res[0].tokens == res[1].tokens == ar.tokens
        rec = _record("e2e", m, b, 1, dict(zip(IMPLS, tps, strict=True)), same, "tok/s", meta)
        rec |= {"tokens_per_round": res[0].stats[0]["tokens_per_round"], "vs_chain": tps[0] / chain_tps}
        records.append(rec)
    bar.done()
    return records


def _record(part, method, budget, batch, values: dict, identical: bool, unit: str, meta: dict) -> dict:
    """speedup: how many times better the Pallas build is (time ratio for ms, rate ratio for tok/s)."""
    p, r = values["pallas"], values["reference"]
    speedup = r / p if unit.startswith("ms") else p / r
    return {
        "part": part,
        "method": method,
        "budget": budget,
        "batch": batch,
        "pallas": p,
        "reference": r,
        "speedup": speedup,
        "identical": identical,
        "unit": unit,
        "context": FLAGS.context,
        "max_new_tokens": FLAGS.max_new_tokens,
        "target": FLAGS.target,
        "drafter": FLAGS.drafter,
        **meta,
    }


def main(_) -> None:
    from ddtree_jax.api import Generator

    meta = common.metadata()
    records = build_records(Generator.load(FLAGS.target, FLAGS.drafter), meta)
    common.write_results("bench_tree_build", records, COLUMNS, FLAGS.out_dir or None)
    if FLAGS.e2e_budgets:
        records += e2e_records(meta)
        common.write_results(
            "bench_tree_build", records, COLUMNS + ["tokens_per_round", "vs_chain"], FLAGS.out_dir or None
        )
    print(common.markdown_table(records, COLUMNS + ["tokens_per_round", "vs_chain"]))


if __name__ == "__main__":
    app.run(main)
