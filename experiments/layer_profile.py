"""Full-size Kimi K2.6 layer profile: where one dense and one MoE layer spend an AR step and a DDTree round, piece by
piece, against the bytes each piece must read (issue 32, step 1).

    python -m experiments.layer_profile                      # on one GPU: both layouts, AR + DDTree b8, b16, B 1 and 8
    python -m experiments.layer_profile --layouts=rank       # one rank of the 8-GPU layout only
    python -m experiments.layer_profile --tiny --budgets=8 --concurrency=2 --inner=2 --repeats=1   # CPU smoke test

Model: the target of experiments/configs/kimi-k2.6 with two layers (layer 0 dense, layer 1 MoE), its embedding and
LM head, and the K2.5 DFlash drafter, random weights drawn on device (INT4 routed experts; `rank_model`). Layouts:
`single` (the whole layer on one GPU: 384 experts, top-8) and `rank` (bench_rank's share of one of --ranks GPUs at
tensor parallelism --tensor: heads, dense and shared FFN, vocab / tensor; E / ranks experts, each token routed to
--local_topk of them, as the busiest rank at T=1; its router is [H, E / ranks], 1/8 of the replicated one, and at
T > 1 it touches more experts than the busiest rank would: decode_budget.md's table).

Timing: the engine's own round (`engine.ar_round`, or `engine.spec_round` = draft -> tree -> verify -> accept) as
the body of a jitted `lax.fori_loop` that carries the whole loop state (caches, drafter cache, pending features,
the sampled tokens, keys, positions): each iteration's output is the next one's input, so no layer, LM head or
sampling is dead code. The state starts mid-generation (`round_pieces.synthetic_state`: --context tokens of random
cache). Seconds per iteration = (median of programs of 2N iterations - median of N) / N (`mla_common.per_call_time`,
N = --inner), which leaves out what a program pays once (dispatch, the copy of the un-donated state into the loop).

Every program of a layout is compiled first (on threads), and only then are the cells timed: XLA's autotuning runs
kernels on the device. Attribution: one run of the N-iteration program under `jax.profiler`; each device event is
joined with its instruction's op_name path in the compiled HLO (`device_profile`). ddtree_jax/models/kimi.py scopes
every layer (`layer_i`) and its pieces: prologue (q_a, q norm, q_b, RoPE, absorbed W_UK, kv_a, kv norm, k RoPE),
cache_write, attention (the kernel over the latent cache and its W_UV product), o_proj, router, experts (routed),
shared_expert, ffn (the dense layer's MLP); what a layer runs outside them is norms_residual (the two RMSNorms, the
FFN's residual add; o_proj adds the attention's). Outside the layers: the engine's scopes (step / draft / tree /
verify / accept, `_lm_head` where the target's LM head runs), `loop` (loop ops in no scope), `unattributed`
(instructions without metadata). Per iteration, per layer.

Bytes a piece must read, from the weight declarations (`params.param_table`) at the layout's share: its weights;
the routed experts as E x (1 - (1 - 1/E)^(k x tokens)) experts expected under uniform routing (random weights route
near uniformly; tokens = batch x tokens per row); attention the latent cache up to context + T; cache_write the
bytes it writes. Roofline = bytes / copy rate, the copy rate measured in this run as `x -> x + 1` over a --copy_mb
buffer in the same loop timing (bytes read + written). fraction = roofline / measured device time.

On a CPU the runtime's per-op events overlap: the numbers are only a smoke test there. Writes <out_dir>/<name>.json
and .md after every cell (pieces table; per-cell iteration time, device-busy time and per-kernel lists in `cells`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx
from jax import lax
from tqdm import tqdm

from ddtree_jax import engine
from ddtree_jax.config import load_dflash_config, load_kimi_config
from ddtree_jax.errors import UserError, run_app
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.models.params import param_table
from experiments import common, device_profile, rank_model, round_pieces
from experiments.layer_pieces import REST, expected_distinct, layer_kind, piece_label
from experiments.mla_common import copy_bandwidth, per_call_time

FLAGS = flags.FLAGS
flags.DEFINE_string("target_config", str(common.RELEASED_CONFIGS / "kimi-k2.6"), "Kimi K2.6 config directory")
flags.DEFINE_string("drafter_config", str(common.RELEASED_CONFIGS / "kimi-k2.5-dflash"), "DFlash drafter config")
flags.DEFINE_list("layouts", ["single", "rank"], "single: the whole layer on one GPU; rank: one rank's share")
flags.DEFINE_integer("ranks", 8, "GPUs of the deployment the rank layout is one of")
flags.DEFINE_integer("tensor", 8, "tensor-parallel size of attention / dense / shared / lm_head / drafter (rank)")
flags.DEFINE_integer("local_topk", 2, "routed experts per token on the (busiest) rank")
flags.DEFINE_list("budgets", ["8", "16"], "DDTree budgets (an AR step is always profiled)")
flags.DEFINE_list("concurrency", ["1", "8"], "batch sizes")
flags.DEFINE_integer("context", 1024, "tokens already in the caches")
flags.DEFINE_integer("inner", 16, "iterations N of the shorter timed loop (the other runs 2N)")
flags.DEFINE_integer("repeats", 7, "timed runs of each loop program (median)")
flags.DEFINE_float("copy_mb", 2048.0, "buffer of the copy-rate loop, MB (--tiny: 16)")
flags.DEFINE_integer("copy_inner", 32, "passes of the shorter copy-rate loop (the other runs twice as many)")
flags.DEFINE_integer("compile_workers", min(8, os.cpu_count() or 1), "threads compiling a layout's programs")
flags.DEFINE_bool("tiny", False, "toy dimensions (CPU smoke test of this script)")
flags.DEFINE_string("name", "layer_profile", "results file name")
flags.DEFINE_string("out_dir", "", "results directory (default experiments/results)")

LAYERS = 2  # layer 0 dense, layer 1 MoE (first_k_dense_replace = 1)
# The input norm runs inside MLA's prologue scope (its q_a and kv_a products norm their input).
PROLOGUE_WEIGHTS = (
    "input_layernorm",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "w_uk",
)
WEIGHT_PIECE = {name: "prologue" for name in PROLOGUE_WEIGHTS} | {
    "w_uv": "attention",
    "o_proj": "o_proj",
    "gate": "router",
    "e_score_correction_bias": "router",
    "post_attention_layernorm": REST,
}
COLUMNS = ["layout", "method", "budget", "concurrency", "layer_kind", "piece", "us", "kernels", "us_per_kernel"]
COLUMNS += ["MB", "roofline_us", "copy_fraction"]
CELL_COLUMNS = ["layout", "method", "budget", "concurrency", "T", "iteration_us", "busy_us", "kernels_per_iteration"]
CELL_COLUMNS += ["dense_us", "dense_kernels", "moe_us", "moe_kernels", "copy_tbps"]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One profiled program: `layout`'s model running `spec` (AR or DDTree) over `context` cached tokens."""

    layout: str
    spec: engine.GenSpec
    context: int

    @property
    def tokens(self) -> int:
        """Tokens per row through the target per iteration: 1 (AR) or budget + 1 (DDTree verify)."""
        return engine.tree_size(self.spec, 0)


