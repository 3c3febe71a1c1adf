"""Acceptance of the shipped pair on held-out prompts at temperature 0: tokens per round vs DDTree budget.

    python -m experiments.eval_acceptance [--target=... --drafter=... --max_new_tokens=96]

Prompts come from experiments/eval_prompts.jsonl (functions of held-out standard-library files); the script
checks that none of their files is in the target's training list. All prompts run as one batch per method:
`ar`, the DFlash chain and DDTree at each --budgets; every output must equal `ar`'s. Writes
experiments/results/acceptance.{json,md} (acceptance_float32.* with --dtype=float32) with the per-method acceptance
histograms (rounds committing 1..8 tokens).

A row that differs from `ar` is listed with its first differing position and the target's logit gap there
(logit[ar token] - logit[other token]) from one plain causal prefill of the shared prefix, in the run's dtype and
in float32: a gap inside bf16 rounding, or a sign that flips between the two, marks a numerical near-tie
(verify and decode reduce in different orders), not a wrong acceptance.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from ddtree_jax.errors import run_app

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target checkpoint.")
flags.DEFINE_string("drafter", "checkpoints/kimi-mini-dflash", "Drafter checkpoint.")
flags.DEFINE_string("prompts", "experiments/eval_prompts.jsonl", "Held-out prompts (JSON Lines, text).")
flags.DEFINE_list("budgets", ["4", "8", "16", "32", "64"], "DDTree node budgets.")
flags.DEFINE_integer("max_new_tokens", 96, "Tokens generated per prompt (stop tokens ignored).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and activations of both models.")
flags.DEFINE_integer("context", 0, "Cut every prompt to this many tokens of the held-out stream (0: as written).")
flags.DEFINE_string("out_dir", "", "Results directory (default experiments/results).")
flags.DEFINE_bool("exact", None, "the target's exact (batch- and tree-invariant) numerics; default: the product's")

COLUMNS = (
    "method", "budget", "tokens_per_round", "identical_to_ar", "rows_differing", "tokens_per_s", "compile_s", "rounds",
)  # fmt: skip


def check_held_out(prompt_ids: list[str], target: Path) -> None:
    """Raise if a prompt's source file is in the target's training list."""
    trained = {f["path"] for f in json.loads((target / "training_manifest.json").read_text())["data"]["train_files"]}
    leaked = sorted({i.split("#")[0] for i in prompt_ids} & trained)
    if leaked:
        raise ValueError(f"prompts from training files: {leaked}")


def main(argv: Sequence[str]) -> None:
    del argv
    from ddtree_jax.api import Generator
    from ddtree_jax.checkpoint import load_target
    from experiments.common import markdown_table, write_results
    from experiments.exactness import divergence

    gen = Generator.load(FLAGS.target, FLAGS.drafter, dtype=jnp.dtype(FLAGS.dtype), exact=FLAGS.exact)
    rows = [json.loads(line) for line in Path(FLAGS.prompts).read_text().splitlines() if line.strip()]
    check_held_out([r["id"] for r in rows], Path(FLAGS.target))
    prompts = [gen.tokenizer.encode(r["prompt"]) for r in rows]
    if FLAGS.context:
        from ddtree_jax.calibration import at_length

        prompts = at_length(prompts, FLAGS.context, len(prompts))
    runs = [("ar", 1), ("dflash", 1)] + [("ddtree", int(b)) for b in FLAGS.budgets]
    records, hists, ar_tokens, diverged, target32 = [], {}, None, [], None
    for method, budget in runs:
        res = gen.generate(prompts, method=method, budget=budget, max_new_tokens=FLAGS.max_new_tokens, ignore_eos=True)
        if ar_tokens is None:
            ar_tokens = res.tokens
        rounds = sum(s["rounds"] for s in res.stats)
        hist = np.sum([s["accept_hist"] for s in res.stats], axis=0).tolist() if method != "ar" else []
        name = method if method != "ddtree" else f"ddtree-{budget}"
        hists[name] = hist
        records.append(
            {
                "method": method,
                "budget": budget if method == "ddtree" else "",
                "tokens_per_round": sum(len(t) for t in res.tokens) / rounds,
                "identical_to_ar": res.tokens == ar_tokens,
                "rows_differing": sum(a != b for a, b in zip(res.tokens, ar_tokens, strict=True)),
                "tokens_per_s": res.tokens_per_s,
                "compile_s": res.compile_s,
                "rounds": rounds,
            }
        )
        logging.info("%s: %s", name, records[-1])
        for i, (ref, out) in enumerate(zip(ar_tokens, res.tokens, strict=True)):
            if ref != out:
                if target32 is None:  # a float32 run already holds it
                    target32 = gen.target if FLAGS.dtype == "float32" else load_target(FLAGS.target, dtype=jnp.float32)
                diverged.append({"method": name, "row": i, **divergence(gen.target, target32, prompts[i], ref, out)})
                logging.warning("%s differs from ar: %s", name, diverged[-1])
    by = {(r["method"], r["budget"]): r["tokens_per_round"] for r in records}
    bar = {
        "ddtree16_ge_4": by[("ddtree", 16)] >= 4 if ("ddtree", 16) in by else None,
        "ddtree16_gt_chain": by[("ddtree", 16)] > by[("dflash", "")] if ("ddtree", 16) in by else None,
        "chain_gt_2": by[("dflash", "")] > 2,
        "all_identical_to_ar": all(r["identical_to_ar"] for r in records),
    }
    extra = {
        "dtype": FLAGS.dtype,
        "exact": gen.exact,
        "prompts": len(prompts),
        "context": FLAGS.context or "as written",
        "max_new_tokens": FLAGS.max_new_tokens,
        "accept_hist_note": "rounds committing 1..block_size tokens, summed over prompts",
        "accept_hist": hists,
        "bar": bar,
        "divergences": diverged,
    }
    name = "acceptance" + ("" if FLAGS.dtype == "bfloat16" else f"_{FLAGS.dtype}")
    name += f"_ctx{FLAGS.context}" if FLAGS.context else ""
    path = write_results(name, records, COLUMNS, out_dir=FLAGS.out_dir or None, extra=extra)
    md = path.with_suffix(".md")
    depth = max(len(h) for h in hists.values())
    hist_rows = [{"method": k, **{str(i + 1): v for i, v in enumerate(h)}} for k, h in hists.items() if h]

    md.write_text(
        md.read_text()
        + f"\n{len(prompts)} held-out prompts, {FLAGS.max_new_tokens} new tokens each, temperature 0, "
        + f"{FLAGS.dtype}.\n\n"
        + "Acceptance histogram (rounds committing k tokens):\n\n"
        + markdown_table(hist_rows, ["method", *map(str, range(1, depth + 1))])
        + f"\n\nBar: {bar}\n"
        + (
            "\nRows differing from `ar` (first differing position; target logit gap ar token - other token from a "
            "plain prefill, run dtype and float32):\n\n"
            + markdown_table(diverged, ["method", "row", "position", "ar_token", "token", "gap", "gap_f32"])
            + "\n"
            if diverged
            else ""
        )
    )
    print(md.read_text())


if __name__ == "__main__":
    run_app(main)
