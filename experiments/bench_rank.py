"""One rank's share of an 8-GPU Kimi K2.6 deployment, timed on one GPU, plus a communication model that projects
8xH200 tokens/s.

python -m experiments.bench_rank [--tensor=8] [--budgets=8,16,32] [--tiny]

The rank (layout of ddtree_jax/sharding.py on `expert=R/t,tensor=t`, R = --ranks = 8): 61 layers at full K2.6
dims with E/R = 48 routed INT4 experts per MoE layer (random weights), MLA with heads/t, dense and shared-expert
FFN inner dims /t, lm_head vocab/t, and the K2.5 DFlash drafter (6 layers) with heads, KV heads and FFN /t.
Routing on the rank: top-`--local_topk` of its 48 experts per token. Uniform routing of k=8 of 384 experts puts
8 x 48/384 = 1 expert per token on a rank on average; the slowest rank sets the pace of every psum, and with 8
ranks the busiest one gets about 2 at T=1, so the default is 2 (it overestimates slightly at larger T).

Timed with the engine pieces on the rank model: `engine.ar_round` (one AR step) and `engine.spec_round`
(draft -> vocab-sharded-style top-K tree -> verify -> walk -> compact) for each budget, plus `engine.draft`
alone; state donated, --steps back-to-back rounds (and drafts) after --warmup, per-call mean. With fewer layers measured
(--layers, or memory), `rank_ms` = draft_tree_ms + (measured_ms - draft_tree_ms) x 61 / layers: the target's
share scales with its layers, the drafter and tree build do not (the rank's lm_head is scaled too: a slight
overestimate).

Communication model (written out in the results): per target forward of T tokens, with t = --tensor,
  * t > 1: one all-reduce of `[T, H]` bf16 after o_proj in every layer, one after the dense / shared FFN down
    projection in every layer (GSPMD inserts both);
  * one psum of `[T, H]` bf16 over all R ranks after the routed experts in every MoE layer (sharding.moe_swiglu);
  * drafter (t > 1): two all-reduces of `[B, H]` per drafter layer (B = block size), two all-gathers of the
    `[D, t*K]` top-K candidates and log-Z for the tree, one for the greedy argmax over vocab-parallel logits.
An all-reduce of S bytes over p GPUs costs alpha + 2 (p-1)/p S / BW (ring), an all-gather alpha + (p-1)/p S / BW;
alpha (--alpha_us) and BW (--link_gbps, per direction per GPU; NVLink4 on H200: 450 GB/s) are stated assumptions.
Projected tokens/s = tau / (rank time + communication), tau = tokens committed per round (1 for AR; --taus for
DDTree). The default taus are the K2.6 + DFlash measurements of the team we build for (SGLang, concurrency 1):
4.48 at budget 8 and the low end of their 5.3-6.4 at budget 16; budget 32 was never measured there and takes 5.8,
the budget-16 mean, as a conservative guess. All three are assumptions until a real K2.6 drafter runs here.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from absl import flags, logging
from flax import nnx

from ddtree_jax import engine
from ddtree_jax.config import load_dflash_config, load_kimi_config
from ddtree_jax.errors import run_app
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.sampling import request_keys
from experiments import common
from experiments.rank_model import Rank, build_models, materialize, rank_share, tiny_configs

FLAGS = flags.FLAGS
flags.DEFINE_string("target_config", str(common.RELEASED_CONFIGS / "kimi-k2.6"), "Target config directory.")
flags.DEFINE_string("drafter_config", str(common.RELEASED_CONFIGS / "kimi-k2.5-dflash"), "Drafter config directory.")
flags.DEFINE_integer("ranks", 8, "GPUs of the deployment (R).")
flags.DEFINE_integer("tensor", 8, "Tensor-parallel size t of attention / dense / shared / lm_head / drafter.")
flags.DEFINE_integer("local_topk", 2, "Routed experts per token on the measured (busiest) rank.")
flags.DEFINE_list("budgets", ["8", "16", "32"], "DDTree budgets.")
flags.DEFINE_integer("prompt_len", 512, "Context length before the timed rounds.")
flags.DEFINE_integer("warmup", 3, "Untimed rounds.")
flags.DEFINE_integer("steps", 20, "Timed rounds.")
flags.DEFINE_float("mem_gb", 135.0, "Device memory budget; layers are reduced (and said so) if the rank exceeds it.")
flags.DEFINE_float("alpha_us", 8.0, "Latency of one small collective on NVLink (assumption).")
flags.DEFINE_float("link_gbps", 450.0, "NVLink bandwidth per direction per GPU, GB/s (assumption: H200 NVLink4).")
flags.DEFINE_list("taus", ["8:4.48", "16:5.3", "32:5.8"], "budget:tau assumed tokens per DDTree round.")
flags.DEFINE_integer(
    "layers", 0, "Measure only this many target layers and scale the target's share to 61 (0: as many as fit)."
)
flags.DEFINE_bool("tiny", False, "Tiny dims on CPU: a smoke test of this script.")
flags.DEFINE_string("out_dir", "", "Results directory (default experiments/results).")

PUBLISHED = [
    {"system": "vLLM, 8xH100, AR single stream", "tok_s": 112.0},
    {"system": "SGLang, 8xB300, AR", "tok_s": 133.0},
    {"system": "SGLang, 8xB300, DDTree budget 8", "tok_s": 303.0},
]


def leaf_bytes(model: nnx.Module) -> int:
    total = 0
    for _, var in nnx.to_flat_state(nnx.state(model)):
        x = var.get_value()
        total += x.size * jnp.dtype(x.dtype).itemsize if x.dtype != jnp.int4 else x.size // 2
    return total


def memory_estimate(rank: Rank, layers: int, cache_len: int) -> dict[str, float]:
    """GB on the rank: params (int4 packed 2 per byte), the replicated full embedding (the bench model holds
    only vocab/t rows of it), latent + drafter caches, and 4 GB of workspace."""
    target, drafter = build_models(rank, layers)
    c, d = rank.target, rank.drafter
    embed_extra = (rank.full.vocab_size - c.vocab_size) * c.hidden_size * 2
    caches = layers * cache_len * c.latent_dim * 2 + 2 * d.num_hidden_layers * cache_len * d.num_key_value_heads * (
        d.head_dim * 2
    )
    parts = {
        "target_params": leaf_bytes(target),
        "drafter_params": leaf_bytes(drafter),
        "embed_replicated_extra": embed_extra,
        "caches": caches,
        "workspace": 4 << 30,
    }
    return {k: v / 1e9 for k, v in parts.items()} | {"total": sum(parts.values()) / 1e9}


def fit_layers(rank: Rank, cache_len: int) -> tuple[int, dict[str, float]]:
    """--layers if set, else all layers if they fit --mem_gb, else the most that fit (logged and recorded)."""
    layers = FLAGS.layers or rank.full.num_hidden_layers
    est = memory_estimate(rank, layers, cache_len)
    while est["total"] > FLAGS.mem_gb and layers > 2:
        layers -= 1
        est = memory_estimate(rank, layers, cache_len)
    if layers < rank.full.num_hidden_layers and not FLAGS.layers:
        logging.warning(
            "rank needs more than %.0f GB: measuring %d of %d layers", FLAGS.mem_gb, layers, rank.full.num_hidden_layers
        )
    return layers, est


def time_rounds(step, state, warmup: int, steps: int):
    """Mean seconds per call of `state = step(state)` (donated), back to back; returns (seconds, state).
    At least two warm-up calls: prefill's state has a weak-typed leaf, so the second call compiles again."""
    for _ in range(max(warmup, 2)):
        state = step(state)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state = step(state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / steps, state


def measure(target: KimiForCausalLM, drafter: DFlashDrafter, budgets: list[int]) -> list[dict]:
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter)
    rounds = FLAGS.warmup + FLAGS.steps
    d = drafter.config.num_draft
    records = []
    for method, budget in [("ar", 1)] + [("ddtree", b) for b in budgets]:
        spec = engine.GenSpec(method, 1, FLAGS.prompt_len, rounds * (d + 1) + 2, budget=budget)

        def start(ts, ds, prompts, spec=spec):
            t, dr = nnx.merge(tg, ts), nnx.merge(dg, ds)
            plen = jnp.full((1,), FLAGS.prompt_len, jnp.int32)
            return engine.prefill(t, dr if spec.method != "ar" else None, spec, prompts, plen, request_keys(0, [0]))

        def round_(ts, ds, s, spec=spec):
            t, dr = nnx.merge(tg, ts), nnx.merge(dg, ds)
            return engine.ar_round(t, spec, s) if spec.method == "ar" else engine.spec_round(t, dr, spec, s)

        prompts = jax.random.randint(jax.random.key(1), (1, FLAGS.prompt_len), 0, target.config.vocab_size - 1)
        state = jax.jit(start)(ts, ds, prompts)
        step = jax.jit(round_, donate_argnums=2)
        sec, state = time_rounds(lambda s, step=step: step(ts, ds, s), state, FLAGS.warmup, FLAGS.steps)
        rec = {"method": method, "budget": budget if method == "ddtree" else 0, "T": engine.tree_size(spec, d)}
        rec["rank_ms"] = 1e3 * sec
        if method == "ddtree":

            def draft_only(ts, ds, s, spec=spec):
                t, dr = nnx.merge(tg, ts), nnx.merge(dg, ds)
                logits, _ = engine.draft(t, dr, s, spec.kernels)
                return engine.build_trees(spec, dr, logits, s.root)[0].tokens

            fn = jax.jit(draft_only)
            timed = functools.partial(fn, ts, ds, state)
            rec["draft_tree_ms"] = 1e3 * common.time_back_to_back(timed, FLAGS.warmup, FLAGS.steps)
        records.append(rec)
        logging.info("%s", rec)
    return records


