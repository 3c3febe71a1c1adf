"""Full-size cost model: an AR step and a DDTree round of Kimi K2.6 at real dimensions, projected to 61 layers.

    python -m experiments.bench_round                 # on one H200
    python -m experiments.bench_round --tiny          # CPU smoke test at toy dimensions
    python -m experiments.bench_round --exact         # the exact numerics (bench_round_exact.json)

Builds the target (experiments/configs/kimi-k2.6, a copy of the released config) with RANDOM weights, INT4
routed experts, for as many layers as fit in `--mem_gb` beside the caches of the largest cell, and the Kimi
DFlash drafter (experiments/configs/kimi-k2.5-dflash; its target_layer_ids spread over the layers present). Every
weight is drawn on device by a jitted jax.random call, no host copies. The loop state is synthetic: latent and
drafter caches filled with random values up to the context length (a real prefill at 8K x 32 does not fit, and the
round's cost depends on the cache length only). Random weights route tokens near uniformly: the worst case for
distinct experts per verify (kimi_k2.md section 8).

Cells run budget-major (every B at the smallest budget first, so a `--time_limit_s` cut keeps the concurrency
trend): the DDTree round (draft + tree + verify + accept as one jit; its pieces too at the first cell) and, once
per (concurrency B, context C), one AR step; plus one MoE decoder layer alone at B x 1 and B x (budget + 1) tokens.
PROJECTION to the 61-layer model: t61 = t(L layers) + (61 - L) x t(one MoE layer). Projected tokens/s use an
acceptance length (tokens per round) from our sweep (experiments/results/sweep_budget.json, the shipped small
pair) and from the published Kimi-K2.5-DFlash figures (4.48 at budget 8; 5.3-6.4 at budget 16). A 61-layer model
does not fit one GPU: the projection is the time one device would take to stream every layer; the speedup
(a ratio) is the number to read. Results: <out_dir>/bench_round.json and .md, rewritten after every cell.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ddtree_jax import engine, sizing  # noqa: E402
from ddtree_jax.config import DFlashConfig, KimiConfig, QuantConfig, load_dflash_config, load_kimi_config  # noqa: E402
from ddtree_jax.errors import UserError, run_app
from ddtree_jax.models.dflash import DFlashDrafter  # noqa: E402
from ddtree_jax.models.kimi import KimiForCausalLM  # noqa: E402
from experiments import common, round_pieces  # noqa: E402
from pallas_kernels.dispatch import Kernels  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("target_config", str(common.RELEASED_CONFIGS / "kimi-k2.6"), "Kimi K2.6 config.json (directory)")
flags.DEFINE_string("drafter_config", str(common.RELEASED_CONFIGS / "kimi-k2.5-dflash"), "DFlash drafter config")
flags.DEFINE_integer("layers", 0, "target layers to build (0: as many as fit in --mem_gb; 3 with --tiny)")
flags.DEFINE_float("mem_gb", 122.0, "device memory for weights + caches (the rest is left for activations)")
flags.DEFINE_list("budgets", ["8", "16", "32", "64"], "DDTree budgets")
flags.DEFINE_list("concurrency", ["1", "8", "32"], "batch sizes")
flags.DEFINE_list("contexts", ["1024", "8192"], "context lengths (tokens already in the cache)")
flags.DEFINE_integer("repeats", 5, "timed calls (median)")
flags.DEFINE_bool("pieces", True, "also time the round's pieces at the first cell")
flags.DEFINE_float("time_limit_s", 0.0, "stop starting new cells after this many seconds (0: no limit)")
flags.DEFINE_string("sweep_json", str(common.RESULTS_DIR / "sweep_budget.json"), "our measured acceptance")
flags.DEFINE_bool("tiny", False, "toy dimensions (CPU smoke test of this script)")
flags.DEFINE_bool("exact", False, "the target's exact numerics (docs/exactness.md); results go to bench_round_exact")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")
flags.DEFINE_list(
    "reproject",
    [],
    "measure nothing: re-derive the projections of these bench_round.json files' measured rows from --sweep_json "
    "(e.g. after the shipped pair changed), merged into one bench_round.json that keeps the measuring run's metadata",
)

FULL_LAYERS = 61
# Published acceptance lengths for Kimi K2.5 + its DFlash drafter (dflash_ddtree.md section 5, kimi_k2.md section 9).
PUBLISHED = {
    ("ddtree", 8): [("published DDTree b8 (SGLang, K2.5)", 4.48)],
    ("ddtree", 16): [("published low b16", 5.3), ("published high b16", 6.4)],
}
COLUMNS = [
    "kind",
    "method",
    "budget",
    "concurrency",
    "context",
    "layers",
    "ms",
    "layer_ms",
    "projected_ms_61",
    "acceptance",
    "acceptance_source",
    "proj_tokens_per_s_per_request",
    "proj_tokens_per_s",
    "proj_speedup",
    "error",
]


def tiny_configs() -> tuple[KimiConfig, DFlashConfig]:
    """The real configs with toy dimensions (same structure: dense layer 0, MoE after, INT4 experts)."""
    t = dataclasses.replace(
        load_kimi_config(FLAGS.target_config),
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        quant=QuantConfig(group_size=32),
    )
    d = dataclasses.replace(
        load_dflash_config(FLAGS.drafter_config),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        mask_token_id=255,
        target_layer_ids=(1, 2),
    )
    return t, d


def nbytes(tree) -> int:
    """Bytes of the arrays in `tree` as stored in a checkpoint (INT4 half a byte)."""
    size = lambda x: int(np.prod(x.shape)) * (0.5 if x.dtype == jnp.int4 else jnp.dtype(x.dtype).itemsize)  # noqa: E731
    return int(sum(size(x) for x in jax.tree.leaves(tree)))


def bytes_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return stats.get("bytes_in_use") if stats else None


def int4_device_bytes() -> float:
    """Device bytes per INT4 value: 0.5 if XLA packs two per byte, 1.0 if not; measured with a 64 MiB-value probe
    (0.5 assumed where the backend reports no memory stats)."""
    before = bytes_in_use()
    probe = jax.block_until_ready(_drawer("int4", (8192, 8192), "int4")(jax.random.key(0)))
    after = bytes_in_use()
    del probe
    if before is None or after is None:
        return 0.5
    return 1.0 if (after - before) > 0.75 * 8192 * 8192 else 0.5


def drafter_bytes(d: DFlashConfig) -> int:
    return nbytes(nnx.state(nnx.eval_shape(lambda: DFlashDrafter(d, rngs=nnx.Rngs(0)))))


def cache_bytes(t: KimiConfig, d: DFlashConfig, layers: int, batch: int, cap: int) -> int:
    """Latent cache of `layers` target layers + the drafter's K/V cache, bf16."""
    drafter = 2 * d.num_hidden_layers * batch * cap * d.num_key_value_heads * d.head_dim
    return 2 * (layers * batch * cap * t.latent_dim + drafter)


