"""The DDTree benchmark matrix on a model pair, one axis at a time: AR vs the DFlash chain vs DDTree vs `auto`.

    python -m experiments.sweep --axis=budget        # DDTree budgets {4..64} (--budgets) at concurrency 1
    python -m experiments.sweep --axis=concurrency   # batch {1..128}, DDTree at --axis_budgets
    python -m experiments.sweep --axis=context       # prompt length {60..8192} (clamped to the model's limit)
    python -m experiments.sweep --axis=budget,concurrency,context   # all three in one process

Per cell (method, budget, concurrency B, context): the prompts are cut to the context length and run as
ceil(num_prompts / B) batches of B rows (prompts cycled); each batch of each method once to warm up, then `repeats`
rounds that time every method of the (B, context) point in turn (interleaved, so drift hits all methods alike).
Every cell's program is compiled up front, `--compile_workers` at a time. wall_s is the sum over batches of the
median wall time (compilation excluded). tokens_per_s is aggregate
(generated tokens / wall_s); tokens_per_s_per_request the mean over rows of row tokens / batch wall time;
tokens_per_round the acceptance length (committed tokens per round, bonus included); speedup is over AR measured
in the same run at the same (B, context); `correct` says the greedy outputs equal AR's token for token.
Results are rewritten after every (B, context) point to <out_dir>/sweep_<axis>.json and .md: sweep_<axis>_<tag>.* with
--tag (a run beside the matrix, e.g. --tag=auto, leaves its records alone), then _float32 with --dtype=float32 (an
exactness run never overwrites the bf16 matrix).

`auto` (`Generator.generate(method="auto")`) runs beside the fixed methods at every cell: its row's `chosen` counts
the programs it picked over the cell's calls, untimed and timed (`ddtree-8 x10,dflash x5`: a choice that moved with
the acceptance observed), and `vs_best` its tokens/s over the best fixed method's
in the cell. Its cost table is --calibration, else calibration.json beside --drafter (either serves every axis), else
one table per axis over that axis's own cells (its concurrencies x contexts, its fixed methods as candidates):
<calibration_dir>/<records' name>_calibration.json when that one was measured on this device, dtype and numerics over
that grid, else measured in this process just before the axis's cells (`ddtree_jax.calibration`) and written at once
to <out_dir>/<records' name>_calibration.json, e.g. sweep_concurrency_auto_calibration.json. --calibrate_only
measures and writes those tables and stops. With --ignore_eos the sweep's programs are the tables' own (rows run to
max_new_tokens), so measuring a table compiles only their 1-token twins.
"""

from __future__ import annotations

import collections
import math
import os
from pathlib import Path
from typing import NamedTuple

from absl import flags
from tqdm import tqdm

from ddtree_jax.calibration import at_length
from ddtree_jax.cost_table import Candidate, CostTable
from ddtree_jax.errors import UserError, run_app
from experiments import common, workload

FLAGS = flags.FLAGS
AXES = ("budget", "concurrency", "context")
flags.DEFINE_list("axis", ["budget"], f"axes of the matrix to sweep, any of {AXES} (one process shares compilations)")
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("budgets", ["4", "8", "16", "32", "64"], "DDTree budgets on the budget axis")
flags.DEFINE_list("axis_budgets", ["8", "16"], "DDTree budgets on the concurrency and context axes")
flags.DEFINE_list("concurrency", ["1", "8", "32", "64", "128"], "batch sizes (concurrency axis)")
flags.DEFINE_list("contexts", ["60", "1024", "4096", "8192"], "prompt lengths in tokens (context axis)")
flags.DEFINE_integer("prompt_len", 60, "prompt length on the budget and concurrency axes")
flags.DEFINE_integer("num_prompts", 5, "prompt rows per cell, cycling the file's prompts (at least one batch)")
flags.DEFINE_integer("repeats", 3, "timed runs per batch (median)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per row")
flags.DEFINE_bool("ignore_eos", False, "generate max_new_tokens even past a stop token")
flags.DEFINE_list(
    "methods", ["ar", "dflash", "ddtree", "auto"], "methods per cell (ar always runs: it is the reference)"
)
flags.DEFINE_string(
    "calibration", "", "auto's cost table for every axis (default: calibration.json beside --drafter, else per axis)"
)
flags.DEFINE_string(
    "calibration_dir", "", "folder of per-axis cost tables from an earlier run, used where they fit (default: none)"
)
flags.DEFINE_bool("calibrate_only", False, "measure and write each axis's cost table for auto, then stop (no sweep)")
flags.DEFINE_string("tag", "", "records named sweep_<axis>_<tag> (e.g. auto), beside the matrix's sweep_<axis>")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and activations of both models")
flags.DEFINE_integer(
    "compile_workers", min(8, os.cpu_count() or 1), "threads compiling all cells' programs up front (1: one by one)"
)
flags.DEFINE_bool("exact", None, "the target's exact (batch- and tree-invariant) numerics; default: the product's")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")
flags.register_validator("axis", lambda v: bool(v) and set(v) <= set(AXES), f"--axis: values from {AXES}")

