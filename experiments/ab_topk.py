"""Does the chunk-wise top-k pay off inside generation? The tree's candidates by `lax.top_k` (chunk 0) against
`ddtree_jax.topk` at each --chunks length, per DDTree budget, with AR and the DFlash chain, all in one process.

    python -m experiments.ab_topk [--budgets=8,16,32 --chunks=0,512 --repeats=9]

Every program is compiled up front (one per budget and chunk length, `Kernels.topk_chunk`, part of each program's
key); then `common.time_interleaved` times all settings round by round, so drift lands on each alike. Both top-k
forms return the same candidates, so every DDTree row must equal AR's and a budget's acceptance must not depend on
the chunk length; `identical` and `tokens_per_round` show it. Writes <out_dir>/ab_topk.json and .md.
"""

from __future__ import annotations

import os

from absl import flags
from tqdm import tqdm

from ddtree_jax.calibration import at_length
from ddtree_jax.errors import UserError, run_app
from experiments import common, workload

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("budgets", ["8", "16", "32"], "DDTree budgets")
flags.DEFINE_list("chunks", ["0", "512"], "top-k chunk lengths (0: lax.top_k)")
flags.DEFINE_integer("num_prompts", 5, "prompts, each run alone (concurrency 1), as in `sweep --axis=budget`")
flags.DEFINE_integer("context", 60, "prompt tokens per row")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per row (stop tokens ignored)")
flags.DEFINE_integer("repeats", 9, "timing rounds (median)")
flags.DEFINE_integer("compile_workers", min(8, os.cpu_count() or 1), "threads compiling the programs up front")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")
flags.DEFINE_bool("exact", None, "the target's exact (batch- and tree-invariant) numerics; default: the product's")

COLUMNS = ["method", "budget", "chunk", "tokens_per_round", "tokens_per_s", "vs_chain", "vs_lax", "identical"]


def chunked(chunk: int):
    """The environment's kernel selection with top-k chunk length `chunk`."""
    import dataclasses

    from pallas_kernels.dispatch import Kernels

    return dataclasses.replace(Kernels.from_env(), topk_chunk=chunk)


class _ChunkedGen:
    """`gen.generate` with the top-k chunk length as one more keyword (what `time_interleaved` varies)."""

    def __init__(self, gen):
        self.gen = gen

    def generate(self, batch, chunk: int, **kw):
        return self.gen.generate(batch, kernels=chunked(chunk), **kw)


def main(_) -> None:
    from ddtree_jax.api import Generator
    from pallas_kernels.dispatch import Kernels

    chunks, budgets = [int(c) for c in FLAGS.chunks], [int(b) for b in FLAGS.budgets]
    if any(c < 0 for c in chunks) or any(b < 1 for b in budgets):
        raise UserError(f"--chunks must be >= 0 and --budgets >= 1, got {chunks} and {budgets}")
    gen = Generator.load(FLAGS.target, FLAGS.drafter, exact=FLAGS.exact)
    base, source = workload.load_prompts(gen, FLAGS.prompts, FLAGS.num_prompts)
    batches = [[p] for p in at_length(base, FLAGS.context, FLAGS.num_prompts)]
    depth = gen.drafter.config.num_draft
    default = Kernels.from_env().topk_chunk
    settings = [("ar", 1, default), ("dflash", depth, default)]
    settings += [("ddtree", b, c) for b in budgets for c in chunks]
    kws = [
        {"method": m, "budget": b, "chunk": c, "max_new_tokens": FLAGS.max_new_tokens, "ignore_eos": True}
        for m, b, c in settings
    ]
    specs = [
        gen.spec_for(
            batches[0], temperature=0.0, kernels=chunked(kw["chunk"]), **{k: v for k, v in kw.items() if k != "chunk"}
        )
        for kw in kws
    ]
    gen.precompile(specs, FLAGS.compile_workers)
    with tqdm(total=len(kws) + FLAGS.repeats, desc="ab_topk") as bar:
        timed = common.time_interleaved(_ChunkedGen(gen), batches, kws, FLAGS.repeats, bar)
    cells = [common.cell_stats(gen, firsts, medians) for firsts, medians in timed]
    ar_rows, chain_tps = cells[0]["rows"], cells[1]["tokens_per_s"]
    lax_tps = {
        b: c["tokens_per_s"] for (m, b, chunk), c in zip(settings, cells, strict=True) if m == "ddtree" and chunk == 0
    }
    meta, rows = common.metadata() | {"exact": gen.exact}, []
    for (method, budget, chunk), cell in zip(settings, cells, strict=True):
        rows.append(
            {
                "method": method,
                "budget": budget,
                "chunk": chunk,
                "tokens_per_round": cell["tokens_per_round"],
                "tokens_per_s": cell["tokens_per_s"],
                "vs_chain": cell["tokens_per_s"] / chain_tps,
                "vs_lax": cell["tokens_per_s"] / lax_tps[budget] if method == "ddtree" and lax_tps else None,
                "identical": cell["rows"] == ar_rows,
                "prompt_source": source,
                "concurrency": 1,
                "context": FLAGS.context,
                "max_new_tokens": FLAGS.max_new_tokens,
                "repeats": FLAGS.repeats,
                **meta,
            }
        )
    common.write_results("ab_topk", rows, COLUMNS, FLAGS.out_dir or None)
    print(common.markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    run_app(main)
