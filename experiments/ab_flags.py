"""A/B of XLA flag / environment settings on generation: the same budget sweep under each, at concurrency 1.

    python -m experiments.ab_flags --setting=default= \
        --setting=no_split_k=--xla_gpu_enable_split_k_autotuning=false \
        --setting=mosaic=DDTREE_MLA_KERNEL=mosaic [--budgets=16,32 --cycles=2]

A setting is NAME=ITEMS, ITEMS space-separated: `--xla...` flags (appended to the ambient XLA_FLAGS) and `VAR=value`
environment variables (e.g. DDTREE_MLA_KERNEL, read when a process starts). XLA reads XLA_FLAGS once per process,
so every setting runs `experiments.sweep --axis=budget` in its own process. The settings take turns for --cycles
cycles (A B A B ...), so drift over the run lands on each alike; a cell's tokens/s is the median over cycles of the
sweep's own medians. Settings change speed, never tokens: tokens per round must match the first setting's
(`same_acceptance`).
Writes <out_dir>/ab_flags.json and .md (first setting = the baseline of `vs_first`).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from absl import flags
from tqdm import tqdm

from ddtree_jax.errors import UserError, run_app
from experiments import common, workload

FLAGS = flags.FLAGS
flags.DEFINE_multi_string(
    "setting", ["default="], "NAME=ITEMS: --xla flags and VAR=value env variables; the first is the baseline"
)
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_list("budgets", ["16", "32"], "DDTree budgets (AR and the chain always run)")
flags.DEFINE_integer("cycles", 2, "times every setting runs, in turn")
flags.DEFINE_integer("repeats", 5, "timed runs per cell inside each sweep (median)")
flags.DEFINE_integer("num_prompts", 5, "prompts, each run alone")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per row")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["setting", "method", "budget", "tokens_per_round", "tokens_per_s", "vs_chain", "vs_first", "same_acceptance"]


class Setting(NamedTuple):
    xla_flags: str  # appended to $XLA_FLAGS
    env: dict[str, str]  # set in the sweep's environment


def parse_settings(raw: list[str]) -> dict[str, Setting]:
    """["NAME=ITEMS", ...] -> {name: Setting}; names unique and non-empty, items `--flag...` or `VAR=value`."""
    out: dict[str, Setting] = {}
    for item in raw:
        name, sep, value = item.partition("=")
        if not sep or not name or name in out:
            raise UserError(f"--setting {item!r}: want NAME=FLAGS with a new, non-empty NAME")
        xla, env = [], {}
        for token in value.split():
            var, eq, val = token.partition("=")
            if token.startswith("--"):
                xla.append(token)
            elif eq and re.fullmatch(r"[A-Z_][A-Z0-9_]*", var):
                env[var] = val
            else:
                raise UserError(f"--setting {item!r}: {token!r} is neither an --xla flag nor VAR=value")
        out[name] = Setting(" ".join(xla), env)
    return out


def run_sweep(setting: Setting, out_dir: Path) -> list[dict]:
    """One `sweep --axis=budget` process under `setting` -> its records."""
    env = {**os.environ, **setting.env, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {setting.xla_flags}".strip()}
    cmd = [sys.executable, "-m", "experiments.sweep", "--axis=budget", f"--budgets={','.join(FLAGS.budgets)}"]
    cmd += ["--methods=ar,dflash,ddtree"]  # the fixed methods: auto would only repeat one of them
    cmd += [f"--target={FLAGS.target}", f"--drafter={FLAGS.drafter}", f"--repeats={FLAGS.repeats}"]
    cmd += [f"--num_prompts={FLAGS.num_prompts}", f"--max_new_tokens={FLAGS.max_new_tokens}", f"--out_dir={out_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sweep under {setting} failed:\n{proc.stderr[-2000:]}")
    return json.loads((out_dir / "sweep_budget.json").read_text())["records"]


def main(_) -> None:
    settings = parse_settings(FLAGS.setting)
    if FLAGS.cycles < 1:
        raise UserError(f"--cycles must be >= 1, got {FLAGS.cycles}")
    runs: dict[str, list[list[dict]]] = {name: [] for name in settings}
    bar = tqdm(total=FLAGS.cycles * len(settings), desc="ab_flags")
    with tempfile.TemporaryDirectory() as tmp:
        for cycle in range(FLAGS.cycles):
            for name, value in settings.items():
                bar.set_postfix_str(f"cycle {cycle + 1}: {name}")
                runs[name].append(run_sweep(value, Path(tmp) / f"{name}_{cycle}"))
                bar.update()
    bar.close()
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
                "xla_flags": settings[name].xla_flags,
                "env": " ".join(f"{k}={v}" for k, v in settings[name].env.items()),
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
