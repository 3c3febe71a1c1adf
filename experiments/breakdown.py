"""Where the time of one round goes, measured inside the real generation program: device time and kernel count of
each piece (draft / tree build / verify / accept, or the AR step), the rest of the loop, and the idle time between
kernels (launch gaps, the loop's per-round predicate copy to the host).

    python -m experiments.breakdown [--budgets=8,16,32] [--concurrency=1] [--context=60]

Per method: `round_ms` = (wall(--max_new_tokens) - wall(1 token: prefill only)) / loop iterations, medians of --repeats
runs of the compiled programs (all compiled up front on threads). Then one run under `jax.profiler`; its device events
are joined with the program's HLO metadata (engine.py puts every piece in a `jax.named_scope`:
experiments/device_profile.py) into `<piece>_ms` and `<piece>_kernels` per round; `other` = loop ops outside the pieces,
`idle_ms` = round_ms - device-busy time; `top_kernels`: the --top_kernels costliest kernels as [scope:kernel,
microseconds per round, launches per round]. The prefill is kept apart: `prefill_ms` and `prefill_kernels`, its device
time and kernels in the profiled run (once per call, not per round), and `prefill_top_kernels` as top_kernels. On a CPU
the per-op events of a multi-threaded runtime overlap, so only the GPU numbers add up. On a GPU XLA runs the loop body
as one CUDA graph: its kernels follow each other without launch gaps, and the profiler stretches them a little, so
`idle_ms` comes out near zero or slightly negative. Writes <out_dir>/<name>.json and .md (default breakdown); with
--save_hlo also each method's compiled program, <name>_<method><budget>.hlo.txt.gz.
"""

from __future__ import annotations

import gzip
import os
import statistics

from absl import flags
from tqdm import tqdm

from ddtree_jax.calibration import at_length
from ddtree_jax.errors import run_app
from experiments import common, device_profile, workload

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("budgets", ["8", "16", "32"], "DDTree budgets")
flags.DEFINE_list("methods", ["ar", "dflash", "ddtree"], "methods to break down")
flags.DEFINE_integer("concurrency", 1, "batch rows")
flags.DEFINE_integer("context", 60, "prompt tokens per row")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per row (stop tokens ignored)")
flags.DEFINE_integer("repeats", 5, "timed runs per program (median)")
flags.DEFINE_integer("compile_workers", min(8, os.cpu_count() or 1), "threads compiling the programs up front")
flags.DEFINE_bool("exact", None, "the target's exact (batch- and tree-invariant) numerics; default: the product's")
common.define_projections_flag()
flags.DEFINE_integer(
    "exact_segment", 0, "absolute positions per segment of the exact MLA kernel (mla_exact.SEGMENT; 0: the kernel's)"
)
flags.DEFINE_integer("top_kernels", 12, "costliest kernels recorded per method (all of a round's: e.g. 400)")
flags.DEFINE_string("name", "breakdown", "results file name")
flags.DEFINE_bool("save_hlo", False, "also write each method's compiled program, <name>_<method><budget>.hlo.txt.gz")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

PIECES = ("draft", "tree", "verify", "accept", "step", "other")  # `step`: the AR round; `other`: loop ops outside
SCOPES = ("prefill", *PIECES[:-1])
COLUMNS = ["method", "budget", "concurrency", "context", "tokens_per_round", "round_ms"]
COLUMNS += [f"{p}_ms" for p in PIECES] + ["idle_ms", "kernels_per_round", "prefill_ms"]


def median_wall(gen, prompts, kw: dict) -> float:
    return statistics.median(gen.generate(prompts, **kw).wall_s for _ in range(FLAGS.repeats))


def profile_ops(gen, prompts, kw: dict, spec) -> tuple[dict[str, tuple[float, int]], list[str], list, list, str]:
    """({scope: (device microseconds, kernels)}, the most frequent ops no scope claimed, the costliest kernels of the
    rounds and of the prefill (`device_profile.costliest`), the compiled program's HLO text) of one run of `spec`'s
    program under the profiler."""
    (program, _, _), _ = gen.compiled(spec)
    text = program.as_text()
    ops = device_profile.profiled_ops(lambda: gen.generate(prompts, **kw), text)
    scope_map = device_profile.scope_of_ops(text, SCOPES)
    return (
        device_profile.per_scope(ops, scope_map),
        device_profile.unattributed(ops, scope_map),
        device_profile.costliest(ops, scope_map, FLAGS.top_kernels),
        device_profile.costliest(ops, scope_map, FLAGS.top_kernels, prefill=True),
        text,
    )


