"""`ddtree-generate`: batch generation from a JSON Lines prompts file.

    ddtree-generate --target=K2.6 --drafter=K2.6-DFlash --prompts=in.jsonl --output=out.jsonl

--target and --drafter are directories or Hugging Face model ids (`ddtree_jax.hub`). Everything that can be
checked (flags, configs, tokenizer, prompts, lengths) is checked before any weight is loaded (or downloaded); bad
input is a one-line `error:` with exit code 2. Each finished batch is written to --output at once (atomically), in
input order; an existing --output is refused unless --overwrite (replace it) or --resume (skip the ids already
there). Before loading, the run's per-device memory (`ddtree_jax.memory.plan`) is compared with the device's free
memory ($DDTREE_FREE_BYTES overrides it) and a run that cannot fit is refused with what would.

--method=auto (the default) runs each batch with the program the cost table expects fastest for its size and
longest prompt: `ar`, the DFlash chain or DDTree at a budget, all lossless; `ar` unless a drafting program is expected
more than 5% faster (`ddtree_jax.cost_table.AR_MARGIN`). The table is --calibration or calibration.json beside the
drafter (`ddtree-calibrate` writes it; a table measured on another device kind or count or dtype is refused); without
--drafter auto is `ar`. auto chooses the budget too, so it takes no --budget. Each record's stats.batch names the
method and budget that ran and, under auto, what it chose and why.

Sampling (--temperature > 0) draws from the temperature -> --top_k -> --top_p distribution, the same for every
method. A request stops on device at the model's EOS ids (unless --ignore_eos) or a --stop_token_ids id; --stop
strings are matched on the host after generation. Each record's stats say why it ended: finish_reason "stop" or
"length".
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags, logging
from tqdm import tqdm

from ddtree_jax import cost_table, engine, memory
from ddtree_jax.config import DFlashConfig, check_pair, load_dflash_config, load_kimi_config
from ddtree_jax.errors import UserError, run_app
from ddtree_jax.hub import METADATA_FILES, resolve_checkpoint
from ddtree_jax.mesh_spec import parse_mesh_spec
from ddtree_jax.prompts import OutputWriter, Prompt, check_lengths, read_prompts
from ddtree_jax.tokenizer import has_tokenizer, load_tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target checkpoint (Kimi K2 family): a directory or a Hugging Face model id.")
flags.DEFINE_string(
    "drafter", None, "DFlash drafter checkpoint, a directory or a Hugging Face model id (needed by dflash and ddtree)."
)
flags.DEFINE_enum(
    "method",
    "auto",
    ["auto", "ar", "dflash", "ddtree"],
    "Decoding method. auto: per batch, the program (ar, dflash or ddtree at a budget) the cost table expects fastest, "
    f"ar unless another is expected more than {cost_table.AR_MARGIN:.0%} faster; ar without --drafter.",
)
flags.DEFINE_integer("budget", engine.DEFAULT_BUDGET, "DDTree node budget per round (--method=ddtree; auto chooses).")
flags.DEFINE_string(
    "calibration",
    None,
    f"Cost table of --method=auto (ddtree-calibrate writes it); default: {cost_table.FILE_NAME} beside --drafter.",
)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (ties with the k-th kept); 0 = all.")
flags.DEFINE_float("top_p", 1.0, "Sample from the nucleus of this probability mass, after --top_k; 1 = all.")
flags.DEFINE_list(
    "stop_token_ids", [], "Extra token ids that end a request (kept in its output), e.g. 7,42; --ignore_eos keeps them."
)
flags.DEFINE_multi_string(
    "stop", [], "A stop string (repeatable): the text is cut before its first occurrence. Needs the tokenizer."
)
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate per prompt.")
flags.DEFINE_string(
    "prompts",
    None,
    'JSON Lines: {"id", "prompt": text}, {"id", "prompt_ids": [...]} or {"id", "messages": [{"role", "content"}]}.',
)
flags.DEFINE_string("output", None, "JSON Lines results, in input order.")
flags.DEFINE_integer("batch_size", 8, "Prompts per batch.")
flags.DEFINE_enum(
    "dtype",
    "auto",
    ["auto", "bfloat16", "float32"],
    "Weights / activations. auto: float32 on a CPU (exact: every method gives the same tokens), bfloat16 on a GPU.",
)
flags.DEFINE_bool(
    "exact",
    None,
    "Batch- and tree-invariant numerics: speculative output equals --method=ar's bit for bit whatever the batch "
    "(docs/exactness.md). Default: on in bfloat16 on one GPU, else off; not with a device mesh.",
)
flags.DEFINE_bool("ignore_eos", False, "Generate past the model's EOS tokens (not past --stop_token_ids).")
flags.DEFINE_integer("seed", 0, "Sampling seed; a request's samples depend only on (seed, its index in --prompts).")
flags.DEFINE_bool("resume", False, "Keep the existing --output and skip the ids already in it.")
flags.DEFINE_bool("overwrite", False, "Replace an existing --output (refused without this or --resume).")
flags.DEFINE_bool("chat", False, "Wrap text prompts in the checkpoint's chat format (messages rows always are).")
flags.DEFINE_string(
    "mesh",
    None,
    'Device mesh, e.g. "expert=8,tensor=1" or "data=2,expert=4" (axes data, expert, tensor; sizes multiply to '
    "the device count). Default: all local devices on expert.",
)
flags.mark_flags_as_required(["target", "prompts", "output"])

# A tree accepts at most block_size tokens per round whatever its size, while verify cost grows with it.
BUDGET_WARN = 512


def validate_flags() -> None:
    """Flag values that need no file; raises `UserError`."""
    for name, low in (("budget", 1), ("batch_size", 1), ("max_new_tokens", 1)):
        if FLAGS[name].value < low:
            raise UserError(f"--{name} must be >= {low}, got {FLAGS[name].value}")
    if not 0 <= FLAGS.temperature < math.inf:
        raise UserError(f"--temperature must be finite and >= 0 (0 = greedy), got {FLAGS.temperature}")
    if FLAGS.top_k < 0:
        raise UserError(f"--top_k must be >= 0 (0 = all tokens), got {FLAGS.top_k}")
    if not 0 < FLAGS.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1] (1 = all tokens), got {FLAGS.top_p}")
    if FLAGS.temperature == 0 and (FLAGS.top_k or FLAGS.top_p < 1):
        raise UserError("--top_k and --top_p need --temperature > 0 (--temperature=0 is greedy)")
    stop_token_ids()
    if "" in FLAGS.stop:
        raise UserError("--stop must not be empty")
    if FLAGS.mesh is not None:
        parse_mesh_spec(FLAGS.mesh)
    if FLAGS.method in ("dflash", "ddtree") and not FLAGS.drafter:
        raise UserError(f"--method={FLAGS.method} needs --drafter")
    if FLAGS.method == "auto" and FLAGS["budget"].present:
        raise UserError("--method=auto chooses the budget: pass --budget with --method=ddtree")
    if FLAGS.calibration is not None and FLAGS.method != "auto":
        raise UserError(f"--calibration is the cost table of --method=auto, not of --method={FLAGS.method}")
    out = Path(FLAGS.output)
    if out.is_dir():
        raise UserError(f"--output {out} is a directory")
    if not out.absolute().parent.is_dir():
        raise UserError(f"--output directory {out.absolute().parent} does not exist")
    if out.resolve() == Path(FLAGS.prompts).resolve():
        raise UserError(f"--output {out} is the prompts file")
    if FLAGS.resume and FLAGS.overwrite:
        raise UserError("--resume keeps --output and --overwrite replaces it: pass one of them")
    if out.exists() and not (FLAGS.resume or FLAGS.overwrite):
        raise UserError(f"--output {out} exists: pass --overwrite to replace it or --resume to continue it")


def stop_token_ids(vocab_size: int | None = None) -> list[int]:
    """--stop_token_ids as integers, each >= 0 and, given the vocabulary size, below it; raises `UserError`."""
    try:
        ids = [int(t) for t in FLAGS.stop_token_ids]
    except ValueError:
        raise UserError(f"--stop_token_ids must be integers, got {','.join(FLAGS.stop_token_ids)}") from None
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        limit = "" if vocab_size is None else f" [0, {vocab_size})"
        raise UserError(f"--stop_token_ids {bad} outside the vocabulary{limit}")
    return ids


def draft_slots(method: str, drafter: DFlashConfig | None) -> int:
    """Positions a round may reach past the last committed token: the tree depth D = block_size - 1."""
    return 0 if method == "ar" or drafter is None else drafter.num_draft


def warn_budget(budget: int, drafter: DFlashConfig) -> None:
    if budget > BUDGET_WARN:
        logging.warning(
            "--budget=%d: a round accepts at most block_size=%d tokens however large the tree, while each of "
            "the %d nodes costs verify compute; budgets above %d rarely pay off.",
            budget,
            drafter.block_size,
            budget,
            BUDGET_WARN,
        )


def calibration_table(drafter_dir: str | None) -> cost_table.CostTable | None:
    """--method=auto's cost table: --calibration, or calibration.json beside the drafter; None without a drafter
    (auto is then ar). Raises `UserError` when there is none."""
    if drafter_dir is None:
        return None
    if FLAGS.calibration is not None:
        return cost_table.CostTable.load(FLAGS.calibration)
    path = Path(drafter_dir) / cost_table.FILE_NAME
    if not path.is_file():
        raise UserError(
            f"--method=auto needs a cost table, and {path} is none: run ddtree-calibrate --target={FLAGS.target} "
            f"--drafter={FLAGS.drafter} --prompts=HELD_OUT.jsonl (or pass --calibration, or another --method)"
        )
    return cost_table.CostTable.load(path)


def method_label(records: Sequence[dict[str, Any]]) -> str:
    """What ran: one method ("ddtree-16"), or under auto the candidates it chose, by requests ("auto: ddtree-8 x12,
    ar x4")."""
    batches = [r["stats"]["batch"] for r in records]
    ran = Counter(cost_table.Candidate(b["method"], b["budget"]).name for b in batches)
    if all(b["auto"] is None for b in batches):
        return ", ".join(ran)
    return "auto: " + ", ".join(f"{name} x{n}" for name, n in ran.most_common())


def summary_table(records: Sequence[dict[str, Any]], exec_s: float, compile_s: float, wall_s: float) -> str:
    """The run's figures, each labelled: the method that ran, aggregate tok/s over the programs' execution
    (compilation excluded), the median request's estimated tok/s, and the seconds spent executing, compiling and in
    all."""
    tokens = sum(len(r["token_ids"]) for r in records)
    rounds = sum(r["stats"]["rounds"] for r in records)
    per_request = statistics.median(r["stats"]["est_tokens_per_s"] for r in records)
    cells = {
        "method": method_label(records),
        "requests": str(len(records)),
        "tokens": str(tokens),
        "rounds": str(rounds),
        "tokens/round": f"{tokens / max(rounds, 1):.2f}",
        "aggregate tok/s (exec)": f"{tokens / exec_s:.1f}" if exec_s > 0 else "-",
        "per-request tok/s (median, est.)": f"{per_request:.1f}",
        "exec s": f"{exec_s:.2f}",
        "compile s": f"{compile_s:.2f}",
        "wall s": f"{wall_s:.2f}",
    }
    widths = [max(len(h), len(c)) for h, c in cells.items()]
    rows = (cells.keys(), cells.values())
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def make_record(p: Prompt, tokens: list[int], stats: dict[str, Any], batch: dict[str, Any], text: str | None):
    """One output line. `stats`: this request's rounds, tokens per round and its estimated latency and tok/s
    (`api.GenerationResult`) and finish_reason ("stop": a stop token id or --stop string, "length": --max_new_tokens);
    `stats.batch`: the batch it ran in (size, rounds, execution seconds, aggregate tok/s, the method and DDTree budget
    that ran, whether it ran the exact numerics (--exact), and under --method=auto what it chose and why:
    `cost_table.Choice.to_dict`, else null)."""
    own = ("rounds", "tokens_per_round", "finish_reason", "est_latency_s", "est_tokens_per_s")
    return {
        "id": p.id,
        "token_ids": list(tokens),
        "text": text,
        "stats": {k: stats[k] for k in own} | {"batch": batch},
    }


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    validate_flags()
    target_dir = resolve_checkpoint(FLAGS.target, METADATA_FILES)
    drafter_dir = resolve_checkpoint(FLAGS.drafter, METADATA_FILES) if FLAGS.drafter else None
    target_cfg = load_kimi_config(target_dir)
    drafter_cfg = load_dflash_config(drafter_dir) if drafter_dir else None
    context_limit = target_cfg.max_position_embeddings
    if drafter_cfg is not None:
        check_pair(target_cfg, drafter_cfg)
        context_limit = min(context_limit, drafter_cfg.max_position_embeddings)
        if FLAGS.method == "ddtree":
            warn_budget(FLAGS.budget, drafter_cfg)
    user_stop_ids = stop_token_ids(target_cfg.vocab_size)
    tokenizer = load_tokenizer(target_dir) if has_tokenizer(target_dir) else None
    if FLAGS.stop and tokenizer is None:
        raise UserError(f"--stop: {FLAGS.target} has no tokenizer (tiktoken.model or tokenizer.json) to match text")
    if FLAGS.chat and (tokenizer is None or not tokenizer.has_chat_format):
        missing = "no tokenizer" if tokenizer is None else "a tokenizer without a chat format (tokenizer.json)"
        raise UserError(f"--chat: {FLAGS.target} has {missing}; Kimi's tiktoken.model has the chat format")
    prompts = read_prompts(FLAGS.prompts, tokenizer, target_cfg.vocab_size, chat=FLAGS.chat)
    check_lengths(prompts, FLAGS.max_new_tokens, context_limit, draft_slots(FLAGS.method, drafter_cfg))
    writer = OutputWriter(FLAGS.output, [p.id for p in prompts], resume=FLAGS.resume)
    done = writer.done_ids()
    # A request's index in the file seeds its sampling, whatever batch it lands in (and across --resume).
    todo = [(i, p) for i, p in enumerate(prompts) if p.id not in done]
    if not todo:
        logging.info("All %d prompts are already in %s; nothing to do.", len(prompts), FLAGS.output)
        return
    table = calibration_table(drafter_dir) if FLAGS.method == "auto" else None

    import jax
    import jax.numpy as jnp

    from ddtree_jax.api import Generator, default_dtype, device_identity, padded_prompt_len, resolve_exact
    from ddtree_jax.sharding import resolve_mesh
    from pallas_kernels.dispatch import Kernels

    try:
        kernels = Kernels.from_env()
    except ValueError as e:
        raise UserError(f"kernel selection (DDTREE_* environment): {e}") from None

    dtype = default_dtype() if FLAGS.dtype == "auto" else jnp.dtype(FLAGS.dtype)
    method, budget = "ar" if FLAGS.method == "auto" else FLAGS.method, FLAGS.budget  # auto without a drafter: ar
    mesh = resolve_mesh(FLAGS.mesh)
    exact = resolve_exact(FLAGS.exact, mesh, dtype)
    if table is not None:
        table.check(**device_identity(mesh, dtype, exact))
        heaviest = cost_table.largest(table.candidates, drafter_cfg.num_draft)  # auto may run any candidate
        method, budget = heaviest.method, heaviest.spec_budget
    longest = padded_prompt_len(max(len(p.token_ids) for _, p in todo))
    memory.check_fits(
        target_cfg,
        drafter_cfg,
        context_limit=context_limit,
        batch=min(FLAGS.batch_size, len(todo)),
        max_len=longest + FLAGS.max_new_tokens,
        prompt_len=longest,
        method=method,
        budget=budget,
        layout=memory.Layout.from_spec(FLAGS.mesh, jax.device_count()),
        dtype_bytes=jnp.dtype(dtype).itemsize,
        exact=exact,
    )
    gen = Generator.load(
        FLAGS.target,
        FLAGS.drafter,
        dtype=dtype,
        mesh=FLAGS.mesh,
        calibration=table.source if table else None,
        exact=exact,
    )
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    exec_s = compile_s = 0.0
    tokens = 0
    bar = tqdm(total=len(todo), unit="req", desc="generate", dynamic_ncols=True)
    for start in range(0, len(todo), FLAGS.batch_size):
        batch = todo[start : start + FLAGS.batch_size]
        res = gen.generate(
            [list(p.token_ids) for _, p in batch],
            method=FLAGS.method,
            budget=None if FLAGS.method == "auto" else FLAGS.budget,
            temperature=FLAGS.temperature,
            max_new_tokens=FLAGS.max_new_tokens,
            seed=FLAGS.seed,
            request_indices=[i for i, _ in batch],
            kernels=kernels,
            ignore_eos=FLAGS.ignore_eos,
            top_k=FLAGS.top_k,
            top_p=FLAGS.top_p,
            stop_token_ids=user_stop_ids,
            stop_strings=FLAGS.stop,
            pad_batch_to=min(FLAGS.batch_size, len(todo)),  # a short last batch reuses the full batch's program
        )
        about = {"requests": len(batch), "rounds": res.batch_rounds, "exec_s": res.wall_s}
        about |= {"tokens_per_s": res.tokens_per_s, "method": res.method, "budget": res.budget}
        about["exact"] = res.spec.kernels.exact
        about["auto"] = res.auto.to_dict() if res.auto is not None else None
        texts = res.texts or [None] * len(batch)
        rows = zip((p for _, p in batch), res.tokens, res.stats, texts, strict=True)
        done_now = [make_record(p, t, s, about, text) for p, t, s, text in rows]
        writer.write_batch(done_now)
        records += done_now
        exec_s, compile_s = exec_s + res.wall_s, compile_s + res.compile_s
        bar.update(len(batch))
        tokens += sum(len(t) for t in res.tokens)
        bar.set_postfix_str(f"{tokens} tokens, {tokens / exec_s:.1f} tok/s aggregate (exec)")
    bar.close()
    print(summary_table(records, exec_s, compile_s, time.perf_counter() - started))


def run() -> None:
    run_app(main)


if __name__ == "__main__":
    run()