def piece_bytes(target: KimiForCausalLM, drafter: DFlashDrafter | None, cell: Cell, cache_dtype) -> dict[str, float]:
    """{label: bytes one iteration must read} (cache_write: bytes written) for the pieces of every layer kind (sum
    over that kind's layers) and the LM head / drafter outside them; caches of `cache_dtype`. The models may be
    abstract (`nnx.eval_shape`)."""
    cfg, b, t = target.config, cell.spec.batch, cell.tokens
    out: dict[str, float] = {}

    def add(label: str, nbytes: float) -> None:
        out[label] = out.get(label, 0.0) + nbytes

    distinct = expected_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok * b * t)
    for path, spec in param_table(target).items():
        if path[0] == "lm_head":
            add("round/step_lm_head" if cell.spec.method == "ar" else "round/verify_lm_head", spec.nbytes)
            if drafter is not None:
                add("round/draft_lm_head", spec.nbytes)
        if path[0] != "layers":
            continue
        kind = layer_kind(cfg, int(path[1]))
        if "shared_experts" in path:
            add(f"{kind}/shared_expert", spec.nbytes)
        elif "experts" in path:
            add(f"{kind}/experts", spec.nbytes * distinct / cfg.n_routed_experts)
        else:
            add(f"{kind}/{WEIGHT_PIECE.get(str(path[-1]), 'ffn')}", spec.nbytes)
    item = jnp.dtype(cache_dtype).itemsize
    latent_row = cfg.latent_dim * item
    for i in range(cfg.num_hidden_layers):
        add(f"{layer_kind(cfg, i)}/attention", b * (cell.context + t) * latent_row)
        add(f"{layer_kind(cfg, i)}/cache_write", b * t * latent_row)
    if drafter is not None:
        d = drafter.config
        dcache = 2 * d.num_hidden_layers * b * cell.context * d.num_key_value_heads * d.head_dim * item
        add("round/draft", sum(s.nbytes for s in param_table(drafter).values()) + dcache)
    return out


