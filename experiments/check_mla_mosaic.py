"""GPU check of the Mosaic GPU MLA kernel (`pallas_kernels/mla_mosaic.py`): correctness, then timings.

1. Correctness: ragged prefixes and random trees, kernel output vs `mla_attention_reference` on f32 copies of the
   bf16 inputs; prints ||out - ref|| / ||ref|| per case and exits nonzero if any exceeds --tol.
2. Timings (median of --repeats calls after --warmup, each blocked on; dispatch included) of the Mosaic kernel,
   the Pallas-Triton kernel (`mla_attention_pallas`, default tiling) and the jitted reference on the cells
   (context, nodes, batch, heads); a cell that fails is printed and skipped. No new cell starts after --budget_s.
   Cache length = context + nodes rounded up to 64 (prefix_len = context), so no path pads the cache.
   bytes = B * ((context + N) * 576 + N * Hq * (576 + 512)) * 2, FLOPs = 2 * B * N * Hq * (context + N) * 1088
   (experiments/notes_mla.md). Prints a markdown table; writes check_mla_mosaic.{json,md} to --out_dir.

    python3 -m experiments.check_mla_mosaic --out_dir=/tmp/mla_mosaic
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from ddtree_jax.errors import run_app
from experiments import common  # noqa: E402
from experiments.mla_common import DK, DV, SCALE, cost, random_tree_mask, rel_err  # noqa: E402
from pallas_kernels.mla_attention import mla_attention_pallas  # noqa: E402
from pallas_kernels.mla_mosaic import mla_attention_mosaic  # noqa: E402
from pallas_kernels.mla_mosaic_config import default_config  # noqa: E402
from pallas_kernels.reference import mla_attention_reference  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", None, "results directory (default experiments/results)")
flags.DEFINE_float("tol", 2e-2, "largest accepted relative error")
flags.DEFINE_integer("warmup", 3, "untimed calls per path")
flags.DEFINE_integer("repeats", 20, "timed calls per path")
flags.DEFINE_float("budget_s", 120.0, "start no new timing cell after this many seconds")
flags.DEFINE_bool("skip_timing", False, "correctness only")
flags.DEFINE_bool("checks", True, "run the correctness cases first (the exit status says whether they passed)")

# (context, nodes, batch, heads)
CELLS = [
    (4096, 1, 8, 64),
    (8192, 1, 32, 64),
    (8192, 17, 8, 64),
    (8192, 33, 8, 64),
    (8192, 17, 8, 8),
    (32768, 1, 8, 64),
    (8192, 17, 1, 64),
    (60, 1, 1, 64),
]  # the bar cells first
# (cache length, nodes, batch, heads, prefix lengths): ragged prefixes incl. 0, mid-tile and the cache end.
CHECKS = [
    (4160, 1, 4, 64, [0, 100, 2047, 4159]),
    (1000, 17, 3, 64, [0, 333, 983]),
    (520, 33, 2, 8, [64, 487]),
    (64, 5, 2, 16, [0, 59]),
]


def make_inputs(rng: np.random.Generator, length: int, n: int, batch: int, heads: int):
    """Random bf16 q `[B, N, Hq, 576]`, cache `[B, length, 576]` (generated on the device) and a tree mask."""
    key_q, key_c = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    q = jax.random.normal(key_q, (batch, n, heads, DK), jnp.bfloat16)
    cache = jax.random.normal(key_c, (batch, length, DK), jnp.bfloat16)
    return q, cache, jnp.asarray(random_tree_mask(rng, batch, n))


def check(rng: np.random.Generator) -> list[dict[str, Any]]:
    """Mosaic kernel vs the f32 reference on the CHECKS cases; one record per case."""
    records = []
    for length, n, batch, heads, prefix in CHECKS:
        rec: dict[str, Any] = {"length": length, "nodes": n, "batch": batch, "heads": heads, "prefix": str(prefix)}
        try:
            q, cache, mask = make_inputs(rng, length, n, batch, heads)
            prefix_len = jnp.asarray(prefix, jnp.int32)
            out = mla_attention_mosaic(q, cache, prefix_len, mask, SCALE, DV)
            with jax.default_matmul_precision("highest"):
                ref = mla_attention_reference(
                    q.astype(jnp.float32), cache.astype(jnp.float32), prefix_len, mask, SCALE, DV
                )
            rec["rel_err"] = rel_err(out, ref)
        except Exception as e:  # noqa: BLE001 (report and continue)
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
            rec["rel_err"] = float("nan")
        rec["ok"] = bool(rec["rel_err"] <= FLAGS.tol)
        print(f"check {rec}", flush=True)
        records.append(rec)
    return records


def time_us(fn: Callable[..., jax.Array], args: Sequence[Any]) -> float:
    return common.time_fn(lambda: fn(*args), warmup=FLAGS.warmup, repeats=FLAGS.repeats) * 1e6


def bench_cell(rng: np.random.Generator, context: int, n: int, batch: int, heads: int) -> dict[str, Any]:
    """Times of the three paths on one cell (a path that fails records its error and NaN)."""
    length = -(-(context + n) // 64) * 64
    q, cache, mask = make_inputs(rng, length, n, batch, heads)
    prefix = jnp.full((batch,), context, jnp.int32)
    nbytes, flops = cost(context, n, batch, heads)
    config = default_config(batch, n * heads, length)
    rec: dict[str, Any] = {"context": context, "nodes": n, "batch": batch, "heads": heads}
    rec["splits"] = config.num_splits
    paths = {
        "mosaic": jax.jit(lambda *a: mla_attention_mosaic(*a, SCALE, DV)),
        "triton": jax.jit(lambda *a: mla_attention_pallas(*a, SCALE, DV)),
        "ref": jax.jit(lambda *a: mla_attention_reference(*a, SCALE, DV)),
    }
    for name, fn in paths.items():
        try:
            rec[f"{name}_us"] = time_us(fn, (q, cache, prefix, mask))
        except Exception as e:  # noqa: BLE001 (report and continue)
            traceback.print_exc()
            rec[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            rec[f"{name}_us"] = float("nan")
    t = rec["mosaic_us"] * 1e-6
    rec["mosaic_TB/s"] = nbytes / t / 1e12
    rec["mosaic_TFLOP/s"] = flops / t / 1e12
    rec["triton_TFLOP/s"] = flops / (rec["triton_us"] * 1e-6) / 1e12
    rec["vs_triton"] = rec["triton_us"] / rec["mosaic_us"]
    rec["vs_ref"] = rec["ref_us"] / rec["mosaic_us"]
    return rec


COLUMNS = [
    "context",
    "nodes",
    "batch",
    "heads",
    "splits",
    "mosaic_us",
    "triton_us",
    "ref_us",
    "mosaic_TB/s",
    "mosaic_TFLOP/s",
    "triton_TFLOP/s",
    "vs_triton",
    "vs_ref",
]


def main(argv: Sequence[str]) -> None:
    del argv
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0]}", flush=True)
    checks = check(rng) if FLAGS.checks else []
    records = []
    for cell in [] if FLAGS.skip_timing else CELLS:
        if time.perf_counter() - start > FLAGS.budget_s:
            print(f"budget of {FLAGS.budget_s} s spent: skipping cell {cell}", flush=True)
            continue
        try:
            records.append(bench_cell(rng, *cell))
        except Exception:  # noqa: BLE001 (report and continue)
            traceback.print_exc()
            continue
        print(f"cell {records[-1]} ({time.perf_counter() - start:.0f} s)", flush=True)
    path = common.write_results(
        "check_mla_mosaic", records, COLUMNS, FLAGS.out_dir, extra={"checks": checks, "tol": FLAGS.tol}
    )
    print(common.markdown_table(checks, ["length", "nodes", "batch", "heads", "prefix", "rel_err", "ok"]))
    print()
    print(common.markdown_table(records, COLUMNS))
    print(f"\nwrote {path} in {time.perf_counter() - start:.0f} s")
    if not all(c["ok"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    run_app(main)