COLUMNS = [
    "method",
    "budget",
    "concurrency",
    "context",
    "tokens_per_round",
    "tokens_per_s",
    "tokens_per_s_per_request",
    "speedup",
    "chosen",
    "vs_best",
    "correct",
    "rows_identical",
    "wall_s",
    "compile_s",
]


def clamp_context(requested: int, max_pos: int, max_new: int, depth: int) -> int:
    """The longest prompt (a multiple of the 32-token bucket) whose positions stay below max_pos."""
    limit = (max_pos - max_new - depth - 2) // 32 * 32
    return min(requested, limit)


def _gen_kwargs(method: str, budget: int | None) -> dict:
    """`generate`'s keywords for a cell's method; the budget only for ddtree (a record's budget of ar and the chain
    is a label), so that auto's choice runs the very program of the fixed method it picked."""
    budget = budget if method == "ddtree" else None
    return {"method": method, "budget": budget, "max_new_tokens": FLAGS.max_new_tokens, "ignore_eos": FLAGS.ignore_eos}


def cells(axis: str) -> list[tuple[int, int]]:
    """(concurrency, requested context) groups of the axis; each runs ar, dflash and ddtree at every budget."""
    if axis == "concurrency":
        return [(int(b), FLAGS.prompt_len) for b in FLAGS.concurrency]
    if axis == "context":
        return [(1, int(c)) for c in FLAGS.contexts]
    return [(1, FLAGS.prompt_len)]


class Group(NamedTuple):
    """One (concurrency, context) point of an axis: its batches and the methods that run on them."""

    concurrency: int
    context: int
    requested: int
    batches: list[list[list[int]]]
    methods: list[tuple[str, int | None]]  # (method, budget); auto's budget is None (it chooses)


def plan_axis(gen, axis: str, base: list[list[int]], depth: int) -> list[Group]:
    """The groups of one axis (contexts clamped to the model, duplicates after clamping dropped)."""
    budgets = [int(b) for b in (FLAGS.budgets if axis == "budget" else FLAGS.axis_budgets)]
    methods = [("ar", 1)]
    methods += [("dflash", depth)] if "dflash" in FLAGS.methods else []
    methods += [("ddtree", b) for b in budgets] if "ddtree" in FLAGS.methods else []
    methods += [("auto", None)] if "auto" in FLAGS.methods else []
    max_pos = gen.target_config.max_position_embeddings
    groups, seen = [], set()
    for conc, requested in cells(axis):
        ctx = clamp_context(requested, max_pos, FLAGS.max_new_tokens, depth)
        if (conc, ctx) in seen:
            continue
        seen.add((conc, ctx))
        n_rows = conc * math.ceil(max(FLAGS.num_prompts, 1) / conc)
        rows = at_length(base, ctx, n_rows)
        batches = [rows[i : i + conc] for i in range(0, n_rows, conc)]
        groups.append(Group(conc, ctx, requested, batches, methods))
    return groups


def group_specs(gen, group: Group) -> list:
    """The compiled programs a group's fixed methods run (one per method and batch shape); auto runs one of them,
    or compiles its choice in its untimed run."""
    fixed = [(m, bud) for m, bud in group.methods if m != "auto"]
    return [gen.spec_for(b, temperature=0.0, **_gen_kwargs(m, bud)) for m, bud in fixed for b in group.batches]