def collective_s(kind: str, nbytes: float, p: int) -> float:
    """Ring all-reduce / all-gather over p GPUs: alpha + (2 or 1) (p-1)/p bytes / BW."""
    if p == 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    return FLAGS.alpha_us * 1e-6 + factor * (p - 1) / p * nbytes / (FLAGS.link_gbps * 1e9)


def comm_model(rank: Rank, tokens: int, speculative: bool) -> dict[str, float]:
    """Collectives of one round (target forward of `tokens` tokens, + drafter and tree when speculative)."""
    c, d, t, r = rank.full, rank.drafter_full, FLAGS.tensor, FLAGS.ranks
    act = tokens * c.hidden_size * 2  # [T, H] bf16
    n_moe = len(c.moe_layers)
    items = {
        "attn_all_reduce": (c.num_hidden_layers if t > 1 else 0, "all_reduce", act, t),
        "ffn_all_reduce": (c.num_hidden_layers if t > 1 else 0, "all_reduce", act, t),
        "expert_psum": (n_moe, "all_reduce", act, r),
        "argmax_all_gather": (1 if t > 1 else 0, "all_gather", tokens * 8 * t, t),
    }
    if speculative:
        block = d.block_size * d.hidden_size * 2
        items["drafter_all_reduce"] = (2 * d.num_hidden_layers if t > 1 else 0, "all_reduce", block, t)
        k = tokens - 1  # top-K per depth, K = budget: [D, t*K] (f32 log-prob + int32 id)
        items["topk_all_gathers"] = (2 if t > 1 else 0, "all_gather", d.num_draft * k * 8 * t, t)
    out = {f"{k}_count": float(n) for k, (n, _, _, _) in items.items()}
    out |= {f"{k}_bytes": float(b) for k, (_, _, b, _) in items.items()}
    out["comm_ms"] = 1e3 * sum(n * collective_s(kind, b, p) for n, kind, b, p in items.values())
    out["collectives"] = float(sum(n for n, _, _, _ in items.values()))
    return out


