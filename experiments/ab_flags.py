"""A/B of XLA flag settings on generation: the same budget sweep under each setting, at concurrency 1.

    python -m experiments.ab_flags --setting=default= \
        --setting=no_split_k=--xla_gpu_enable_split_k_autotuning=false [--budgets=16,32 --cycles=2]

XLA reads XLA_FLAGS once per process, so every setting runs `experiments.sweep --axis=budget` in its own process
(its flags appended to the ambient XLA_FLAGS). The settings take turns for --cycles cycles (A B A B ...), so drift
over the run lands on each alike; a cell's tokens/s is the median over cycles of the sweep's own medians. The
flags change speed, never tokens: tokens per round must match the first setting's (`same_acceptance`).
Writes <out_dir>/ab_flags.json and .md (first setting = the baseline of `vs_first`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from absl import flags

from ddtree_jax.errors import UserError, run_app
from experiments import common, workload
from experiments.progress import Progress

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("setting", ["default="], "NAME=XLA flags (appended to $XLA_FLAGS); the first is the baseline")
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_list("budgets", ["16", "32"], "DDTree budgets (AR and the chain always run)")
flags.DEFINE_integer("cycles", 2, "times every setting runs, in turn")
flags.DEFINE_integer("repeats", 5, "timed runs per cell inside each sweep (median)")
flags.DEFINE_integer("num_prompts", 5, "prompts, each run alone")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per row")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["setting", "method", "budget", "tokens_per_round", "tokens_per_s", "vs_chain", "vs_first", "same_acceptance"]


def parse_settings(raw: list[str]) -> dict[str, str]:
    """["name=flags", ...] -> {name: flags}, names unique and non-empty."""
    out: dict[str, str] = {}
    for item in raw:
        name, sep, value = item.partition("=")
        if not sep or not name or name in out:
            raise UserError(f"--setting {item!r}: want NAME=FLAGS with a new, non-empty NAME")
        out[name] = value.strip()
    return out


def run_sweep(flags_: str, out_dir: Path) -> list[dict]:
    """One `sweep --axis=budget` process under `flags_` -> its records."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags_}".strip()}
    cmd = [sys.executable, "-m", "experiments.sweep", "--axis=budget", f"--budgets={','.join(FLAGS.budgets)}"]
    cmd += [f"--target={FLAGS.target}", f"--drafter={FLAGS.drafter}", f"--repeats={FLAGS.repeats}"]
    cmd += [f"--num_prompts={FLAGS.num_prompts}", f"--max_new_tokens={FLAGS.max_new_tokens}", f"--out_dir={out_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sweep under XLA_FLAGS={env['XLA_FLAGS']!r} failed:\n{proc.stderr[-2000:]}")
    return json.loads((out_dir / "sweep_budget.json").read_text())["records"]


def main(_) -> None:
    settings = parse_settings(FLAGS.setting)
    if FLAGS.cycles < 1:
        raise UserError(f"--cycles must be >= 1, got {FLAGS.cycles}")
    runs: dict[str, list[list[dict]]] = {name: [] for name in settings}
    bar = Progress(FLAGS.cycles * len(settings), "ab_flags")
    with tempfile.TemporaryDirectory() as tmp:
        for cycle in range(FLAGS.cycles):
            for name, value in settings.items():
                bar.step(f"cycle {cycle + 1}: {name}")
                runs[name].append(run_sweep(value, Path(tmp) / f"{name}_{cycle}"))
    bar.done()
    first = next(iter(settings))
    cells = {}
    for name, sweeps in runs.items():
        for recs in zip(*sweeps, strict=True):
            r = recs[0]
            cells[(name, r["method"], r["budget"])] = {
                "tokens_per_round": r["tokens_per_round"],
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in recs),
                "per_cycle": [x["tokens_per_s"] for x in recs],
            }
    meta, rows = common.metadata(), []
    for (name, method, budget), c in cells.items():
        chain = next(v for (n, m, _), v in cells.items() if n == name and m == "dflash")
        base = cells[(first, method, budget)]
        rows.append(
            {
                "setting": name,
                "xla_flags": settings[name],
                "method": method,
                "budget": budget,
                **c,
                "vs_chain": c["tokens_per_s"] / chain["tokens_per_s"],
                "vs_first": c["tokens_per_s"] / base["tokens_per_s"],
                "same_acceptance": c["tokens_per_round"] == base["tokens_per_round"],
                "cycles": FLAGS.cycles,
                "repeats": FLAGS.repeats,
                "concurrency": 1,
                "max_new_tokens": FLAGS.max_new_tokens,
                **meta,
            }
        )
    common.write_results("ab_flags", rows, COLUMNS, FLAGS.out_dir or None)
    print(common.markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    run_app(main)
