"""The one-launch Pallas tree build against the plain-JAX build (~45 kernels per round), side by side in one run.

    python -m experiments.bench_tree_build [--budgets=4,8,16,32,64] [--batches=1,8,32] [--e2e_budgets=8,16,32]

Part 0 (`--warps`, bench_tree_warps.json): the kernel alone at each num_warps (what `default_warps` picks from).
With `--topk_vocabs` (bench_topk.json): exact top-k variants of the draft distribution: lax.top_k, a full sort, and
`ddtree_jax.topk.top_k` at several chunk lengths (the engine's default is `dispatch.TOPK_CHUNK`).
Part 1, `build`: top-K + tree + ancestor mask from random draft logits `[B, D, V]` (the shipped drafter's D and
vocabulary), each implementation timed as --steps dependent builds inside one program (so dispatch is not counted),
plus whether the two return identical trees and masks. Part 2, `e2e`: generation on the shipped pair at
concurrency 1 with each build (one Generator holding both programs, compiled up front; --repeats timed runs per
program), with AR and the DFlash chain of the same run for reference: tokens/s, tokens/round and whether the
outputs are identical.
Writes <out_dir>/bench_tree_build.json and .md.
"""

from __future__ import annotations

import functools
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental.pallas import next_power_of_2 as pl_next_pow2
from tqdm import tqdm

from ddtree_jax import topk
from ddtree_jax.calibration import at_length
from ddtree_jax.errors import run_app
from experiments import common, workload
from pallas_kernels.dispatch import TOPK_CHUNK

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("budgets", ["4", "8", "16", "32", "64"], "budgets of the isolated build")
flags.DEFINE_list("batches", ["1", "8", "32"], "batch rows of the isolated build")
flags.DEFINE_list("e2e_budgets", ["8", "16", "32"], "DDTree budgets of the generation A/B (empty: skip it)")
flags.DEFINE_integer("steps", 50, "builds per timed program (isolated timings)")
flags.DEFINE_list("warps", ["1", "2", "4", "8"], "num_warps of the kernel-alone timing (empty: skip it)")
flags.DEFINE_list("topk_vocabs", [], "vocabularies of the top-k timing, e.g. 4096,163840 (empty: skip it)")
flags.DEFINE_integer("repeats", 5, "timed generations per program (median)")
flags.DEFINE_integer("context", 60, "prompt tokens (generation A/B)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens per row (generation A/B; stop tokens ignored)")
flags.DEFINE_integer("compile_workers", min(8, os.cpu_count() or 1), "threads compiling the generation programs")
flags.DEFINE_enum("kernel_mode", "pallas", ["pallas", "interpret"], "how the kernel runs (interpret: CPU smoke test)")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")
flags.DEFINE_bool("exact", None, "the target's exact (batch- and tree-invariant) numerics; default: the product's")

IMPLS = ("pallas", "reference")  # record columns; "pallas" runs as --kernel_mode


def _kernels(impl: str):
    """The kernel selection that runs the tree build as `impl` (the rest from the environment)."""
    from pallas_kernels.dispatch import Kernels

    return Kernels.from_env().with_mode(FLAGS.kernel_mode if impl == "pallas" else impl, op="build_tree")


COLUMNS = ["part", "method", "budget", "batch", "pallas", "reference", "speedup", "identical", "unit"]


def per_call_us(fn, logits: jax.Array, root: jax.Array, n: int) -> float:
    """Microseconds of `fn(logits, root)` as one of `n` dependent calls inside one program (a scan): device time and
    the loop's own overhead, no dispatch or host round trip. Median of 7 runs of the program."""

    def many(lg, r):
        def body(c, _):
            out = jax.tree.leaves(fn(lg + c, r))
            return sum(x.reshape(-1)[0].astype(jnp.float32) for x in out) * 0.0, None

        return jax.lax.scan(body, jnp.float32(0), None, length=n)[0]

    program = jax.jit(many)
    return 1e6 * common.time_fn(lambda: program(logits, root), warmup=2, repeats=7) / n


