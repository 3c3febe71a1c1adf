"""Is speculative output bit-identical to AR whatever the batch, method and budget? (issue 34)

    python -m experiments.exact_check                  # one GPU: the shipped pair in bf16, the switch on and off
    python -m experiments.exact_check --target=T --drafter=D --num_prompts=4 --batches=1,2 --budgets=4 \\
        --contexts=40 --max_new_tokens=8 --exact_modes=off     # CPU smoke test

For each setting of the switch (`--exact_modes`: `Generator(exact=...)`), each context of `--contexts` (ragged:
request i is cut `i * 7 % 23` tokens short of it, so every batch mixes lengths) and each batch size of
`--batches`, the same `--num_prompts` requests run greedily as ar, dflash and ddtree at `--budgets`, in batches of
that size. Every request's tokens are compared with its own `ar` tokens at batch 1 under the same switch:
`rows_differ` per cell (the claim: 0 everywhere with the switch on). `tokens_per_s`: tokens generated / summed
execution seconds of the cell's calls after one warm-up call (compilation excluded); `vs_off` (switch-on rows):
the cell's tokens_per_s over the same cell's with the switch off, measured in this run in either order.

tokens/s is the product of two things, split out: `tokens_per_round` (tokens committed per row and round, i.e. the
acceptance along the text the cell generated) and `round_ms` (execution ms per program round: the cell's seconds
over its calls' rounds, a call's rounds being its longest row's; prefill shared pro rata). `round_vs_off` is off's
round_ms over on's, the switch's cost per round of the same program shape; `accept_vs_off` on's tokens_per_round
over off's. Without the switch most speculative rows generate other text than ar (rows_differ), so their acceptance
differs too: at batch 1, vs_off = accept_vs_off x round_vs_off. `same_text_rows` counts the requests that generate the
same tokens on both sides of the switch, and `accept_same_text_vs_off` is on's tokens per round over off's on those
requests alone (each request's own rounds): the switch's effect on acceptance along one text (the drafter reading
the exact path's features), apart from the text. Writes <out_dir>/<name>.json and .md (`--name`, default
exact_check).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax.numpy as jnp
from absl import flags
from tqdm import tqdm

from ddtree_jax.calibration import at_length
from ddtree_jax.errors import UserError, run_app
from experiments import common, workload

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("drafter", str(workload.SHIPPED_DRAFTER), "DFlash drafter checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("exact_modes", ["on", "off"], "settings of the exact switch to run, in order (on, off)")
flags.DEFINE_list("contexts", ["60", "1024"], "prompt lengths before the ragged cut")
flags.DEFINE_list("batches", ["1", "8", "32"], "batch sizes")
flags.DEFINE_list("budgets", ["4", "8", "16", "32", "64"], "DDTree budgets")
flags.DEFINE_integer("num_prompts", 32, "requests (a multiple of every batch size)")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per request (stop tokens ignored)")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and activations")
flags.DEFINE_integer("compile_workers", min(8, os.cpu_count() or 1), "threads compiling the programs up front")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")
flags.DEFINE_string("name", "exact_check", "record name: <out_dir>/<name>.json and .md")

COLUMNS = ["exact", "context", "batch", "method", "budget", "rows_differ", "first_divergence", "tokens_per_s"]
COLUMNS += ["vs_off", "tokens_per_round", "round_ms", "accept_vs_off", "round_vs_off", "same_text_rows"]
COLUMNS += ["accept_same_text_vs_off"]


def requests(gen, context: int) -> list[list[int]]:
    """`--num_prompts` held-out prompts of `context` tokens, request i cut i * 7 % 23 tokens short."""
    base, _ = workload.load_prompts(gen, FLAGS.prompts, FLAGS.num_prompts)
    rows = at_length(base, context, FLAGS.num_prompts)
    return [r[: len(r) - i * 7 % 23] for i, r in enumerate(rows)]


def first_divergence(ref: list[list[int]], out: list[list[int]]) -> int | None:
    """The earliest token index where any request leaves its reference (None: none does)."""
    found = [
        next(k for k in range(len(r) + 1) if k in (len(r), len(o)) or r[k] != o[k])
        for r, o in zip(ref, out, strict=True)
        if r != o
    ]
    return min(found) if found else None


class Rates(NamedTuple):
    """A cell's speed: tokens/s, tokens committed per row and round, execution ms per program round."""

    tokens_per_s: float
    tokens_per_round: float
    round_ms: float


class Outputs(NamedTuple):
    """A cell's requests: the tokens each generated and the rounds each took."""

    tokens: list[list[int]]
    rounds: list[int]