def loop_program(target, drafter, cell: Cell, state: engine.LoopState, k: int) -> jax.stages.Compiled:
    """AOT-compiled `state -> state after k rounds` (`lax.fori_loop`, k static, every round the engine's own),
    called as program(target_state, drafter_state, state)."""
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter) if drafter is not None else (None, None)
    spec = cell.spec

    def run(ts, ds, s):
        t = nnx.merge(tg, ts)
        d = nnx.merge(dg, ds) if dg is not None else None

        def body(_, st: engine.LoopState) -> engine.LoopState:
            return engine.ar_round(t, spec, st) if spec.method == "ar" else engine.spec_round(t, d, spec, st)

        return lax.fori_loop(0, k, body, s)

    return jax.jit(run).lower(ts, ds, state).compile()


def copy_rate(mb: float, inner: int, repeats: int) -> dict[str, float]:
    """Copy rates of a bf16 buffer of `mb` MB (random values), bytes read + written per second: `loop`, `x -> x + 1`
    carried through a loop of k passes (`per_call_time`, the rounds' timing; an optimization barrier per pass, so an
    unrolled loop cannot fuse the passes), and `single_call` (`mla_common.copy_bandwidth`: one synced call of
    x + 1, plus PyTorch's copy_ where importable) as a cross-check."""
    x = jax.random.normal(jax.random.key(7), (int(mb * 1e6) // 2,), jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=1)
    def loop(x, k):
        return lax.fori_loop(0, k, lambda _, v: lax.optimization_barrier(v + 1), x)

    per, _ = per_call_time(lambda k: functools.partial(loop, x, k), inner, repeats)
    rates = {"loop": 2 * x.nbytes / per}
    size = max(int((mb * 1e6 / 32) ** 0.5), 1)  # copy_bandwidth copies size^2 * 16 bf16 values
    return rates | {f"single_call_{k}": v * 1e12 for k, v in copy_bandwidth(size).items()}


def build_layout(layout: str, tiny: bool) -> tuple[KimiForCausalLM, DFlashDrafter]:
    """The two-layer target and the drafter of `layout`, random weights on device."""
    if tiny:
        full, drafter = rank_model.tiny_configs(FLAGS.target_config, FLAGS.drafter_config)
    else:
        full, drafter = load_kimi_config(FLAGS.target_config), load_dflash_config(FLAGS.drafter_config)
    if layout == "single":
        rank = rank_model.rank_share(full, drafter, 1, 1, full.num_experts_per_tok)
    else:
        rank = rank_model.rank_share(full, drafter, FLAGS.ranks, FLAGS.tensor, FLAGS.local_topk)
    target, drafter = rank_model.build_models(rank, LAYERS)
    return rank_model.materialize(target, 0), rank_model.materialize(drafter, 1)


def pieces(cell: Cell, totals: dict[str, tuple[float, int]], nbytes: dict[str, float], rate: float, n: int):
    """Per-iteration rows {label: (us, kernels)} of a profile of n iterations -> piece records, one per label
    inside the loop plus a 'total' per layer kind."""
    spec = cell.spec
    base = {"layout": cell.layout, "method": spec.method, "budget": spec.budget if spec.method == "ddtree" else 0}
    base |= {"concurrency": spec.batch, "context": cell.context, "T": cell.tokens}
    rows = []
    labels = sorted(set(totals) | {k for k in nbytes if not k.startswith("round/")})
    for kind in ("dense", "moe", "round"):
        mine = [lab for lab in labels if lab.split("/")[0] == kind and lab != "round/outside_loop"]
        kind_rows = []
        for lab in mine:
            us, count = totals.get(lab, (0.0, 0))
            kind_rows.append(record(base, kind, lab.split("/")[1], us / n, count / n, nbytes.get(lab, 0.0), rate))
        if kind != "round":
            us, count = sum(r["us"] for r in kind_rows), sum(r["kernels"] for r in kind_rows)
            kind_rows.append(record(base, kind, "total", us, count, sum(r["bytes"] for r in kind_rows), rate))
        rows += kind_rows
    return rows


def record(base: dict, kind: str, piece: str, us: float, kernels: float, nbytes: float, rate: float) -> dict:
    """One piece's row: device us and kernels per iteration, bytes, roofline us at `rate` and its fraction."""
    roof = nbytes / rate * 1e6
    return base | {
        "layer_kind": kind,
        "piece": piece,
        "us": us,
        "kernels": kernels,
        "us_per_kernel": us / kernels if kernels else None,
        "bytes": nbytes,
        "MB": nbytes / 1e6,
        "roofline_us": roof,
        "copy_fraction": roof / us if us > 0 and nbytes > 0 else None,
    }


def profile_cell(cell: Cell, target, drafter, programs, state, rate: float) -> tuple[list[dict], dict]:
    """Time and profile one cell's compiled loops (programs: {k: compiled}) -> (piece records, cell summary)."""
    n = FLAGS.inner
    _, ts = nnx.split(target)
    ds = nnx.split(drafter)[1] if cell.spec.method != "ar" else None
    run = {k: functools.partial(p, ts, ds, state) for k, p in programs.items()}
    per, once = per_call_time(lambda k: run[k], n, FLAGS.repeats)
    text = programs[n].as_text()
    ops = device_profile.profiled_ops(lambda: jax.block_until_ready(run[n]()), text)
    labels = {op: piece_label(parts, target.config) for op, parts in device_profile.op_paths(text).items()}
    totals = device_profile.per_scope(ops, labels)
    totals["round/unattributed"] = totals.pop("other", (0.0, 0))
    nbytes = piece_bytes(target, drafter if cell.spec.method != "ar" else None, cell, state.cache[0].dtype)
    rows = pieces(cell, totals, nbytes, rate, n)
    per_kind = {r["layer_kind"]: r for r in rows if r["piece"] == "total"}
    parts = [r for r in rows if r["piece"] != "total"]
    kernels = device_profile.costliest(ops, labels, n=len(ops))
    summary = {k: rows[0][k] for k in ("layout", "method", "budget", "concurrency", "context", "T")} | {
        "iteration_us": per * 1e6,
        "once_ms": once * 1e3,
        "busy_us": sum(r["us"] for r in parts),
        "kernels_per_iteration": sum(r["kernels"] for r in parts),
        "outside_loop_us": totals.get("round/outside_loop", (0.0, 0))[0],
        "dense_us": per_kind["dense"]["us"],
        "dense_kernels": per_kind["dense"]["kernels"],
        "moe_us": per_kind["moe"]["us"],
        "moe_kernels": per_kind["moe"]["kernels"],
        "copy_tbps": rate / 1e12,
        "unattributed_ops": device_profile.unattributed(ops, labels),
        "kernels": [[name, us / n, c / n] for name, us, c in kernels if not name.startswith("round/outside_loop")],
    }
    return rows, summary


def cells_of(layout: str, block_size: int) -> list[Cell]:
    """The layout's cells in order: AR, then each budget, each at every concurrency."""
    runs = [("ar", 1)] + [("ddtree", int(b)) for b in FLAGS.budgets]
    new = 2 * FLAGS.inner * block_size + 2  # room for 2N rounds that accept a whole block: no row finishes early
    return [
        Cell(layout, engine.GenSpec(m, int(b), FLAGS.context, new, budget=budget), FLAGS.context)
        for m, budget in runs
        for b in FLAGS.concurrency
    ]


def run_layout(layout: str, meta: dict, records: list[dict], cells: list[dict], extra: dict, bar: tqdm) -> None:
    """Build `layout`'s model, measure its copy rate, compile every cell's two loops on threads, then time and
    profile the cells in order, writing the results after each. Nothing is timed while anything compiles: XLA's
    autotuning runs kernels on the device."""
    target, drafter = build_layout(layout, FLAGS.tiny)
    rates = copy_rate(16.0 if FLAGS.tiny else FLAGS.copy_mb, FLAGS.copy_inner, FLAGS.repeats)
    extra["copy_rates_tbps"][layout] = {k: v / 1e12 for k, v in rates.items()}
    todo = cells_of(layout, drafter.config.block_size)
    drafters = {c: drafter if c.spec.method != "ar" else None for c in todo}
    states = {c: round_pieces.synthetic_state(target, drafters[c], c.spec, c.context) for c in todo}
    ks = (FLAGS.inner, 2 * FLAGS.inner)
    bar.set_postfix_str(f"{layout}: compiling {len(todo) * len(ks)} programs")
    with concurrent.futures.ThreadPoolExecutor(FLAGS.compile_workers) as pool:
        futures = {(c, k): pool.submit(loop_program, target, drafters[c], c, states[c], k) for c in todo for k in ks}
    for c in todo:
        bar.update()
        bar.set_postfix_str(f"{layout} {c.spec.method} b={c.spec.budget} B={c.spec.batch}")
        programs = {k: futures[c, k].result() for k in ks}
        rows, summary = profile_cell(c, target, drafter, programs, states[c], rates["loop"])
        records += rows
        cells.append(summary | meta)
        path = common.write_results(FLAGS.name, records, COLUMNS, FLAGS.out_dir or None, extra, meta=meta)
        md = path.with_suffix(".md")
        cell_table = common.markdown_table(cells, CELL_COLUMNS)
        md.write_text(f"{md.read_text()}\n## Cells (per iteration)\n\n{cell_table}\n")


def main(_) -> None:
    bad = set(FLAGS.layouts) - {"single", "rank"}
    if bad:
        raise UserError(f"--layouts: {sorted(bad)} not single or rank")
    meta = common.metadata()
    records: list[dict] = []
    cells: list[dict] = []
    extra = {"cells": cells, "copy_rates_tbps": {}, "inner": FLAGS.inner, "repeats": FLAGS.repeats}
    extra |= {"context": FLAGS.context, "tiny": FLAGS.tiny, "ranks": FLAGS.ranks, "tensor": FLAGS.tensor}
    extra["local_topk"] = FLAGS.local_topk
    steps = (1 + len(FLAGS.budgets)) * len(FLAGS.concurrency)  # the cells of a layout
    with tqdm(total=len(FLAGS.layouts) * steps, desc=FLAGS.name, unit="cell") as bar:
        for layout in FLAGS.layouts:
            run_layout(layout, meta, records, cells, extra, bar)
    print(common.markdown_table([r for r in records if r["layer_kind"] != "round"], COLUMNS))
    print(common.markdown_table(cells, CELL_COLUMNS))


if __name__ == "__main__":
    run_app(main)
