"""Memory plan of Kimi K2.6 + the K2.5 DFlash drafter on 8 H200s (141 GB each, --mesh=expert=8): the largest
concurrency at contexts 8K, 32K and 128K for ddtree (budget 16) and ar. Config arithmetic only (no device).

    python -m experiments.memory_plan [--configs=DIR] [--device_gb=141]

Two columns per row: `batch_full_prompt`, the prompt fills the context (today's engine prefills it in one
shot with per-head attention, whose `[B, 64, P, P]` f32 scores dominate), and `batch_decode_bound`, a 1-token
prompt (what the caches and the per-round workspace alone allow: the ceiling for a chunked prefill). Writes
experiments/results/memory_plan.{json,md}.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from absl import flags

from ddtree_jax import memory
from ddtree_jax.config import load_dflash_config, load_kimi_config
from ddtree_jax.errors import run_app
from experiments.common import RELEASED_CONFIGS, markdown_table, write_results

FLAGS = flags.FLAGS
flags.DEFINE_string("configs", str(RELEASED_CONFIGS), "Holds kimi-k2.6/ and kimi-k2.5-dflash/.")
flags.DEFINE_float("device_gb", 141.0, "Memory per device, GB.")
flags.DEFINE_string("mesh", "expert=8", "Mesh layout of the plan.")

CONTEXTS = (8192, 32768, 131072)
METHODS = (("ddtree", 16), ("ar", 16))
COLUMNS = (
    "context",
    "method",
    "weights_gb",
    "cache_gb_per_row",
    "batch_full_prompt",
    "batch_decode_bound",
    "total_gb_at_decode_bound",
)


def rows(configs: Path, device_gb: float, mesh: str) -> list[dict]:
    target = load_kimi_config(configs / "kimi-k2.6")
    drafter = load_dflash_config(configs / "kimi-k2.5-dflash")
    free = int(device_gb * memory.GB)
    layout = memory.Layout.from_spec(mesh)
    out = []
    for context in CONTEXTS:
        for method, budget in METHODS:
            kw = {"max_len": context, "method": method, "budget": budget, "layout": layout}
            one = memory.plan(target, drafter, batch=1, **kw)
            full = memory.largest_batch(target, drafter, free, **kw)
            bound = memory.largest_batch(target, drafter, free, prompt_len=1, **kw)
            at_bound = memory.plan(target, drafter, batch=max(bound, 1), prompt_len=1, **kw)
            out.append(
                {
                    "context": context,
                    "method": f"{method} (budget {budget})" if method == "ddtree" else method,
                    "weights_gb": sum(one.weights.values()) / memory.GB,
                    "cache_gb_per_row": (one.target_cache + one.drafter_cache) / memory.GB,
                    "batch_full_prompt": full,
                    "batch_decode_bound": bound,
                    "total_gb_at_decode_bound": at_bound.total / memory.GB,
                }
            )
    return out


def main(argv: Sequence[str]) -> None:
    del argv
    records = rows(Path(FLAGS.configs), FLAGS.device_gb, FLAGS.mesh)
    print(markdown_table(records, COLUMNS))
    extra = {"device_gb": FLAGS.device_gb, "mesh": FLAGS.mesh, "model": "kimi-k2.6 + kimi-k2.5-dflash"}
    print(write_results("memory_plan", records, COLUMNS, extra=extra))


if __name__ == "__main__":
    run_app(main)