def _top_k_sorted(lp: jax.Array, k: int):
    """Exact top-k by a stable sort of the whole row (ties: lower index first, as lax.top_k)."""
    idx = jax.lax.broadcasted_iota(jnp.int32, lp.shape, lp.ndim - 1)
    neg, ids = jax.lax.sort((-lp, idx), dimension=lp.ndim - 1, num_keys=1, is_stable=True)
    return -neg[..., :k], ids[..., :k]


TOPK = {"lax.top_k": jax.lax.top_k, "sort": _top_k_sorted} | {
    f"chunk{c}{'*' if c == TOPK_CHUNK else ''}": functools.partial(topk.top_k, chunk=c) for c in (256, 512, 1024, 2048)
}


def topk_records(depth: int, vocabs: list[int], meta: dict) -> list[dict]:
    """Each exact top-k of log_softmax(logits `[B, D, V]`) at k in {8, 16, 32, 64}: us per call inside a program,
    and whether it equals lax.top_k (method `chunkN*` is the engine's)."""
    records = []
    for vocab in vocabs:
        for batch in (int(n) for n in FLAGS.batches):
            logits, root = _inputs(batch, depth, vocab, vocab + batch)
            for k in (8, 16, 32, 64):
                want = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)
                for name, top in TOPK.items():
                    fn = lambda lg, r, top=top, k=k: top(jax.nn.log_softmax(lg, axis=-1), k)
                    got = jax.jit(fn)(logits, root)
                    same = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
                    us = per_call_us(fn, logits, root, FLAGS.steps)
                    records.append(
                        {"vocab": vocab, "batch": batch, "k": k, "method": name, "us": us, "identical": same, **meta}
                    )
    return records


def _inputs(batch: int, depth: int, vocab: int, seed: int) -> tuple[jax.Array, jax.Array]:
    logits = 3.0 * jax.random.normal(jax.random.key(seed), (batch, depth, vocab), jnp.float32)
    return logits, jnp.arange(batch, dtype=jnp.int32)


def build_records(gen, meta: dict) -> list[dict]:
    """top-K + build + mask inside a program: us per build for each implementation at every (budget, batch)."""
    from ddtree_jax import engine

    d, vocab = gen.drafter.config.num_draft, gen.target_config.vocab_size
    cells = [(int(b), int(n)) for b in FLAGS.budgets for n in FLAGS.batches]
    records = []
    for budget, batch in (bar := tqdm(cells, desc="build")):
        bar.set_postfix_str(f"b={budget} B={batch}")
        logits, root = _inputs(batch, d, vocab, budget * 1000 + batch)
        us, outs = {}, {}
        for impl in IMPLS:
            spec = engine.GenSpec("ddtree", batch, 1, 1, budget=budget, kernels=_kernels(impl))
            fn = lambda lg, r, spec=spec: engine.build_trees(spec, gen.drafter, lg, r)
            outs[impl] = jax.block_until_ready(jax.jit(fn)(logits, root))
            us[impl] = per_call_us(fn, logits, root, FLAGS.steps)
        same = all(np.array_equal(a, b) for a, b in zip(*(jax.tree.leaves(outs[i]) for i in IMPLS), strict=True))
        records.append(_record("build", "ddtree", budget, batch, us, same, "us/build", meta))
    return records


def warps_records(gen, meta: dict) -> list[dict]:
    """The kernel alone (batch 1, inputs already top-K) at each --warps: us per build, and which is the default."""
    from pallas_kernels import tree_build

    d, vocab = gen.drafter.config.num_draft, gen.target_config.vocab_size
    records = []
    for budget in (int(b) for b in FLAGS.budgets):
        logits, root = _inputs(1, d, vocab, budget)
        lp, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), min(budget, vocab))
        default = tree_build.default_warps(pl_next_pow2(budget + 1))
        for warps in (int(w) for w in FLAGS.warps):
            fn = lambda x, r, w=warps, b=budget, ids=ids: tree_build.build_tree_pallas(
                x, ids, r, b, num_warps=w, interpret=FLAGS.kernel_mode == "interpret"
            )
            us = per_call_us(fn, lp, root, FLAGS.steps)
            records.append(
                {"budget": budget, "num_warps": warps, "default": warps == default, "us_per_build": us, **meta}
            )
    return records


