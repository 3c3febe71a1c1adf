"""Measure a cost table (`cost_table.CostTable`) with a Generator: the round and call times of every candidate
program at every (batch, context) of a grid, and each candidate's acceptance.

At each grid point the rows are `batch` prompts of `context` tokens cut from the held-out prompts' token stream
(`at_length`). A candidate's call time there is the wall of a 1-token run (the prefill and whatever else a run pays
once), its round time (wall of a run to max_new_tokens - that wall) / the rounds its mean row took, the walls being
medians of `repeats` runs. A batch runs until its slowest row is done, so the round time is longer than one loop
iteration by the straggler's margin at that batch size, and call + rounds x round time is the batch's real time
(`CostTable.choose`) (compilation excluded; every program is compiled up front, the candidates' runs interleaved so
drift falls on all alike; stop tokens ignored, so every row runs max_new_tokens). Its acceptance at a context is
the tokens it committed per round at temperature 0 over untimed runs at every grid batch, at least
`ACCEPTANCE_ROWS` rows per grid point (batches of that point's size cut further along the stream; fewer when the
prompts are fewer), pooled over the batches: a row's acceptance follows its text and context, not the batch it
shares, so pooling only adds rows (the table holds it at every batch of that context).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from absl import logging
from tqdm import tqdm

from ddtree_jax.cost_table import Candidate, CostTable

if TYPE_CHECKING:
    from ddtree_jax.api import Generator

MIN_ROUND_MS = 1e-3  # a round time lost in timing noise (wall difference <= 0) is recorded as 1 us
ACCEPTANCE_ROWS = 16  # rows per grid point whose acceptance is measured (at most one per distinct prompt)


def at_length(prompts: Sequence[Sequence[int]], length: int, n: int) -> list[list[int]]:
    """`n` prompts of exactly `length` tokens cut from `prompts` concatenated (and repeated as needed): row i starts
    where prompt i % len(prompts) starts, so short lengths give each prompt's own opening."""
    stream = [t for p in prompts for t in p]
    starts = np.cumsum([0] + [len(p) for p in prompts[:-1]])
    long = stream * (2 + length // len(stream))
    return [long[starts[i % len(prompts)] :][:length] for i in range(n)]


def measure(
    gen: Generator,
    prompts: Sequence[Sequence[int]],
    *,
    candidates: Sequence[Candidate],
    batches: Sequence[int],
    contexts: Sequence[int],
    max_new_tokens: int,
    repeats: int,
    compile_workers: int,
    target: str,
    drafter: str,
    progress: str | None = None,
) -> CostTable:
    """The cost table of `candidates` on `gen` over batches x contexts (each sorted), rows cut from `prompts` (token
    ids; held-out text), runs of max_new_tokens (>= 2) against 1-token runs. `target` / `drafter` name the
    checkpoints in the table. `progress`: the description of a progress bar advancing once per (grid point,
    candidate); None: no bar."""
    if gen.drafter is None and any(c.method != "ar" for c in candidates):
        raise ValueError("candidates other than ar need the Generator's drafter")
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 (a round past the prefill), got {max_new_tokens}")
    batches, contexts = sorted(set(batches)), sorted(set(contexts))
    runs = {
        c.name: {n: {"method": c.method, "budget": c.spec_budget, "max_new_tokens": n} for n in (max_new_tokens, 1)}
        for c in candidates
    }
    settings = {"temperature": 0.0, "ignore_eos": True}
    grid = {(b, ctx): at_length(prompts, ctx, b) for b in batches for ctx in contexts}
    specs = [gen.spec_for(rows, **kw, **settings) for rows in grid.values() for r in runs.values() for kw in r.values()]
    bar = tqdm(total=len(grid) * len(runs), desc=progress, disable=progress is None, dynamic_ncols=True)
    bar.set_postfix_str(f"compiling {len(set(specs))} programs")
    gen.precompile(specs, compile_workers)
    round_ms = {c.name: np.zeros((len(batches), len(contexts))) for c in candidates}
    call_ms = {c.name: np.zeros((len(batches), len(contexts))) for c in candidates}
    committed = {c.name: np.zeros(len(contexts)) for c in candidates}  # per context, over every batch's runs
    rounds = {c.name: np.zeros(len(contexts), dtype=np.int64) for c in candidates}
    for (b, ctx), rows in grid.items():
        extra = at_length(prompts, ctx, b * -(-min(ACCEPTANCE_ROWS, len(prompts)) // b))[b:]  # after `rows`
        at = batches.index(b), contexts.index(ctx)
        iterations = {}
        for name, r in runs.items():  # warm-up; the acceptance comes from these runs
            gen.generate(rows, **r[1], **settings)
            for i, batch in enumerate([rows] + [extra[j : j + b] for j in range(0, len(extra), b)]):
                res = gen.generate(batch, **r[max_new_tokens], **settings)
                if i == 0:
                    iterations[name] = sum(st["rounds"] for st in res.stats) / len(res.stats)  # the mean row's
                committed[name][at[1]] += sum(st["tokens_per_round"] * st["rounds"] for st in res.stats)
                rounds[name][at[1]] += sum(st["rounds"] for st in res.stats)
        walls = {name: {n: [] for n in r} for name, r in runs.items()}
        for _ in range(repeats):
            for name, r in runs.items():
                for n, kw in r.items():
                    walls[name][n].append(gen.generate(rows, **kw, **settings).wall_s)
        for name, w in walls.items():
            call = statistics.median(w[1])
            ms = (statistics.median(w[max_new_tokens]) - call) * 1e3 / max(iterations[name], 1.0)
            if ms < MIN_ROUND_MS:
                logging.warning("%s at batch %d, context %d: round time %.4f ms lost in noise", name, b, ctx, ms)
            round_ms[name][at] = max(ms, MIN_ROUND_MS)
            call_ms[name][at] = max(call * 1e3, MIN_ROUND_MS)
            bar.set_postfix_str(f"batch {b}, context {ctx}")
            bar.update()
    bar.close()
    accepted = {n: np.where(r > 0, committed[n] / np.maximum(r, 1), 1.0) for n, r in rounds.items()}  # per context
    return CostTable(
        **gen.device_identity(),
        jax_version=jax.__version__,
        target=target,
        drafter=drafter,
        batches=tuple(batches),
        contexts=tuple(contexts),
        round_ms=round_ms,  # `[batches][contexts]` arrays: CostTable holds them as nested tuples of floats
        call_ms=call_ms,
        tokens_per_round={c.name: 1.0 if c.method == "ar" else [accepted[c.name]] * len(batches) for c in candidates},
        acceptance_rounds=max(1, min((int(rounds[c.name].sum()) for c in candidates if c.method != "ar"), default=1)),
        settings={"max_new_tokens": max_new_tokens, "repeats": repeats, "kernels": repr(specs[0].kernels)},
    )
