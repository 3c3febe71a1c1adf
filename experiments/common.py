"""Shared plumbing for experiment scripts: run metadata, timing, and writing JSON + markdown results."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import flags
from tqdm import tqdm

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The released Kimi K2.6 / K2-Thinking / K2.5-DFlash config.json files (provenance: configs/README.md).
RELEASED_CONFIGS = Path(__file__).resolve().parent / "configs"


def git_commit() -> str:
    """The commit being measured: $DDTREE_COMMIT (set when the tree travels without .git), else git HEAD."""
    if os.environ.get("DDTREE_COMMIT"):
        return os.environ["DDTREE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def metadata() -> dict[str, Any]:
    """Device, jax version, commit, UTC date and the DDTREE_KERNELS selection for a result record."""
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "backend": jax.default_backend(),
        "num_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernels": os.environ.get("DDTREE_KERNELS", "auto"),
    }


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 10,
    stat: Callable[[list[float]], float] = statistics.median,
) -> float:
    """`stat` (default the median) of the wall times in seconds of `repeats` calls of `fn()` (outputs blocked on),
    after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return stat(times)


def time_interleaved(gen, batches: list, kws: list[dict], repeats: int, bar: tqdm) -> list[tuple]:
    """Every generation setting of `kws` (keywords of `gen.generate`) on the same batches, timed interleaved: each
    batch of each setting runs once untimed, then `repeats` rounds each run every (setting, batch) once in turn, so
    drift during the run (clocks, heat, a neighbour on the host) falls on all settings alike. `bar` advances by
    len(kws) + repeats.
    -> per setting, in order: (its untimed results, one per batch; the median wall time of each batch)."""
    firsts = []
    for kw in kws:
        bar.set_postfix_str(f"{kw.get('method')} b={kw.get('budget')} warm-up")
        firsts.append([gen.generate(batch, **kw) for batch in batches])
        bar.update()
    times = [[[] for _ in batches] for _ in kws]
    for r in range(repeats):
        bar.set_postfix_str(f"round {r + 1}/{repeats}")
        for i, kw in enumerate(kws):
            for j, batch in enumerate(batches):
                times[i][j].append(gen.generate(batch, **kw).wall_s)
        bar.update()
    return [(first, [statistics.median(t) for t in ts]) for first, ts in zip(firsts, times, strict=True)]


def cell_stats(gen, firsts: list, medians: list[float]) -> dict:
    """One cell from its untimed `gen.generate` results (outputs, acceptance; one per batch) and the median wall time
    of each batch (`time_interleaved`'s pair) -> its stats and generated rows. compile_s: the seconds its program took
    to compile (overlapping others when several compile at once)."""
    rows, per_request, committed, rounds, hist = [], [], 0, 0, None
    for first, med in zip(firsts, medians, strict=True):
        rows += first.tokens
        per_request += [len(t) / med for t in first.tokens]
        for st in first.stats:
            committed += st["tokens_per_round"] * st["rounds"]
            rounds += st["rounds"]
            h = np.asarray(st["accept_hist"])
            hist = h if hist is None else hist + h
    wall, tokens = sum(medians), sum(len(t) for t in rows)
    return {
        "wall_s": wall,
        "compile_s": sum(gen.compile_seconds[sp] for sp in {f.spec for f in firsts}),
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "tokens_per_s_per_request": float(np.mean(per_request)),
        "tokens_per_round": committed / rounds if rounds else 0.0,
        "accept_hist": hist.tolist(),
        "rows": rows,
    }


def time_back_to_back(call, warmup: int, steps: int) -> float:
    """Mean seconds per `call()` dispatched `steps` times without waiting in between, as a program's rounds run (a
    call timed alone would add a host round trip that the rounds do not pay)."""
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(call())
    t0 = time.perf_counter()
    jax.block_until_ready([call() for _ in range(steps)])
    return (time.perf_counter() - t0) / steps


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    records: Sequence[dict[str, Any]],
    columns: Sequence[str],
    out_dir: str | Path | None = None,
    extra: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write `<name>.json` (metadata + records) and `<name>.md` (metadata line + table); returns the JSON path.
    `meta` (default: this run's `metadata()`) names where the records were measured."""
    out = Path(out_dir) if out_dir else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    meta = meta or metadata()
    payload = {"meta": meta, **(extra or {}), "records": list(records)}
    json_path = out / f"{name}.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=float))
    tmp.replace(json_path)
    head = ", ".join(f"{k}: {v}" for k, v in meta.items())
    (out / f"{name}.md").write_text(f"# {name}\n\n{head}\n\n{markdown_table(records, columns)}\n")
    return json_path


def define_projections_flag() -> None:
    """--projections: where the drafter's Pallas attention block computes its Q/K/V projections (an experiment's
    setting, not a product knob; `use_projections` applies it)."""
    flags.DEFINE_enum(
        "projections",
        "auto",
        ["auto", "xla"],
        "the Pallas drafter block's Q/K/V projections: as the kernel decides (in the kernel up to "
        "PROJECT_MAX_BYTES), or in XLA whatever their size",
    )


def use_projections(setting: str) -> None:
    """Apply --projections before any program is traced: "xla" makes every drafter block project in XLA."""
    from pallas_kernels import drafter_attention

    if setting == "xla":
        drafter_attention.PROJECT_MAX_BYTES = 0
