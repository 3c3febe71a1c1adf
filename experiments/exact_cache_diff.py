"""Where does a request's computation in the engine's own AR program depend on the batch it shares? (issue 34)

    python -m experiments.exact_cache_diff --out_dir=$OUT          # one GPU: the shipped target in bf16, exact on
    python -m experiments.exact_cache_diff --num_prompts=2 --contexts=40 --max_new_tokens=3 --dtype=float32 \\
        --nohlo                                                    # CPU smoke test

`exact_probe` runs the target's forward in programs of its own, capturing every layer's residual; this runs the
engine's prefill and decode loop (`engine.prefill`, `engine.ar_round`, as `engine.generate` composes them, compiled
with `engine.compiler_options`) and returns the final latent caches, whose entry at (layer l, position t) is a
function of the residual stream entering layer l at token t. For each case (`ragged`: request i cut i * 7 % 23
tokens short of each of `--contexts`, as `exact_check` batches them; `uniform`: all that long) every request runs
alone (batch 1) and all of them as one batch. Per request: `tokens_equal`, and the first position where any layer's
cache entry differs, as `first_pos` relative to the prompt's end (negative: the prefill wrote it, k >= 0: the k-th
decode step), the layers differing there and how many positions differ in all. With --hlo each distinct program's
optimized HLO goes to <out_dir>/hlo/<case>_p<padded prompt>_b<batch>.txt.gz. Writes <out_dir>/exact_cache_diff.json
and .md.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from ddtree_jax import engine
from ddtree_jax.api import Generator, padded_prompts
from ddtree_jax.calibration import at_length
from ddtree_jax.errors import run_app
from ddtree_jax.sampling import request_keys
from experiments import common, workload

FLAGS = flags.FLAGS
flags.DEFINE_string("target", str(workload.SHIPPED_TARGET), "target checkpoint directory")
flags.DEFINE_string("prompts", str(workload.DEMO_PROMPTS), "held-out prompts (JSON Lines)")
flags.DEFINE_list("contexts", ["60", "1024"], "prompt lengths before the ragged cut")
flags.DEFINE_integer("num_prompts", 8, "requests, also the batch size")
flags.DEFINE_integer("max_new_tokens", 16, "tokens generated per request")
flags.DEFINE_bool("exact", True, "the exact (batch- and tree-invariant) numerics")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights and activations")
flags.DEFINE_bool("hlo", True, "write each program's optimized HLO")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

COLUMNS = ["context", "case", "request", "prompt_len", "tokens_equal", "first_pos", "layers_at_first"]
COLUMNS += ["positions_differ"]


def compile_final_state(target, spec: engine.GenSpec):
    """`engine.generate`'s AR prefill and loop for `spec`, returning (tokens `[B, max_new + 1]`, n_out `[B]`, the
    latent caches) instead of `GenOut`; and the text of the optimized program."""
    graph, state = nnx.split(target)

    def run(t_state, prompts, prompt_len, keys):
        t = nnx.merge(graph, t_state)
        s = engine.prefill(t, None, spec, prompts, prompt_len, keys)
        s = jax.lax.while_loop(lambda st: ~jnp.all(st.done), lambda st: engine.ar_round(t, spec, st), s)
        return s.out, s.n_out, s.cache

    compiled = jax.jit(run).lower(state, *engine.call_shapes(spec)).compile(engine.compiler_options(spec.kernels))
    return (lambda *args: compiled(state, *args)), compiled.as_text()


def run_rows(gen, rows: list[list[int]], indices: list[int], programs: dict, name: str):
    """The requests `rows` as one batch (request ids `indices`) -> (tokens per row, caches as numpy `[layers, B, L,
    D]`)."""
    settings = {"method": "ar", "budget": None, "temperature": 0.0, "ignore_eos": True}
    spec = gen.spec_for(rows, max_new_tokens=FLAGS.max_new_tokens, **settings)
    if spec not in programs:
        programs[spec] = compile_final_state(gen.target, spec)
        if FLAGS.hlo:
            path = Path(FLAGS.out_dir or common.RESULTS_DIR) / "hlo" / f"{name}_p{spec.prompt_len}_b{spec.batch}.txt.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(path, "wt") as f:
                f.write(programs[spec][1])
    out, n_out, cache = programs[spec][0](*padded_prompts(rows, spec.prompt_len), request_keys(0, indices))
    out, n_out = np.asarray(out), np.asarray(n_out)
    caches = np.stack([np.asarray(c.astype(jnp.float32)) for c in cache])
    return [out[i, : n_out[i]].tolist() for i in range(len(rows))], caches


def compare(case: str, i: int, n: int, alone, together, row: int) -> dict:
    """Request i (prompt length n) alone vs as row `row` of the batch: its tokens and the cache slots written."""
    (tok_a, cache_a), (tok_b, cache_b) = alone, together
    written = n + FLAGS.max_new_tokens - 1
    a, b = cache_a[:, 0, :written], cache_b[:, row, :written]
    differ = np.any(a != b, axis=-1)  # [layers, positions]
    positions = np.flatnonzero(differ.any(0))
    first = int(positions[0]) if positions.size else None
    return {
        "case": case,
        "request": i,
        "prompt_len": n,
        "tokens_equal": tok_a[0] == tok_b[row],
        "first_pos": None if first is None else first - n,
        "layers_at_first": None if first is None else np.flatnonzero(differ[:, first]).tolist(),
        "positions_differ": int(positions.size),
    }


def main(_) -> None:

    gen = Generator.load(FLAGS.target, dtype=jnp.dtype(FLAGS.dtype), exact=FLAGS.exact)
    base, _ = workload.load_prompts(gen, FLAGS.prompts, FLAGS.num_prompts)
    programs: dict = {}
    meta = common.metadata() | {"exact": FLAGS.exact, "dtype": FLAGS.dtype, "max_new_tokens": FLAGS.max_new_tokens}
    records = []
    for context in map(int, FLAGS.contexts):
        uniform = [list(r) for r in at_length(base, context, FLAGS.num_prompts)]
        cases = {"ragged": [r[: len(r) - i * 7 % 23] for i, r in enumerate(uniform)], "uniform": uniform}
        for case, rows in cases.items():
            together = run_rows(gen, rows, list(range(len(rows))), programs, case)
            for i, r in enumerate(rows):
                alone = run_rows(gen, [r], [i], programs, case)
                records.append({"context": context} | compare(case, i, len(r), alone, together, i) | meta)
            common.write_results("exact_cache_diff", records, COLUMNS, FLAGS.out_dir or None)
    print(common.markdown_table(records, COLUMNS))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    run_app(main)
