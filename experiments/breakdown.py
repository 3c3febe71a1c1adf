"""Where the time of one round goes: draft / tree build / verify / accept, on the model pair after a real prefill.

    python -m experiments.breakdown [--budgets=8,16,32] [--concurrency=1] [--context=60]

For AR (one step), the DFlash chain and DDTree at each budget: prefill `--concurrency` held-out prompts of
`--context` tokens, run two rounds (so the drafter has pending target features, as mid-generation), then time each
piece of the next round as its own jitted call (experiments/round_pieces.py; median of `--repeats`), their sum and
the whole round as one jit. Pieces timed alone pay a dispatch each, so their sum slightly exceeds the whole round.
Writes <out_dir>/breakdown.json and .md.
"""

from __future__ import annotations

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from experiments import common, round_pieces, workload
from experiments.progress import Progress

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("budgets", ["8", "16", "32"], "DDTree budgets")
flags.DEFINE_list("methods", ["ar", "dflash", "ddtree"], "methods to break down")
flags.DEFINE_integer("concurrency", 1, "batch rows")
flags.DEFINE_integer("context", 60, "prompt tokens per row")
flags.DEFINE_integer("repeats", 10, "timed calls per piece (median)")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["method", "budget", "concurrency", "context", *[f"{p}_ms" for p in round_pieces.PIECES]]
COLUMNS += ["sum_of_pieces_ms", "round_ms", "ar_step_ms"]


def mid_generation_state(gen, spec, prompts: list[list[int]]):
    """Prefill `prompts` (all of one length) and run two rounds -> the loop state."""
    from ddtree_jax import engine

    target, drafter = gen.target, gen.drafter if spec.method != "ar" else None
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter) if drafter is not None else (None, None)

    @jax.jit
    def run(ts, ds, tokens, lens):
        t, d = nnx.merge(tg, ts), (nnx.merge(dg, ds) if dg is not None else None)
        s = engine.prefill(t, d, spec, tokens, lens, jax.random.key(0))
        for _ in range(2):
            s = engine.ar_round(t, spec, s) if d is None else engine.spec_round(t, d, spec, s)
        return s

    tokens = np.zeros((spec.batch, spec.prompt_len), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return run(ts, ds, tokens, np.array([len(p) for p in prompts], np.int32))


def main(_) -> None:
    from ddtree_jax.api import Generator

    gen = Generator.load(FLAGS.target, FLAGS.drafter)
    base, source = workload.load_prompts(gen, FLAGS.prompts, FLAGS.concurrency)
    prompts = workload.at_length(base, FLAGS.context, FLAGS.concurrency)
    depth = gen.drafter.config.num_draft
    runs = [("ar", 1), ("dflash", depth)] + [("ddtree", int(b)) for b in FLAGS.budgets]
    runs = [(m, b) for m, b in runs if m in FLAGS.methods]
    meta = common.metadata()
    records = []
    bar = Progress(len(runs), "breakdown")
    for method, budget in runs:
        bar.step(f"{method} b={budget}")
        spec = gen.spec(
            FLAGS.concurrency,
            FLAGS.context,
            method=method,
            budget=budget,
            temperature=0.0,
            max_new_tokens=64,
            ignore_eos=True,
        )
        s = mid_generation_state(gen, spec, prompts)
        times, _ = round_pieces.time_round(gen.target, gen.drafter, spec, s, repeats=FLAGS.repeats)
        rec = {
            "method": method,
            "budget": budget,
            "concurrency": FLAGS.concurrency,
            "context": FLAGS.context,
            "target": FLAGS.target,
            "drafter": FLAGS.drafter,
            "prompt_source": source,
            "repeats": FLAGS.repeats,
            **{f"{k}_ms": v * 1e3 for k, v in times.items()},
            **meta,
        }
        records.append(rec)
        common.write_results("breakdown", records, COLUMNS, FLAGS.out_dir or None)
    bar.done()
    print(common.markdown_table(records, COLUMNS))


if __name__ == "__main__":
    app.run(main)
