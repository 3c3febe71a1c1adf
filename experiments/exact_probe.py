"""Where does a token's computation depend on the call? Layer by layer, the target's residual stream of the same
tokens computed as one-token decode steps, as a causal block, as the deepest branch of a tree, and beside other
rows (issue 34).

    python -m experiments.exact_probe                  # one GPU: the shipped pair in bf16, exact numerics on
    python -m experiments.exact_probe --noexact        # the same probe without them

After a shared prefill of `--context` prompt tokens (absorbed form), the next `--tokens` tokens of the prompt are
run (a) one per call as decode steps, (b) as one causal block, (c) as the ancestor chain of a `--tree`-node tree
whose other nodes are random tokens, (d) as decode steps in row 3 of a batch of 8 whose other rows hold other
prompts. For (b)-(d) against (a), per layer: `equal` (bitwise, every token) and `max_diff`; the same for the
logits. Writes <out_dir>/exact_probe.json and .md (exact_probe_off without the exact numerics).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from ddtree_jax.errors import run_app
from ddtree_jax.sizing import cache_slots
from experiments import common, workload
from pallas_kernels.dispatch import Kernels

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_integer("context", 60, "prompt tokens prefilled before the probed tokens")
flags.DEFINE_integer("tokens", 8, "tokens probed")
flags.DEFINE_integer("tree", 17, "nodes of the tree of (c)")
flags.DEFINE_bool("exact", True, "the exact (batch- and tree-invariant) numerics")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and activations")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["case", "layer", "equal", "max_diff"]
BATCH, ROW = 8, 3


def run_block(target, kernels, cache, start: int, tokens: np.ndarray, mask: np.ndarray):
    """One forward of `tokens [B, N]` at `start` (positions start + depth from `mask [B, N, N]`) -> (residuals
    `[B, N, layers, H]`, logits `[B, N, V]`) as f32 numpy."""
    layers = tuple(range(target.config.num_hidden_layers))
    depth = mask.sum(-1) - 1
    b = tokens.shape[0]
    out = target(
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(start + depth, jnp.int32),
        cache,
        jnp.full((b,), start, jnp.int32),
        jnp.asarray(mask),
        feature_layers=layers,
        kernels=kernels,
    )
    feats = np.asarray(out.features.astype(jnp.float32)).reshape(*tokens.shape, len(layers), -1)
    return feats, np.asarray(target.logits(out.hidden, kernels=kernels))


def prefilled(target, kernels, prompts: np.ndarray):
    """The caches after the prompts `[B, P]`, and the cache capacity."""
    b, p = prompts.shape
    cache = target.init_cache(b, cache_slots(p + 128))
    mask = np.broadcast_to(np.tril(np.ones((p, p), bool)), (b, p, p))
    out = target(
        jnp.asarray(prompts, jnp.int32),
        jnp.asarray(np.broadcast_to(np.arange(p), (b, p)), jnp.int32),
        cache,
        jnp.zeros((b,), jnp.int32),
        jnp.asarray(mask),
        kernels=kernels,
    )
    return out.cache


def decode_steps(target, kernels, cache, start: int, tokens: np.ndarray):
    """tokens `[B, k]` one per call -> residuals `[B, k, layers, H]`, logits `[B, k, V]`."""
    feats, logits = [], []
    for t in range(tokens.shape[1]):
        one = np.ones((tokens.shape[0], 1, 1), bool)
        f, lg = run_block(target, kernels, cache, start + t, tokens[:, t : t + 1], one)
        feats.append(f)
        logits.append(lg)
        cache = target(
            jnp.asarray(tokens[:, t : t + 1], jnp.int32),
            jnp.full((tokens.shape[0], 1), start + t, jnp.int32),
            cache,
            jnp.full((tokens.shape[0],), start + t, jnp.int32),
            jnp.asarray(one),
            kernels=kernels,
        ).cache
    return np.concatenate(feats, 1), np.concatenate(logits, 1)


def chain_tree(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """An n-node ancestors-or-self mask whose nodes chain[0..k-1] form a path from the root, other nodes branching
    off at random: (mask `[n, n]`, chain indices `[k]`)."""
    parent = [-1]
    chain = [0]
    for i in range(1, n):
        if len(chain) < k and (rng.random() < 0.5 or n - i <= k - len(chain)):
            parent.append(chain[-1])
            chain.append(i)
        else:
            parent.append(int(rng.integers(0, i)))
    mask = np.zeros((n, n), bool)
    for i in range(n):
        if parent[i] >= 0:
            mask[i] = mask[parent[i]]
        mask[i, i] = True
    return mask, np.asarray(chain)


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
    rows = np.asarray(workload.at_length(base, p + k, BATCH))
    prompt, probe = rows[ROW : ROW + 1, :p], rows[ROW : ROW + 1, p:]
    cache = prefilled(target, kernels, prompt)
    want = decode_steps(target, kernels, cache, p, probe)

    records = compare("block", run_block(target, kernels, cache, p, probe, np.tril(np.ones((1, k, k), bool))), want)
    mask, chain = chain_tree(np.random.default_rng(0), FLAGS.tree, k)
    tokens = np.random.default_rng(1).integers(0, target.config.vocab_size, (1, FLAGS.tree))
    tokens[0, chain] = probe[0]
    feats, logits = run_block(target, kernels, cache, p, tokens, mask[None])
    records += compare("tree", (feats[:, chain], logits[:, chain]), want)
    batch_cache = prefilled(target, kernels, rows[:, :p])
    feats, logits = decode_steps(target, kernels, batch_cache, p, rows[:, p:])
    records += compare("batch", (feats[ROW : ROW + 1], logits[ROW : ROW + 1]), want)
    meta = common.metadata() | {"exact": FLAGS.exact, "dtype": FLAGS.dtype, "context": p, "tokens": k}
    records = [r | meta for r in records]
    common.write_results("exact_probe" if FLAGS.exact else "exact_probe_off", records, COLUMNS, FLAGS.out_dir or None)
    summary = [r for r in records if r["layer"] == "logits" or not r["equal"]]
    print(common.markdown_table(summary, COLUMNS))
    print(jax.devices()[0].device_kind, "exact" if FLAGS.exact else "not exact")


if __name__ == "__main__":
    run_app(main)