def project(rank: Rank, records: list[dict], layers: int) -> list[dict]:
    taus = {int(b): float(v) for b, v in (x.split(":") for x in FLAGS.taus)}
    scale = rank.full.num_hidden_layers / layers  # > 1 only if fewer layers were measured
    rows = []
    for rec in records:
        spec = rec["method"] == "ddtree"
        comm = comm_model(rank, rec["T"], spec)
        tau = taus.get(rec["budget"], float("nan")) if spec else 1.0
        fixed = rec.get("draft_tree_ms", 0.0)  # drafter + tree build do not grow with the target's layers
        rank_ms = fixed + (rec["rank_ms"] - fixed) * scale
        round_ms = rank_ms + comm["comm_ms"]
        rows.append(
            {
                "method": rec["method"],
                "budget": rec["budget"],
                "T": rec["T"],
                "rank_ms": rank_ms,
                "measured_ms": rec["rank_ms"],
                "comm_ms": comm["comm_ms"],
                "collectives": comm["collectives"],
                "round_ms": round_ms,
                "tau": tau,
                "tok_s_8gpu": 1e3 * tau / round_ms,
            }
            | comm
        )
    return rows


def main(argv):
    del argv
    budgets = [int(b) for b in FLAGS.budgets]
    full, drafter = (
        tiny_configs(FLAGS.target_config, FLAGS.drafter_config)
        if FLAGS.tiny
        else (
            load_kimi_config(FLAGS.target_config),
            load_dflash_config(FLAGS.drafter_config),
        )
    )
    rank = rank_share(full, drafter, FLAGS.ranks, FLAGS.tensor, FLAGS.local_topk)
    cache_len = FLAGS.prompt_len + (FLAGS.warmup + FLAGS.steps + 1) * drafter.block_size + max(budgets) + 4
    layers, mem = fit_layers(rank, cache_len)
    logging.info("rank memory estimate (GB): %s; layers %d", mem, layers)
    target, rank_drafter = build_models(rank, layers)
    target, rank_drafter = materialize(target, 0), materialize(rank_drafter, 1)
    records = measure(target, rank_drafter, budgets)
    rows = project(rank, records, layers)
    for row, rec in zip(rows, records, strict=True):
        row["draft_tree_ms"] = rec.get("draft_tree_ms", float("nan"))
    layout = {
        "ranks": FLAGS.ranks,
        "tensor": FLAGS.tensor,
        "mesh": f"expert={FLAGS.ranks // FLAGS.tensor},tensor={FLAGS.tensor}",
        "layers_measured": layers,
        "layers_full": full.num_hidden_layers,
        "experts_per_rank": rank.target.n_routed_experts,
        "heads_per_rank": rank.target.num_attention_heads,
        "local_topk": FLAGS.local_topk,
        "tiny": FLAGS.tiny,
    }
    assumptions = {"alpha_us": FLAGS.alpha_us, "link_gbps": FLAGS.link_gbps, "taus": FLAGS.taus}
    name = "bench_rank_tiny" if FLAGS.tiny else f"bench_rank_t{FLAGS.tensor}"
    columns = ["method", "budget", "T", "measured_ms", "rank_ms", "draft_tree_ms", "collectives", "comm_ms"]
    columns += ["round_ms", "tau", "tok_s_8gpu"]
    extra = {"layout": layout, "memory_gb": mem, "assumptions": assumptions, "published": PUBLISHED}
    path = common.write_results(name, rows, columns, out_dir=FLAGS.out_dir or None, extra=extra)
    md = path.with_suffix(".md")
    md.write_text(
        md.read_text()
        + f"\nlayout: {layout}\n\nmemory estimate (GB): { {k: round(v, 2) for k, v in mem.items()} }\n\n"
        + f"assumptions: {assumptions}\n\npublished:\n\n{common.markdown_table(PUBLISHED, ['system', 'tok_s'])}\n"
    )
    print(md.read_text())


if __name__ == "__main__":
    run_app(main)