class Grid(NamedTuple):
    """auto's calibration grid of one axis: its fixed methods as candidates, its concurrencies and contexts."""

    candidates: list[Candidate]
    batches: list[int]  # sorted
    contexts: list[int]  # sorted


def axis_grid(groups: list[Group]) -> Grid:
    """The grid of an axis's groups (a table over it holds each cell at a grid point)."""
    fixed = dict.fromkeys((m, b) for g in groups for m, b in g.methods if m != "auto")
    candidates = [Candidate(m, b if m == "ddtree" else None) for m, b in fixed]
    return Grid(candidates, sorted({g.concurrency for g in groups}), sorted({g.context for g in groups}))


def table_path(directory: str | Path, axis: str) -> Path:
    """<directory>/<the axis's records' name>_calibration.json."""
    return Path(directory) / f"{result_name(axis)}_calibration.json"


def calibrate(gen, axis: str, groups: list[Group], base: list[list[int]]) -> CostTable:
    """auto's cost table of one axis measured over its grid (`axis_grid`), rows cut from the sweep's prompts
    (`calibration.measure`); written to <out_dir> as soon as measured (`table_path`)."""
    from ddtree_jax.calibration import measure

    grid = axis_grid(groups)
    table = measure(
        gen,
        base,
        candidates=grid.candidates,
        batches=grid.batches,
        contexts=grid.contexts,
        max_new_tokens=FLAGS.max_new_tokens,
        repeats=FLAGS.repeats,
        compile_workers=FLAGS.compile_workers,
        target=FLAGS.target,
        drafter=FLAGS.drafter,
        progress=f"calibrate auto ({axis})",
    )
    out = table_path(FLAGS.out_dir or common.RESULTS_DIR, axis)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    print(f"auto's cost table for {axis} measured here: {out}")
    return table


def stored_table(gen, axis: str, groups: list[Group]) -> CostTable | None:
    """The axis's table in --calibration_dir when it was measured on this device, dtype and numerics over the axis's
    grid; None otherwise (saying why when there is a table)."""
    if not FLAGS.calibration_dir or not (path := table_path(FLAGS.calibration_dir, axis)).is_file():
        return None
    grid = axis_grid(groups)
    try:
        table = CostTable.load(path)
        table.check(**gen.device_identity())
    except UserError as e:
        print(f"not using {e}")
        return None
    names = {c.name for c in grid.candidates}
    if (set(table.round_ms), table.batches, table.contexts) != (names, tuple(grid.batches), tuple(grid.contexts)):
        print(f"not using {path}: its grid is not {axis}'s ({sorted(names)} x {grid.batches} x {grid.contexts})")
        return None
    print(f"auto's cost table for {axis}: {path}")
    return table


def use_table(gen, given: CostTable | None, axis: str, groups: list[Group], base: list[list[int]]) -> str:
    """Make auto choose by `given` (--calibration or the drafter's, for every axis), else by the axis's own table
    (`stored_table`, else `calibrate`); checked against this Generator. Returns where the table came from."""
    if given is None:
        gen.use_calibration(stored_table(gen, axis, groups) or calibrate(gen, axis, groups, base))
    gen.calibration.check(**gen.device_identity())
    return gen.calibration.source or f"measured in this run ({table_path('', axis).name})"


class ChoiceLog:
    """A Generator whose `generate` also counts what each `method="auto"` call chose (warm-up and timed runs)."""

    def __init__(self, gen):
        self.gen, self.chosen = gen, collections.Counter()

    def __getattr__(self, name: str):
        return getattr(self.gen, name)

    def generate(self, prompts, **kw):
        res = self.gen.generate(prompts, **kw)
        if res.auto is not None:
            self.chosen[res.auto.candidate.name] += 1
        return res