def run_cell(gen, rows: list[list[int]], batch: int, kw: dict) -> tuple[Outputs, Rates]:
    """(each request's tokens and rounds, the cell's Rates over the execution time) of the requests run `batch` at a
    time, after one warm-up call."""
    gen.generate(rows[:batch], **kw)
    out, wall, program_rounds = Outputs([], []), 0.0, 0
    for i in range(0, len(rows), batch):
        res = gen.generate(rows[i : i + batch], **kw)
        out.tokens.extend(res.tokens)
        out.rounds.extend(s["rounds"] for s in res.stats)
        wall += res.wall_s
        program_rounds += res.batch_rounds
    generated = sum(len(t) for t in out.tokens)
    return out, Rates(generated / wall, generated / sum(out.rounds), 1e3 * wall / program_rounds)


def same_text(on: Outputs, off: Outputs) -> tuple[int, float | None]:
    """(requests whose tokens are the same on both sides, on's tokens per round over off's on those requests; None
    where there are none)."""
    same = [i for i, (a, b) in enumerate(zip(on.tokens, off.tokens, strict=True)) if a == b]
    if not same:
        return 0, None
    return len(same), sum(off.rounds[i] for i in same) / sum(on.rounds[i] for i in same)


def main(_) -> None:
    from ddtree_jax.api import Generator

    batches = sorted(int(b) for b in FLAGS.batches)
    if batches[0] != 1 or any(FLAGS.num_prompts % b for b in batches):
        raise UserError(f"--batches {batches} must start at 1 and divide --num_prompts {FLAGS.num_prompts}")
    modes = {"on": True, "off": False}
    if bad := [m for m in FLAGS.exact_modes if m not in modes]:
        raise UserError(f"--exact_modes {bad}: each is on or off")
    gen = Generator.load(FLAGS.target, FLAGS.drafter, dtype=jnp.dtype(FLAGS.dtype))
    methods = [("ar", 1), ("dflash", gen.drafter.config.num_draft)] + [("ddtree", int(b)) for b in FLAGS.budgets]
    contexts = {int(c): requests(gen, int(c)) for c in FLAGS.contexts}
    kws = {
        (m, b): {"method": m, "budget": b, "max_new_tokens": FLAGS.max_new_tokens, "ignore_eos": True}
        for m, b in methods
    }
    meta = common.metadata()
    records, runs, on_records = [], {}, {}
    for mode in FLAGS.exact_modes:
        gen.exact = modes[mode]
        specs = [
            gen.spec_for(rows[:batch], temperature=0.0, **kw)
            for rows in contexts.values()
            for batch in batches
            for kw in kws.values()
        ]
        print(
            f"exact={mode}: compiled {len(set(specs))} programs in {gen.precompile(specs, FLAGS.compile_workers):.1f}s"
        )
        cells = [(c, b, mb) for c in contexts for b in batches for mb in methods]
        for context, batch, (method, budget) in tqdm(cells, desc=f"exact={mode}"):
            rows, cell = contexts[context], (context, batch, method, budget)
            out, rates = runs[mode, *cell] = run_cell(gen, rows, batch, kws[method, budget])
            tokens = out.tokens
            if (method, batch) == ("ar", 1):
                reference = tokens
            differ = sum(a != b for a, b in zip(reference, tokens, strict=True))
            record = {
                "exact": mode,
                "context": context,
                "batch": batch,
                "method": method,
                "budget": budget,
                "rows_differ": differ,
                "first_divergence": first_divergence(reference, tokens),
                **rates._asdict(),  # tokens_per_s, tokens_per_round, round_ms
                "vs_off": None,
                "accept_vs_off": None,
                "round_vs_off": None,
                "same_text_rows": None,
                "accept_same_text_vs_off": None,
                "requests": len(rows),
                "max_new_tokens": FLAGS.max_new_tokens,
                "dtype": FLAGS.dtype,
                "target": FLAGS.target,
                "drafter": FLAGS.drafter,
                **meta,
            }
            records.append(record)
            if mode == "on":
                on_records[cell] = record
            if ("on", *cell) in runs and ("off", *cell) in runs:  # either order of the modes: once both ran
                (on_out, on), (off_out, off) = runs["on", *cell], runs["off", *cell]
                r = on_records[cell]
                r["vs_off"] = on.tokens_per_s / off.tokens_per_s
                r["accept_vs_off"] = on.tokens_per_round / off.tokens_per_round
                r["round_vs_off"] = off.round_ms / on.round_ms
                r["same_text_rows"], r["accept_same_text_vs_off"] = same_text(on_out, off_out)
            common.write_results(FLAGS.name, records, COLUMNS, FLAGS.out_dir or None)
    print(common.markdown_table(records, COLUMNS))


if __name__ == "__main__":
    run_app(main)
