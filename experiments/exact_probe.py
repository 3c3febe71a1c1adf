"""Where does a token's computation depend on the call? Layer by layer, the target's residual stream of the same
tokens computed as one-token decode steps, as a causal block, as the deepest branch of a tree, and beside other
rows (issue 34).

    python -m experiments.exact_probe                  # one GPU: the shipped pair in bf16, exact numerics on
    python -m experiments.exact_probe --noexact        # the same probe without them

After a shared prefill of `--context` prompt tokens (absorbed form), the next `--tokens` tokens of the prompt are
run (a) one per call as decode steps, (b) as one causal block under its mask (the tree kernel), (b') as the engine's
prefill runs a causal block (reading the cache), (c) as the ancestor chain of a `--tree`-node tree
whose other nodes are random tokens, (d) as decode steps in row 3 of a batch of 8 whose other rows hold other
prompts, (e) the same with the other rows' prompts i * 7 % 23 tokens shorter (ragged, as the engine batches them).
For (b)-(e) against (a), per layer: `equal` (bitwise, every token) and `max_diff`; the same for the logits. Every
call is one compiled program with the engine's compiler options (`--nojit`: op by op, no fusion across ops).
Writes <out_dir>/exact_probe.json and .md (exact_probe_off without the exact numerics, *_eager op by op).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from ddtree_jax.calibration import at_length
from ddtree_jax.errors import run_app
from experiments import common, workload
from experiments.invariance import chain_tree, decode_steps, prefilled, run_block
from pallas_kernels.dispatch import Kernels

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_integer("context", 60, "prompt tokens prefilled before the probed tokens")
flags.DEFINE_integer("tokens", 8, "tokens probed")
flags.DEFINE_integer("tree", 17, "nodes of the tree of (c)")
flags.DEFINE_bool("exact", True, "the exact (batch- and tree-invariant) numerics")
flags.DEFINE_bool("jit", True, "each call one compiled program as in the engine (else op by op)")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and activations")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["case", "layer", "equal", "max_diff"]
BATCH, ROW = 8, 3


def compare(case: str, got, want) -> list[dict]:
    """Per layer (and 'logits') of (residuals, logits) pairs: bitwise equality and the largest difference."""
    (gf, gl), (wf, wl) = got, want
    rows = [
        {"case": case, "layer": i, "equal": bool(np.array_equal(gf[..., i, :], wf[..., i, :]))}
        | {"max_diff": float(np.max(np.abs(gf[..., i, :] - wf[..., i, :])))}
        for i in range(gf.shape[-2])
    ]
    rows.append({"case": case, "layer": "logits", "equal": bool(np.array_equal(gl, wl))})
    rows[-1]["max_diff"] = float(np.max(np.abs(gl - wl)))
    return rows


def main(_) -> None:
    from ddtree_jax.api import Generator

    gen = Generator.load(FLAGS.target, dtype=jnp.dtype(FLAGS.dtype), exact=FLAGS.exact)
    target = gen.target
    kernels = dataclasses.replace(Kernels.from_env(), exact=FLAGS.exact)
    k, p = FLAGS.tokens, FLAGS.context
    base, _ = workload.load_prompts(gen, FLAGS.prompts, BATCH)
    rows = np.asarray(at_length(base, p + k, BATCH))
    prompt, probe = rows[ROW : ROW + 1, :p], rows[ROW : ROW + 1, p:]
    jit = FLAGS.jit
    cache = prefilled(target, kernels, prompt, jit)
    want = decode_steps(target, kernels, cache, p, probe, jit)

    causal = np.tril(np.ones((1, k, k), bool))
    records = compare("block", run_block(target, kernels, cache, p, probe, causal, jit), want)
    records += compare("prefill", run_block(target, kernels, cache, p, probe, None, jit), want)
    mask, chain = chain_tree(np.random.default_rng(0), FLAGS.tree, k)
    tokens = np.random.default_rng(1).integers(0, target.config.vocab_size, (1, FLAGS.tree))
    tokens[0, chain] = probe[0]
    feats, logits = run_block(target, kernels, cache, p, tokens, mask[None], jit)
    records += compare("tree", (feats[:, chain], logits[:, chain]), want)
    batch_cache = prefilled(target, kernels, rows[:, :p], jit)
    feats, logits = decode_steps(target, kernels, batch_cache, p, rows[:, p:], jit)
    records += compare("batch", (feats[ROW : ROW + 1], logits[ROW : ROW + 1]), want)
    lengths = np.asarray([p if i == ROW else p - i * 7 % 23 for i in range(BATCH)])
    steps = np.stack([rows[i, n : n + k] for i, n in enumerate(lengths)])
    feats, logits = decode_steps(target, kernels, prefilled(target, kernels, rows[:, :p], jit), lengths, steps, jit)
    records += compare("ragged batch", (feats[ROW : ROW + 1], logits[ROW : ROW + 1]), want)
    meta = common.metadata() | {"exact": FLAGS.exact, "jit": jit, "dtype": FLAGS.dtype, "context": p, "tokens": k}
    records = [r | meta for r in records]
    name = "exact_probe" + ("" if FLAGS.exact else "_off") + ("" if jit else "_eager")
    common.write_results(name, records, COLUMNS, FLAGS.out_dir or None)
    summary = [r for r in records if r["layer"] == "logits" or not r["equal"]]
    print(common.markdown_table(summary, COLUMNS))
    print(jax.devices()[0].device_kind, "exact" if FLAGS.exact else "not exact")


if __name__ == "__main__":
    run_app(main)
