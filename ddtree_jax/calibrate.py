"""`ddtree-calibrate`: measure the cost table that `--method=auto` chooses by, and write it beside the drafter.

    ddtree-calibrate --target=K2.6 --drafter=K2.6-DFlash --prompts=held_out.jsonl

For every candidate program (--candidates: ar, the DFlash chain, DDTree at node budgets) at every batch size
(--batches) and context (--contexts, prompts of that many tokens cut from the --prompts file's token stream): the
call time, the wall of a 1-token run, and the round time, (wall of a --max_new_tokens run - the call time) / rounds,
medians of --repeats runs with compilation excluded; and each candidate's acceptance (tokens committed per round) at
temperature 0 over runs of at least 16 rows per grid point (as many as there are prompts, when fewer).
Contexts past the pair's position limit (with --max_new_tokens and the draft slots) are lowered to it.

The table goes to calibration.json in the --drafter directory (or --output), written once at the end; an existing
table is replaced only with --overwrite. It names the device kind and count and the dtype, and `auto` refuses it
elsewhere. Bad input is a one-line `error:` with exit code 2, and nothing is written.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from absl import flags, logging

from ddtree_jax import cost_table, memory
from ddtree_jax.config import check_pair, load_dflash_config, load_kimi_config
from ddtree_jax.errors import UserError, run_app
from ddtree_jax.hub import METADATA_FILES, resolve_checkpoint
from ddtree_jax.mesh_spec import parse_mesh_spec
from ddtree_jax.prompts import read_prompts
from ddtree_jax.tokenizer import has_tokenizer, load_tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target checkpoint (Kimi K2 family): a directory or a Hugging Face model id.")
flags.DEFINE_string("drafter", None, "DFlash drafter checkpoint: a directory or a Hugging Face model id.")
flags.DEFINE_string("prompts", None, "Held-out prompts (JSON Lines, as for ddtree-generate) the rows are cut from.")
flags.DEFINE_string("output", None, f"Where the table goes; default: {cost_table.FILE_NAME} in the --drafter directory")
flags.DEFINE_list(
    "candidates", list(cost_table.DEFAULT_CANDIDATES), "Programs auto may choose: ar, dflash, ddtree-<budget>."
)
flags.DEFINE_list("batches", ["1", "8", "32", "64", "128"], "Batch sizes of the grid.")
flags.DEFINE_list("contexts", ["64", "1024", "4096"], "Contexts (prompt tokens) of the grid.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per row in a timed run.")
flags.DEFINE_integer("repeats", 3, "Timed runs per program (median).")
flags.DEFINE_enum(
    "dtype", "auto", ["auto", "bfloat16", "float32"], "Weights / activations (auto: as ddtree-generate's default)."
)
flags.DEFINE_string("mesh", None, "Device mesh, as for ddtree-generate (default: all local devices on expert).")
flags.DEFINE_integer("compile_workers", min(8, os.cpu_count() or 1), "Threads compiling the programs up front.")
flags.DEFINE_bool(
    "exact", None, "Measure the exact-numerics programs (as ddtree-generate --exact; default: as ddtree-generate's)."
)
flags.DEFINE_bool("overwrite", False, "Replace an existing table.")
flags.mark_flags_as_required(["target", "drafter", "prompts"])


def positive_ints(name: str) -> list[int]:
    """A list flag's values as sorted distinct integers >= 1; raises `UserError`."""
    try:
        values = sorted({int(v) for v in FLAGS[name].value})
    except ValueError:
        raise UserError(f"--{name} must be integers, got {','.join(FLAGS[name].value)}") from None
    if not values or values[0] < 1:
        raise UserError(f"--{name} must be integers >= 1, got {','.join(FLAGS[name].value)}")
    return values


def parse_candidates() -> list[cost_table.Candidate]:
    try:
        cands = [cost_table.Candidate.parse(c) for c in dict.fromkeys(FLAGS.candidates)]
    except ValueError as e:
        raise UserError(f"--candidates: {e}") from None
    if not cands:
        raise UserError("--candidates must name at least one program")
    return cands


def output_path(drafter_dir: Path) -> Path:
    """--output, or calibration.json in the drafter's directory (a local one: a Hub id needs --output)."""
    if FLAGS.output is None and not Path(FLAGS.drafter).is_dir():
        raise UserError(f"--drafter {FLAGS.drafter} is not a local directory: pass --output")
    out = Path(FLAGS.output) if FLAGS.output is not None else drafter_dir / cost_table.FILE_NAME
    if out.is_dir():
        raise UserError(f"--output {out} is a directory")
    if not out.absolute().parent.is_dir():
        raise UserError(f"--output directory {out.absolute().parent} does not exist")
    if out.exists() and not FLAGS.overwrite:
        raise UserError(f"{out} exists: pass --overwrite to replace it")
    return out