def layers_that_fit(t: KimiConfig, d: DFlashConfig, mem: float, batch: int, cap: int, int4_bytes: float) -> int:
    """Most target layers whose weights (INT4 at `int4_bytes` per value on device) + caches, with the drafter,
    fit in `mem` bytes (at least 2)."""
    unpacked = (int4_bytes - 0.5) * sizing.expert_params(t) * t.n_routed_experts

    def size(n: int) -> float:
        c = dataclasses.replace(t, num_hidden_layers=n)
        return sizing.model_sizes(c)["weight_bytes"] + unpacked * len(c.moe_layers)

    fixed = drafter_bytes(d)
    n = 2
    while n < FULL_LAYERS and size(n + 1) + fixed + cache_bytes(t, d, n + 1, batch, cap) <= mem:
        n += 1
    return n


@functools.cache
def _drawer(kind: str, shape: tuple[int, ...], dtype: str):
    """One jitted sampler per (kind, shape, dtype): layers of one shape share a compilation."""

    def draw(k):
        if kind == "int4":
            return jax.random.randint(k, shape, -8, 8, jnp.int8).astype(jnp.int4)
        if kind == "scale":
            return jnp.full(shape, 0.02 / 4.6, dtype)
        if kind in ("zeros", "ones"):
            return (jnp.zeros if kind == "zeros" else jnp.ones)(shape, dtype)
        std = 1.0 if kind == "embed" else 0.02
        return (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)

    return jax.jit(draw)


def init_leaf(path: tuple, abstract: jax.ShapeDtypeStruct, key: jax.Array) -> jax.Array:
    """One random weight, drawn on device: INT4 in [-8, 8), expert scales ~ 0.0043 (weights std ~ 0.02), norm
    gains 1, router bias 0, embedding N(0, 1), other matrices N(0, 0.02^2)."""
    name = str(path[-1])
    if abstract.dtype == jnp.int4:
        kind = "int4"
    elif name.endswith("_s") and "experts" in map(str, path):
        kind = "scale"
    elif name == "e_score_correction_bias":
        kind = "zeros"
    elif len(abstract.shape) == 1:
        kind = "ones"
    else:
        kind = "embed" if name == "embed_tokens" else "normal"
    return _drawer(kind, tuple(abstract.shape), jnp.dtype(abstract.dtype).name)(key)


def random_model(build, seed: int):
    """`build(rngs)` -> an NNX module with every weight drawn on device by `init_leaf`, one jit per leaf."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        var.set_value(init_leaf(path, var.get_value(), jax.random.fold_in(key, i)))
    return nnx.merge(graphdef, state)


def kernels() -> Kernels:
    """The environment's kernel selection with `--exact`."""
    return dataclasses.replace(Kernels.from_env(), exact=FLAGS.exact)


