"""`make demo`: the shipped Kimi-architecture pair on held-out code prompts, through the batch CLI.

    python -m experiments.demo [--max_new_tokens=96 --budget=16]

Runs `python -m ddtree_jax.generate` on checkpoints/demo_prompts.jsonl with ar, dflash and ddtree, prints each
prompt with the generated code, then a table: tokens/round, tokens/s (compilation excluded), speedup over ar,
and whether each method's output is identical to ar's (temperature 0, so it must be).

Runs in float32 by default: in bfloat16 the target's logits depend slightly on how many tokens a forward
verifies (1 for ar, 8 for the chain, 17 for the tree), so a near-tie argmax can flip and a greedy output
diverge from ar's (seen once in 480 tokens here: "node" vs "nodes"); float32 keeps them identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from ddtree_jax.errors import run_app

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target checkpoint.")
flags.DEFINE_string("drafter", "checkpoints/kimi-mini-dflash", "Drafter checkpoint.")
flags.DEFINE_string("prompts", "checkpoints/demo_prompts.jsonl", "Held-out prompts.")
flags.DEFINE_integer("max_new_tokens", 96, "Tokens per prompt.")
flags.DEFINE_integer("budget", 16, "DDTree node budget.")
flags.DEFINE_enum("dtype", "float32", ["bfloat16", "float32"], "Weights / activations dtype.")

METHODS = ("ar", "dflash", "ddtree")


def run_cli(method: str, out: Path) -> list[dict]:
    """One batch-CLI run; returns its output records in prompt order."""
    cmd = [
        sys.executable, "-m", "ddtree_jax.generate", f"--target={FLAGS.target}", f"--drafter={FLAGS.drafter}",
        f"--method={method}", f"--budget={FLAGS.budget}", f"--prompts={FLAGS.prompts}", f"--output={out}",
        f"--max_new_tokens={FLAGS.max_new_tokens}", "--ignore_eos", "--batch_size=8", "--temperature=0",
        f"--dtype={FLAGS.dtype}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: the {method} run failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    """Per method: tokens/round, aggregate tokens/s over the batches' execution (compilation excluded), speedup over
    ar, identical to ar."""
    rows = []
    for method, recs in results.items():
        tokens = sum(len(r["token_ids"]) for r in recs)
        rounds = sum(r["stats"]["rounds"] for r in recs)
        exec_s = sum(r["stats"]["batch"]["exec_s"] / r["stats"]["batch"]["requests"] for r in recs)  # each batch once
        rows.append(
            {
                "method": method if method != "ddtree" else f"ddtree (budget {FLAGS.budget})",
                "tokens/round": tokens / rounds,
                "tokens/s": tokens / exec_s,
                "identical to ar": [r["token_ids"] for r in recs] == [r["token_ids"] for r in results["ar"]],
            }
        )
    for r in rows:
        r["speedup"] = r["tokens/s"] / rows[0]["tokens/s"]
    return rows


def format_table(rows: list[dict]) -> str:
    head = ["method", "tokens/round", "tokens/s", "speedup", "identical to ar"]
    cells = [
        [
            r["method"],
            f"{r['tokens/round']:.2f}",
            f"{r['tokens/s']:.1f}",
            f"{r['speedup']:.2f}x",
            str(r["identical to ar"]),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in [head, *cells])


def main(argv: Sequence[str]) -> None:
    del argv
    prompts = [json.loads(line) for line in Path(FLAGS.prompts).read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for m in METHODS:
            print(f"running {m} ...", flush=True)
            results[m] = run_cli(m, Path(tmp) / f"{m}.jsonl")
    for p, rec in zip(prompts, results["ddtree"], strict=True):
        print(f"\n=== {p['id']} (held out) ===\n{p['prompt']}\033[1m{rec['text']}\033[0m")
    print(f"\n{len(prompts)} prompts x {FLAGS.max_new_tokens} tokens, temperature 0, {FLAGS.dtype}, mini pair\n")
    rows = summarize(results)
    print(format_table(rows))
    if not all(r["identical to ar"] for r in rows):
        sys.exit("error: speculative outputs differ from ar at temperature 0")


if __name__ == "__main__":
    run_app(main)