def main(_) -> None:
    from ddtree_jax.api import Generator

    common.use_projections(FLAGS.projections)
    if FLAGS.exact_segment:  # an experiment's setting, read when the programs are traced
        from pallas_kernels import mla_exact

        mla_exact.SEGMENT = FLAGS.exact_segment
    gen = Generator.load(FLAGS.target, FLAGS.drafter, exact=FLAGS.exact)
    base, source = workload.load_prompts(gen, FLAGS.prompts, FLAGS.concurrency)
    prompts = at_length(base, FLAGS.context, FLAGS.concurrency)
    depth = gen.drafter.config.num_draft
    runs = [("ar", 1), ("dflash", depth)] + [("ddtree", int(b)) for b in FLAGS.budgets]
    runs = [(m, b) for m, b in runs if m in FLAGS.methods]
    kws = {
        (m, b, n): {"method": m, "budget": b, "max_new_tokens": n, "ignore_eos": True}
        for m, b in runs
        for n in (1, FLAGS.max_new_tokens)
    }
    specs = {k: gen.spec_for(prompts, temperature=0.0, **kw) for k, kw in kws.items()}
    print(f"compiled {len(specs)} programs in {gen.precompile(list(specs.values()), FLAGS.compile_workers):.1f}s")
    meta = common.metadata()
    records = []
    for method, budget in (bar := tqdm(runs, desc="breakdown")):
        bar.set_postfix_str(f"{method} b={budget}")
        full, prefill_only = kws[(method, budget, FLAGS.max_new_tokens)], kws[(method, budget, 1)]
        first = gen.generate(prompts, **full)  # warm-up
        gen.generate(prompts, **prefill_only)
        iterations = max(st["rounds"] for st in first.stats)  # the loop runs until its slowest row is done
        committed = sum(st["tokens_per_round"] * st["rounds"] for st in first.stats)
        round_s = (median_wall(gen, prompts, full) - median_wall(gen, prompts, prefill_only)) / iterations
        scopes, misses, top, top_prefill, hlo = profile_ops(
            gen, prompts, full, specs[(method, budget, FLAGS.max_new_tokens)]
        )
        prefill_us, prefill_n = scopes.pop("prefill", (0.0, 0))
        per_round = {p: scopes.get(p, (0.0, 0)) for p in PIECES}
        busy_ms = sum(us for us, _ in per_round.values()) / 1e3 / iterations
        rec = {
            "method": method,
            "budget": budget,
            "concurrency": FLAGS.concurrency,
            "context": FLAGS.context,
            "exact": gen.exact,
            "projections": FLAGS.projections,
            "exact_segment": FLAGS.exact_segment or None,
            "rounds": iterations,
            "tokens_per_round": committed / sum(st["rounds"] for st in first.stats),
            "round_ms": round_s * 1e3,
            **{f"{p}_ms": us / 1e3 / iterations for p, (us, _) in per_round.items()},
            **{f"{p}_kernels": n / iterations for p, (_, n) in per_round.items()},
            "busy_ms": busy_ms,
            "idle_ms": round_s * 1e3 - busy_ms,
            "kernels_per_round": sum(n for _, n in per_round.values()) / iterations,
            "prefill_ms": prefill_us / 1e3,
            "prefill_kernels": prefill_n,
            "prefill_top_kernels": [[name, us, n] for name, us, n in top_prefill],  # per call
            "unattributed_ops": misses,
            "top_kernels": [[name, us / iterations, n / iterations] for name, us, n in top],  # per round
            "max_new_tokens": FLAGS.max_new_tokens,
            "target": FLAGS.target,
            "drafter": FLAGS.drafter,
            "prompt_source": source,
            "repeats": FLAGS.repeats,
            **meta,
        }
        records.append(rec)
        json_path = common.write_results(FLAGS.name, records, COLUMNS, FLAGS.out_dir or None)
        if FLAGS.save_hlo:  # which ops each kernel of top_kernels runs
            hlo_path = json_path.with_name(f"{FLAGS.name}_{method}{budget}.hlo.txt.gz")
            hlo_path.write_bytes(gzip.compress(hlo.encode()))
    print(common.markdown_table(records, COLUMNS))


if __name__ == "__main__":
    run_app(main)
