"""`ddtree-inspect --target=DIR`: model sizes from a checkpoint's config.json alone, printed as JSON.

Keys: total_params, active_params_per_token, weight_bytes, kv_cache_bytes_per_token, decode_bytes_per_token,
decode_fixed_bytes, expert_bytes (see `ddtree_jax.sizing.model_sizes`). No weight file is opened.

With --batch_size and --max_len it adds "plan": the per-device memory plan `ddtree-generate` checks before
loading (`ddtree_jax.memory.plan`, for --method/--budget/--mesh, the drafter of --drafter); with --device_gb
also whether it fits that much memory, the largest batch at --max_len and the longest context at --batch_size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from absl import flags

from ddtree_jax import memory
from ddtree_jax.config import check_pair, load_dflash_config, load_kimi_config
from ddtree_jax.errors import UserError, run_app
from ddtree_jax.sizing import model_sizes

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target checkpoint directory (or its config.json).")
flags.DEFINE_string("drafter", None, "DFlash drafter checkpoint directory (counted for dflash / ddtree plans).")
flags.DEFINE_integer("batch_size", None, "Batch for the memory plan (with --max_len).")
flags.DEFINE_integer("max_len", None, "Context (prompt + new tokens) for the memory plan (with --batch_size).")
flags.DEFINE_integer("prompt_len", None, "Prompt length the plan's prefill runs over; default: all of --max_len.")
flags.DEFINE_enum("method", "ddtree", ["ar", "dflash", "ddtree"], "Decoding method of the plan.")
flags.DEFINE_integer("budget", 16, "DDTree node budget of the plan.")
flags.DEFINE_string("mesh", None, 'Mesh of the plan, e.g. "expert=8"; default: one device.')
flags.DEFINE_float("device_gb", None, "Free memory per device (GB) to check the plan against.")
flags.mark_flag_as_required("target")


def memory_report() -> dict:
    """The "plan" entry: `memory.plan(...).to_dict()`, plus fits / largest_batch / longest_context for
    --device_gb."""
    if FLAGS.batch_size is None or FLAGS.max_len is None:
        raise UserError("--batch_size and --max_len go together")
    if FLAGS.batch_size < 1 or FLAGS.max_len < 1 or FLAGS.budget < 1:
        raise UserError("--batch_size, --max_len and --budget must be >= 1")
    if FLAGS.method != "ar" and not FLAGS.drafter:
        raise UserError(f"--method={FLAGS.method} needs --drafter")
    target = load_kimi_config(FLAGS.target)
    drafter = load_dflash_config(FLAGS.drafter) if FLAGS.drafter else None
    if drafter is not None:
        check_pair(target, drafter)
    kw = {
        "method": FLAGS.method,
        "budget": FLAGS.budget,
        "layout": memory.Layout.from_spec(FLAGS.mesh) if FLAGS.mesh else memory.Layout(),
    }
    p = memory.plan(target, drafter, batch=FLAGS.batch_size, max_len=FLAGS.max_len, prompt_len=FLAGS.prompt_len, **kw)
    report = p.to_dict()
    if FLAGS.device_gb is not None:
        free = int(FLAGS.device_gb * memory.GB)
        report |= {
            "device_bytes": free,
            "fits": memory.fits(p, free),
            "largest_batch": memory.largest_batch(
                target, drafter, free, max_len=FLAGS.max_len, prompt_len=FLAGS.prompt_len, **kw
            ),
            "longest_context": memory.longest_context(
                target, drafter, free, limit=target.max_position_embeddings, batch=FLAGS.batch_size, **kw
            ),
        }
    return report


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    out = model_sizes(load_kimi_config(FLAGS.target))
    if FLAGS.batch_size is not None or FLAGS.max_len is not None:
        out["plan"] = memory_report()
    print(json.dumps(out, indent=2))


def run() -> None:
    run_app(main)


if __name__ == "__main__":
    run()