def fitting_contexts(contexts: list[int], limit: int, draft_slots: int) -> list[int]:
    """The contexts, each lowered to the longest prompt that leaves room for --max_new_tokens and the draft slots
    below the position limit; raises `UserError` when none fits."""
    longest = limit - FLAGS.max_new_tokens - draft_slots
    if longest < 1:
        raise UserError(f"--max_new_tokens {FLAGS.max_new_tokens} leaves no prompt room below the limit {limit}")
    lowered = sorted({min(c, longest) for c in contexts})
    if lowered[-1] < contexts[-1]:
        logging.warning("contexts above %d lowered to it (position limit %d)", longest, limit)
    return lowered


def choices_text(table: cost_table.CostTable, max_new_tokens: int) -> str:
    """The candidate auto would choose at each grid point for runs of `max_new_tokens`, at the table's acceptance."""

    def chosen(b: int, c: int) -> str:
        return table.choose(b, c, max_new_tokens, table.acceptance(b, c)).candidate.name

    head = "batch \\ context  " + "  ".join(f"{c:>10}" for c in table.contexts)
    rows = [f"{b:>15}  " + "  ".join(f"{chosen(b, c):>10}" for c in table.contexts) for b in table.batches]
    return "\n".join([head, *rows])


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    candidates = parse_candidates()
    batches, contexts = positive_ints("batches"), positive_ints("contexts")
    for name, low in (("max_new_tokens", 2), ("repeats", 1)):
        if FLAGS[name].value < low:
            raise UserError(f"--{name} must be >= {low}, got {FLAGS[name].value}")
    if FLAGS.mesh is not None:
        parse_mesh_spec(FLAGS.mesh)
    target_dir = resolve_checkpoint(FLAGS.target, METADATA_FILES)
    drafter_dir = resolve_checkpoint(FLAGS.drafter, METADATA_FILES)
    out = output_path(Path(drafter_dir))
    target_cfg, drafter_cfg = load_kimi_config(target_dir), load_dflash_config(drafter_dir)
    check_pair(target_cfg, drafter_cfg)
    limit = min(target_cfg.max_position_embeddings, drafter_cfg.max_position_embeddings)
    contexts = fitting_contexts(contexts, limit, drafter_cfg.num_draft)
    tokenizer = load_tokenizer(target_dir) if has_tokenizer(target_dir) else None
    prompts = [list(p.token_ids) for p in read_prompts(FLAGS.prompts, tokenizer, target_cfg.vocab_size)]

    import jax
    import jax.numpy as jnp

    from ddtree_jax.api import Generator, default_dtype, padded_prompt_len, resolve_exact
    from ddtree_jax.calibration import measure
    from ddtree_jax.sharding import resolve_mesh

    dtype = default_dtype() if FLAGS.dtype == "auto" else jnp.dtype(FLAGS.dtype)
    exact = resolve_exact(FLAGS.exact, resolve_mesh(FLAGS.mesh), dtype)
    heaviest = cost_table.largest(candidates, drafter_cfg.num_draft)
    memory.check_fits(
        target_cfg,
        drafter_cfg,
        context_limit=limit,
        batch=batches[-1],
        max_len=padded_prompt_len(contexts[-1]) + FLAGS.max_new_tokens,
        prompt_len=padded_prompt_len(contexts[-1]),
        method=heaviest.method,
        budget=heaviest.spec_budget,
        layout=memory.Layout.from_spec(FLAGS.mesh, jax.device_count()),
        dtype_bytes=jnp.dtype(dtype).itemsize,
        exact=exact,
    )
    gen = Generator.load(FLAGS.target, FLAGS.drafter, dtype=dtype, mesh=FLAGS.mesh, exact=exact)
    table = measure(
        gen,
        prompts,
        candidates=candidates,
        batches=batches,
        contexts=contexts,
        max_new_tokens=FLAGS.max_new_tokens,
        repeats=FLAGS.repeats,
        compile_workers=FLAGS.compile_workers,
        target=FLAGS.target,
        drafter=FLAGS.drafter,
        progress="calibrate",
    )
    table = dataclasses.replace(table, settings=table.settings | {"prompts": FLAGS.prompts})
    table.save(out)
    choices = choices_text(table, FLAGS.max_new_tokens)
    print(f"wrote {out}\nauto's choice for {FLAGS.max_new_tokens} new tokens at the measured acceptance:\n{choices}")


def run() -> None:
    run_app(main)


if __name__ == "__main__":
    run()