def sweep_axis(gen, axis: str, groups: list[Group], config: dict, meta: dict) -> list[dict]:
    """All cells of one axis -> records (also written to <result_name(axis)>.json/.md after every cell)."""
    max_pos = gen.target_config.max_position_embeddings
    records = []
    bar = tqdm(total=sum(len(g.methods) + FLAGS.repeats for g in groups), desc=f"sweep {axis}")
    for conc, ctx, requested, batches, methods in groups:
        bar.set_description(f"sweep {axis} B={conc} ctx={ctx}")
        kws = [_gen_kwargs(m, bud) for m, bud in methods]
        log = ChoiceLog(gen)
        timed = common.time_interleaved(log, batches, kws, FLAGS.repeats, bar)
        cells_ = [common.cell_stats(gen, firsts, medians) for firsts, medians in timed]
        ar_stats, ar_rows = cells_[0], cells_[0]["rows"]  # plan_axis puts ar first
        best_fixed = max(st["tokens_per_s"] for (m, _), st in zip(methods, cells_, strict=True) if m != "auto")
        for (method, budget), stats in zip(methods, cells_, strict=True):
            out_rows = stats.pop("rows")
            auto = {}
            if method == "auto":
                chosen = ",".join(f"{name} x{n}" for name, n in log.chosen.items())
                auto = {"chosen": chosen, "vs_best": stats["tokens_per_s"] / best_fixed}
            same = [a == b for a, b in zip(ar_rows, out_rows, strict=True)]
            rec = {
                "axis": axis,
                "method": method,
                "budget": budget,
                "concurrency": conc,
                "context": ctx,
                "context_requested": requested,
                "context_clamped": ctx < requested,
                **stats,
                "speedup": stats["tokens_per_s"] / ar_stats["tokens_per_s"],
                **auto,
                "correct": all(same),
                "rows_identical": sum(same) / len(same),
                **config,
                **meta,
            }
            records.append(rec)
        common.write_results(result_name(axis), records, COLUMNS, FLAGS.out_dir or None, {"config": config})
    bar.close()
    if any(r["context_clamped"] for r in records):
        print(f"note: contexts clamped to max_position_embeddings {max_pos} minus generation room")
    return records


def result_name(axis: str) -> str:
    """sweep_<axis>, then _<tag> with --tag, then _<dtype> unless it is bf16 (the matrix's default)."""
    tag = f"_{FLAGS.tag}" if FLAGS.tag else ""
    return f"sweep_{axis}{tag}" + ("" if FLAGS.dtype == "bfloat16" else f"_{FLAGS.dtype}")


def main(_) -> None:
    import jax.numpy as jnp

    from ddtree_jax import engine
    from ddtree_jax.api import Generator

    calibration = FLAGS.calibration or None
    gen = Generator.load(
        FLAGS.target, FLAGS.drafter, dtype=jnp.dtype(FLAGS.dtype), calibration=calibration, exact=FLAGS.exact
    )
    base, source = workload.load_prompts(gen, FLAGS.prompts, max(FLAGS.num_prompts, 1))
    config = {
        "target": FLAGS.target,
        "drafter": FLAGS.drafter,
        "prompt_source": source,
        "max_new_tokens": FLAGS.max_new_tokens,
        "repeats": FLAGS.repeats,
        "num_prompts": FLAGS.num_prompts,
        "ignore_eos": FLAGS.ignore_eos,
        "temperature": 0.0,
        "dtype": FLAGS.dtype,
        "exact": gen.exact,
        "matmul_precision": engine.matmul_precision(jnp.dtype(FLAGS.dtype)) or "default",
        "num_draft": gen.drafter.config.num_draft,
        "max_position_embeddings": gen.target_config.max_position_embeddings,
    }
    plans = {axis: plan_axis(gen, axis, base, config["num_draft"]) for axis in FLAGS.axis}
    if FLAGS.calibrate_only:
        for axis, groups in plans.items():
            calibrate(gen, axis, groups, base)
        return
    specs = [sp for groups in plans.values() for g in groups for sp in group_specs(gen, g)]
    print(f"compiling {len(set(specs))} programs on {FLAGS.compile_workers} threads")
    config["precompile_s"] = gen.precompile(specs, FLAGS.compile_workers)
    config["compile_workers"] = FLAGS.compile_workers
    print(f"compiled in {config['precompile_s']:.1f}s")
    given = gen.calibration if "auto" in FLAGS.methods else None
    meta = common.metadata()
    for axis, groups in plans.items():
        axis_config = config
        if "auto" in FLAGS.methods:
            axis_config = {**config, "calibration": use_table(gen, given, axis, groups, base)}
        print(common.markdown_table(sweep_axis(gen, axis, groups, axis_config, meta), COLUMNS))


if __name__ == "__main__":
    run_app(main)
