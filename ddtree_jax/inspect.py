"""`ddtree-inspect --target=DIR`: model sizes from a checkpoint's config.json alone, printed as JSON on stdout,
and the same in human units (GB, T params) on stderr.

--target / --drafter are directories (or a config.json) or Hugging Face model ids (only config.json is fetched).
JSON keys: total_params, active_params_per_token, weight_bytes, kv_cache_bytes_per_token, decode_bytes_per_token,
decode_fixed_bytes, expert_bytes (see `ddtree_jax.sizing.model_sizes`). No weight file is opened.

With --batch_size and --max_len it adds "plan": the per-device memory plan `ddtree-generate` checks before
loading (`ddtree_jax.memory.plan`, for --method/--budget/--mesh, the drafter of --drafter); with --device_gb also
whether it fits that much memory, the largest batch at --max_len and the longest context at --batch_size.
--method=auto (the default) plans for the candidate that needs the most memory (`cost_table.largest`) among those of
the calibration.json beside a local --drafter, else among ddtree-calibrate's default candidates; without --drafter
auto is `ar`.

"machine" (--machine, the default) describes this machine's devices and whether that plan (or, without
--batch_size/--max_len, batch 1 at a context of min(8192, the model's)) fits them, with the --mesh and the
XLA_PYTHON_CLIENT_MEM_FRACTION it needs (`ddtree_jax.machine.advise`). The plan is for the exact numerics' programs
where ddtree-generate runs them by default on this machine (one GPU, no --mesh); --exact / --noexact choose.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from absl import flags

from ddtree_jax import cost_table, engine, machine, memory
from ddtree_jax.config import DFlashConfig, KimiConfig, check_pair, load_dflash_config, load_kimi_config
from ddtree_jax.errors import UserError, run_app
from ddtree_jax.hub import resolve_checkpoint
from ddtree_jax.sizing import model_sizes

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target checkpoint: a directory (or its config.json) or a Hugging Face model id.")
flags.DEFINE_string(
    "drafter", None, "DFlash drafter checkpoint, a directory or a Hugging Face model id (for dflash / ddtree plans)."
)
flags.DEFINE_integer("batch_size", None, "Batch for the memory plan (with --max_len).")
flags.DEFINE_integer("max_len", None, "Context (prompt + new tokens) for the memory plan (with --batch_size).")
flags.DEFINE_integer("prompt_len", None, "Prompt length the plan's prefill runs over; default: all of --max_len.")
flags.DEFINE_enum(
    "method",
    "auto",
    ["auto", "ar", "dflash", "ddtree"],
    "Decoding method of the plan; auto: its largest candidate (ar without --drafter).",
)
flags.DEFINE_integer("budget", engine.DEFAULT_BUDGET, "DDTree node budget of the plan (--method=ddtree).")
flags.DEFINE_string("mesh", None, 'Mesh of the plan, e.g. "expert=8"; default: one device.')
flags.DEFINE_bool(
    "exact",
    None,
    "Plan for the exact numerics (one device): their prefill and MLA partials. Default: as ddtree-generate runs on "
    "this machine (on for one GPU without --mesh; off on a CPU).",
)
flags.DEFINE_float("device_gb", None, "Free memory per device (GB) to check the plan against.")
flags.DEFINE_bool("machine", True, "Check the plan against this machine's devices (count, kind, memory).")
flags.mark_flag_as_required("target")

MACHINE_CONTEXT = 8192  # the context of the machine check when no --max_len is given


class Planned(NamedTuple):
    """The program the plan is for, and why when --method alone does not say it."""

    method: str
    budget: int
    note: str | None


def planned_exact() -> bool:
    """Whether the plan is for the exact numerics: --exact, else what ddtree-generate runs here by default (on for
    one GPU without --mesh, in its default bf16; off on a CPU, with a --mesh or on several GPUs, which get a mesh)."""
    if FLAGS.exact is not None:
        return FLAGS.exact
    import jax

    from ddtree_jax.api import default_dtype, exact_by_default

    return exact_by_default(not FLAGS.mesh and jax.device_count() == 1, default_dtype())


def check_method() -> None:
    """--method and --budget that cannot go together, before anything is read; raises `UserError`."""
    if FLAGS.method in ("dflash", "ddtree") and not FLAGS.drafter:
        raise UserError(f"--method={FLAGS.method} needs --drafter")
    if FLAGS.method == "auto" and FLAGS["budget"].present:
        raise UserError("--method=auto chooses the budget: pass --budget with --method=ddtree")
    if FLAGS.exact and FLAGS.mesh:
        raise UserError("--exact runs on one device: drop --mesh")


def planned(drafter_path: Path | None, drafter: DFlashConfig | None) -> Planned:
    """--method at --budget; auto: `ar` without a drafter, else the candidate needing the most memory among the
    drafter's calibration.json (drafter_path: its directory or config.json), else ddtree-calibrate's defaults."""
    if FLAGS.method != "auto":
        return Planned(FLAGS.method, FLAGS.budget, None)
    if drafter is None:
        return Planned("ar", FLAGS.budget, "--method=auto without --drafter is ar")
    table = (drafter_path.parent if drafter_path.is_file() else drafter_path) / cost_table.FILE_NAME
    if table.is_file():
        candidates, source = cost_table.CostTable.load(table).candidates, str(table)
    else:
        candidates, source = tuple(map(cost_table.Candidate.parse, cost_table.DEFAULT_CANDIDATES)), "default"
    top = cost_table.largest(candidates, drafter.num_draft)
    note = f"--method=auto: planned for its largest candidate, {top.name} ({source} candidates)"
    return Planned(top.method, top.spec_budget, note)


def memory_report(target: KimiConfig, drafter: DFlashConfig | None, program: Planned) -> dict:
    """The "plan" entry: `memory.plan(...).to_dict()`, plus fits / largest_batch / longest_context for
    --device_gb."""
    kw = {
        "method": program.method,
        "budget": program.budget,
        "layout": memory.Layout.from_spec(FLAGS.mesh) if FLAGS.mesh else memory.Layout(),
        "exact": planned_exact(),
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


def machine_report(target: KimiConfig, drafter: DFlashConfig | None, program: Planned) -> dict[str, Any]:
    """The "machine" entry (`machine.report`) for the plan's run, or batch 1 at MACHINE_CONTEXT when no plan
    was asked for."""
    max_len = FLAGS.max_len or min(MACHINE_CONTEXT, target.max_position_embeddings)
    run = {"batch": FLAGS.batch_size or 1, "max_len": max_len, "prompt_len": FLAGS.prompt_len}
    run |= {"method": program.method, "budget": program.budget, "exact": planned_exact()}
    return machine.report(machine.local_devices(), target, drafter, mesh=FLAGS.mesh, **run)


# ---- human units ---------------------------------------------------------------------------------------------


def fmt_count(n: float) -> str:
    """1.0264e12 -> "1.03 T", 3.17e10 -> "31.7 B", 2.1e7 -> "21 M": three significant digits, decimal units."""
    unit, scale = next(((u, s) for u, s in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= s), ("", 1))
    return f"{n / scale:.3g} {unit}".rstrip()


def sizes_text(sizes: dict[str, int]) -> list[str]:
    b = memory.fmt_bytes
    return [
        f"parameters      {fmt_count(sizes['total_params'])} params, {fmt_count(sizes['active_params_per_token'])} "
        "active per token",
        f"weights         {b(sizes['weight_bytes'])} as stored (one routed expert {b(sizes['expert_bytes'])})",
        f"KV cache        {b(sizes['kv_cache_bytes_per_token'])} per token",
        f"decode reads    {b(sizes['decode_bytes_per_token'])} of weights per step at batch 1 "
        f"({b(sizes['decode_fixed_bytes'])} besides the routed experts)",
    ]


def plan_text(plan: dict[str, Any]) -> list[str]:
    b = memory.fmt_bytes
    method = plan["method"] if plan["method"] != "ddtree" else f"ddtree budget {plan['budget']}"
    method += ", exact" if plan["exact"] else ""
    mesh = machine.mesh_spec(memory.Layout(**plan["layout"]))
    lines = [
        f"plan            batch {plan['batch']} x {plan['max_len']} tokens ({method}, --mesh={mesh}): "
        f"{b(plan['total_bytes'])} per device",
        f"                weights {b(plan['weight_bytes'])}, target cache {b(plan['target_cache'])}, drafter cache "
        f"{b(plan['drafter_cache'])}, workspace {b(max(plan['workspace'].values()))}",
    ]
    if "fits" in plan:
        lines.append(
            f"                {'fits' if plan['fits'] else 'does not fit'} {b(plan['device_bytes'])}: largest batch "
            f"{plan['largest_batch']} at this context, longest context {plan['longest_context']} at this batch"
        )
    return lines


def human_summary(out: dict[str, Any], note: str | None) -> str:
    lines = sizes_text(out)
    if "plan" in out:
        lines += plan_text(out["plan"])
        if note is not None:
            lines.append(f"                {note}")
    if "machine" in out:
        lines += machine.report_text(out["machine"])
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    if (FLAGS.batch_size is None) != (FLAGS.max_len is None):
        raise UserError("--batch_size and --max_len go together")
    if any(v is not None and v < 1 for v in (FLAGS.batch_size, FLAGS.max_len)) or FLAGS.budget < 1:
        raise UserError("--batch_size, --max_len and --budget must be >= 1")
    check_method()
    target = load_kimi_config(resolve_checkpoint(FLAGS.target, ("config.json",)))
    drafter_path = resolve_checkpoint(FLAGS.drafter, ("config.json",)) if FLAGS.drafter else None
    drafter = load_dflash_config(drafter_path) if drafter_path else None
    if drafter is not None:
        check_pair(target, drafter)
    program = planned(drafter_path, drafter)
    out: dict[str, Any] = model_sizes(target)
    if FLAGS.batch_size is not None:
        out["plan"] = memory_report(target, drafter, program)
    if FLAGS.machine:
        out["machine"] = machine_report(target, drafter, program)
    print(json.dumps(out, indent=2))
    print(human_summary(out, program.note), file=sys.stderr)


def run() -> None:
    run_app(main)


if __name__ == "__main__":
    run()