def time_layer(target, batch: int, tokens: int, context: int) -> float:
    """Median seconds of the last decoder layer (an MoE layer) alone on `batch x tokens` new tokens over a
    `context`-token cache (causal mask inside the block, cache donated and threaded)."""
    layer = target.layers[len(target.layers) - 1]
    gd, st = nnx.split(layer)
    h = jax.random.normal(jax.random.key(3), (batch, tokens, target.config.hidden_size), jnp.bfloat16)
    pos = jnp.broadcast_to(context + jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
    start = jnp.full((batch,), context, jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((tokens, tokens), bool)), (batch, tokens, tokens))

    @functools.partial(jax.jit, donate_argnums=1)
    def run(st, cache):
        return nnx.merge(gd, st)(h, pos, cache, start, mask, kernels())

    cache = jax.random.normal(jax.random.key(4), (batch, context + tokens + 1, target.config.latent_dim), jnp.bfloat16)
    sec, _ = round_pieces.timed_threaded(lambda c: run(st, c[1]), (None, cache), warmup=2, repeats=FLAGS.repeats)
    return sec


def time_ar(target, base: dict) -> tuple[float, dict]:
    """One AR step at (B, C) and one layer at B x 1 tokens -> (projected 61-layer step seconds, its record)."""
    b, ctx = base["concurrency"], base["context"]
    spec = engine.GenSpec("ar", b, ctx, 64, kernels=kernels())
    times, _ = round_pieces.time_round(
        target, None, spec, round_pieces.synthetic_state(target, None, spec, ctx), repeats=FLAGS.repeats
    )
    lay = time_layer(target, b, 1, ctx)
    t61 = times["ar_step"] + (FULL_LAYERS - target.config.num_hidden_layers) * lay
    rec = {**base, "kind": "measured", "method": "ar", "budget": 1, "ms": times["ar_step"] * 1e3}
    return t61, rec | {"layer_ms": lay * 1e3, "projected_ms_61": t61 * 1e3}


def our_acceptance(path: str) -> dict[tuple[str, int], float]:
    """(method, budget) -> tokens per round at concurrency 1 from a sweep_budget.json, if present."""
    p = Path(path)
    if not p.is_file():
        return {}
    recs = json.loads(p.read_text())["records"]
    return {(r["method"], r["budget"]): r["tokens_per_round"] for r in recs if r["concurrency"] == 1}


def projections(base: dict, method: str, budget: int, t61: float, ar61: float, ours: dict) -> list[dict]:
    """One record per acceptance source: projected tokens/s and speedup over the projected AR step."""
    sources = [(f"ours (sweep, b{budget})", ours[(method, budget)])] if (method, budget) in ours else []
    sources += PUBLISHED.get((method, budget), [])
    out = []
    for label, acc in sources:
        out.append(
            {
                **base,
                "kind": "projection",
                "acceptance": acc,
                "acceptance_source": label,
                "proj_tokens_per_s_per_request": acc / t61,
                "proj_tokens_per_s": base["concurrency"] * acc / t61,
                "proj_speedup": acc * ar61 / t61,
            }
        )
    return out


def reproject(paths: list[str], sweep_json: str, out_dir: str | None) -> None:
    """Measured rows of `paths` (in order) with fresh projections: each DDTree row against the AR step of the same
    file at its (concurrency, context). The files must come from one model size."""
    sources = [json.loads(Path(p).read_text()) for p in paths]
    shapes = [{k: v for k, v in s.get("model", {}).items() if k != "init_s"} for s in sources]
    if any(m != shapes[0] for m in shapes):
        raise UserError(f"--reproject: {paths} were measured on different models")
    ours, records = our_acceptance(sweep_json), []
    for src in sources:
        measured = [r for r in src["records"] if r["kind"] == "measured"]
        ar61 = {(r["concurrency"], r["context"]): r["projected_ms_61"] / 1e3 for r in measured if r["method"] == "ar"}
        for r in measured:
            records.append(r)
            if r["method"] == "ddtree" and not r.get("error"):
                t61, ar = r["projected_ms_61"] / 1e3, ar61[r["concurrency"], r["context"]]
                records += projections(r, "ddtree", r["budget"], t61, ar, ours)
    extra = {
        "model": sources[0].get("model", {}),
        "published_acceptance": sources[0].get("published_acceptance", {}),
        "reprojected": {**common.metadata(), "sweep_json": sweep_json, "sources": [s["meta"] for s in sources]},
    }
    common.write_results("bench_round", records, COLUMNS, out_dir, extra, meta=sources[0]["meta"])
    print(common.markdown_table(records, COLUMNS))


