"""Does the chunk-wise top-k pay off inside generation? The tree's candidates by `lax.top_k` (chunk 0) against
`ddtree_jax.topk` at each --chunks length, per DDTree budget, with AR and the DFlash chain, all in one process.

    python -m experiments.ab_topk [--budgets=8,16,32 --chunks=0,512 --repeats=9]

Every program is compiled up front (one per budget and chunk length: `api.Generator` keys programs by
`topk.CHUNK`); then `common.time_interleaved` times all settings round by round, so drift lands on each alike. Both
top-k forms return the same candidates, so every DDTree row must equal AR's and a budget's acceptance must not
depend on the chunk length; `identical` and `tokens_per_round` show it. Writes <out_dir>/ab_topk.json and .md.
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments import common, workload
from experiments.progress import Progress

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

COLUMNS = ["method", "budget", "chunk", "tokens_per_round", "tokens_per_s", "vs_chain", "vs_lax", "identical"]


class _ChunkedGen:
    """`gen.generate` with the top-k chunk length as one more keyword (what `time_interleaved` varies)."""

    def __init__(self, gen):
        self.gen = gen

    def generate(self, batch, chunk: int, **kw):
        from ddtree_jax import topk

        with topk.chunk_length(chunk):
            return self.gen.generate(batch, **kw)


def main(_) -> None:
    from ddtree_jax import topk
    from ddtree_jax.api import Generator

    chunks, budgets = [int(c) for c in FLAGS.chunks], [int(b) for b in FLAGS.budgets]
    if any(c < 0 for c in chunks) or any(b < 1 for b in budgets):
        raise app.UsageError(f"--chunks must be >= 0 and --budgets >= 1, got {chunks} and {budgets}")
    gen = Generator.load(FLAGS.target, FLAGS.drafter)
    base, source = workload.load_prompts(gen, FLAGS.prompts, FLAGS.num_prompts)
    batches = [[p] for p in workload.at_length(base, FLAGS.context, FLAGS.num_prompts)]
    depth = gen.drafter.config.num_draft
    settings = [("ar", 1, topk.CHUNK), ("dflash", depth, topk.CHUNK)]
    settings += [("ddtree", b, c) for b in budgets for c in chunks]
    kws = [
        {"method": m, "budget": b, "chunk": c, "max_new_tokens": FLAGS.max_new_tokens, "ignore_eos": True}
        for m, b, c in settings
    ]
    for c in dict.fromkeys(s[2] for s in settings):
        with topk.chunk_length(c):
            specs = [
                gen.spec_for(batches[0], temperature=0.0, **{k: v for k, v in kw.items() if k != "chunk"}) for kw in kws
            ]
            gen.precompile([s for s, kw in zip(specs, kws, strict=True) if kw["chunk"] == c], FLAGS.compile_workers)
    bar = Progress(len(kws) + FLAGS.repeats, "ab_topk")
    timed = common.time_interleaved(_ChunkedGen(gen), batches, kws, FLAGS.repeats, bar.step)
    bar.done()
    meta = common.metadata()
    rows = []
    for (method, budget, chunk), (firsts, medians) in zip(settings, timed, strict=True):
        stats = [s for f in firsts for s in f.stats]
        tokens = [t for f in firsts for t in f.tokens]
        rounds = sum(s["rounds"] for s in stats)
        committed = sum(s["tokens_per_round"] * s["rounds"] for s in stats)
        rows.append(
            {
                "method": method,
                "budget": budget,
                "chunk": chunk,
                "tokens_per_round": committed / rounds,
                "tokens_per_s": sum(len(t) for t in tokens) / sum(medians),
                "tokens": tokens,
                "prompt_source": source,
                "concurrency": 1,
                "context": FLAGS.context,
                "max_new_tokens": FLAGS.max_new_tokens,
                "repeats": FLAGS.repeats,
                **meta,
            }
        )
    ar, chain = rows[0], rows[1]
    lax_tps = {r["budget"]: r["tokens_per_s"] for r in rows[2:] if r["chunk"] == 0}
    for r in rows:
        r["identical"] = r.pop("tokens") == ar["tokens"] if r is not ar else True
        r["vs_chain"] = r["tokens_per_s"] / chain["tokens_per_s"]
        r["vs_lax"] = r["tokens_per_s"] / lax_tps[r["budget"]] if r["method"] == "ddtree" and lax_tps else None
    ar.pop("tokens", None)
    common.write_results("ab_topk", rows, COLUMNS, FLAGS.out_dir or None)
    print(common.markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    app.run(main)