def e2e_records(gen, meta: dict) -> list[dict]:
    """Generation at concurrency 1 with each build (the Generator keeps one program per kernel selection); AR and
    the chain with the Pallas build selected."""
    base, _ = workload.load_prompts(gen, FLAGS.prompts, 1)
    prompts = at_length(base, FLAGS.context, 1)
    depth = gen.drafter.config.num_draft
    kw = lambda impl, m, b: {
        "method": m,
        "budget": b,
        "max_new_tokens": FLAGS.max_new_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "kernels": _kernels(impl),
    }
    runs = [("ddtree", int(b)) for b in FLAGS.e2e_budgets]
    for impl in IMPLS:
        extra = [("ar", 1), ("dflash", depth)] if impl == "pallas" else []
        gen.precompile([gen.spec_for(prompts, **kw(impl, m, b)) for m, b in runs + extra], FLAGS.compile_workers)

    def timed(impl, m, b):
        first = gen.generate(prompts, **kw(impl, m, b))
        walls = [gen.generate(prompts, **kw(impl, m, b)).wall_s for _ in range(FLAGS.repeats)]
        return first, sum(len(t) for t in first.tokens) / statistics.median(walls)

    records = []
    ar, ar_tps = timed("pallas", "ar", 1)
    chain, chain_tps = timed("pallas", "dflash", depth)
    for name, res, tps in (("ar", ar, ar_tps), ("dflash", chain, chain_tps)):
        rec = _record("e2e", name, 0, 1, {"pallas": tps, "reference": tps}, res.tokens == ar.tokens, "tok/s", meta)
        records.append({**rec, "tokens_per_round": res.stats[0]["tokens_per_round"]})
    for m, b in (bar := tqdm(runs, desc="e2e")):
        bar.set_postfix_str(f"{m} b={b}")
        res, tps = zip(*(timed(impl, m, b) for impl in IMPLS), strict=True)
        same = res[0].tokens == res[1].tokens == ar.tokens
        rec = _record("e2e", m, b, 1, dict(zip(IMPLS, tps, strict=True)), same, "tok/s", meta)
        rec |= {"tokens_per_round": res[0].stats[0]["tokens_per_round"], "vs_chain": tps[0] / chain_tps}
        records.append(rec)
    return records


def _record(part, method, budget, batch, values: dict, identical: bool, unit: str, meta: dict) -> dict:
    """speedup: how many times better the Pallas build is (time ratio for us, rate ratio for tok/s)."""
    p, r = values["pallas"], values["reference"]
    speedup = p / r if unit == "tok/s" else r / p
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

    gen = Generator.load(FLAGS.target, FLAGS.drafter, exact=FLAGS.exact)
    meta = common.metadata() | {"exact": gen.exact}
    if FLAGS.warps:
        warps = warps_records(gen, meta)
        common.write_results(
            "bench_tree_warps", warps, ["budget", "num_warps", "default", "us_per_build"], FLAGS.out_dir or None
        )
    if FLAGS.topk_vocabs:
        topk = topk_records(gen.drafter.config.num_draft, [int(v) for v in FLAGS.topk_vocabs], meta)
        common.write_results(
            "bench_topk", topk, ["vocab", "batch", "k", "method", "us", "identical"], FLAGS.out_dir or None
        )
    records = build_records(gen, meta)
    common.write_results("bench_tree_build", records, COLUMNS, FLAGS.out_dir or None)
    if FLAGS.e2e_budgets:
        records += e2e_records(gen, meta)
        common.write_results(
            "bench_tree_build", records, COLUMNS + ["tokens_per_round", "vs_chain"], FLAGS.out_dir or None
        )
    print(common.markdown_table(records, COLUMNS + ["tokens_per_round", "vs_chain"]))


if __name__ == "__main__":
    run_app(main)