def main(_) -> None:
    if FLAGS.reproject:
        reproject(FLAGS.reproject, FLAGS.sweep_json, FLAGS.out_dir or None)
        return
    t_full = load_kimi_config(FLAGS.target_config)
    d_full = load_dflash_config(FLAGS.drafter_config)
    tcfg, dcfg = tiny_configs() if FLAGS.tiny else (t_full, d_full)
    budgets = [int(b) for b in FLAGS.budgets]
    concs, contexts = [int(b) for b in FLAGS.concurrency], [int(c) for c in FLAGS.contexts]
    worst_cap = max(contexts) + 64 + max(budgets) + 2
    int4_bytes = int4_device_bytes()
    if FLAGS.layers or FLAGS.tiny:
        layers = FLAGS.layers or 3
    else:
        layers = layers_that_fit(tcfg, dcfg, FLAGS.mem_gb * 1e9, max(concs), worst_cap, int4_bytes)
    tcfg = dataclasses.replace(tcfg, num_hidden_layers=layers)
    k = len(dcfg.target_layer_ids)  # spread over the layers present (repeats allowed: same feature cost)
    ids = tuple(round(i * (layers - 1) / max(k - 1, 1)) for i in range(k))
    dcfg = dataclasses.replace(dcfg, num_target_layers=layers, target_layer_ids=ids)
    t0 = time.perf_counter()
    target = random_model(lambda r: KimiForCausalLM(tcfg, rngs=r), seed=0)
    drafter = random_model(lambda r: DFlashDrafter(dcfg, rngs=r), seed=1)
    jax.block_until_ready(nnx.state(target))
    sizes = {
        "layers": layers,
        "target_weight_gb": nbytes(nnx.state(target)) / 1e9,
        "drafter_weight_gb": nbytes(nnx.state(drafter)) / 1e9,
        "init_s": time.perf_counter() - t0,
        "int4_device_bytes_per_value": int4_bytes,
        "device_gb_in_use_after_init": (bytes_in_use() or 0) / 1e9,
        "full_model_weight_gb": sizing.model_sizes(t_full)["weight_bytes"] / 1e9,
        "drafter_target_layer_ids": list(dcfg.target_layer_ids),
        "tiny": FLAGS.tiny,
        "exact": FLAGS.exact,
    }
    print(sizes, flush=True)
    ours = our_acceptance(FLAGS.sweep_json)
    meta = common.metadata()
    extra = {"model": sizes, "published_acceptance": {f"{m} b{b}": v for (m, b), v in PUBLISHED.items()}}
    records, ar61 = [], {}
    name = "bench_round_exact" if FLAGS.exact else "bench_round"
    cells = [(budget, b, ctx) for budget in budgets for b in concs for ctx in contexts]  # every B early
    for n, (budget, b, ctx) in enumerate(bar := tqdm(cells, desc="bench_round")):
        bar.set_postfix_str(f"ddtree b={budget} B={b} C={ctx}")
        if FLAGS.time_limit_s and time.perf_counter() - t0 > FLAGS.time_limit_s:
            print(f"time limit: {len(cells) - n} cells not run", flush=True)
            break
        base = {"concurrency": b, "context": ctx, "layers": layers, **meta}
        rec = {**base, "kind": "measured", "method": "ddtree", "budget": budget}
        try:
            if (b, ctx) not in ar61:
                ar61[b, ctx], ar = time_ar(target, base)
                records.append(ar)
            spec = engine.GenSpec("ddtree", b, ctx, 64, budget=budget, kernels=kernels())
            s = round_pieces.synthetic_state(target, drafter, spec, ctx)
            times, out = round_pieces.time_round(
                target, drafter, spec, s, repeats=FLAGS.repeats, pieces=FLAGS.pieces and n == 0
            )
            lay = time_layer(target, b, budget + 1, ctx)
            t61 = times["round"] + (FULL_LAYERS - layers) * lay
            rec |= {
                "ms": times["round"] * 1e3,
                **{f"{k}_ms": v * 1e3 for k, v in times.items()},
                "layer_ms": lay * 1e3,
                "projected_ms_61": t61 * 1e3,
                "finite_logits": bool(np.all(np.asarray(out.bad_round) < 0)),
            }
            records.append(rec)
            records += projections(rec, "ddtree", budget, t61, ar61[b, ctx], ours)
        except Exception as exc:  # noqa: BLE001 - one failing cell (e.g. out of memory) must not lose the rest
            records.append({**rec, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        common.write_results(name, records, COLUMNS, FLAGS.out_dir or None, extra)
    common.write_results(name, records, COLUMNS, FLAGS.out_dir or None, extra)
    print(common.markdown_table(records, COLUMNS))


if __name__ == "__main__":
    run_app(main)
