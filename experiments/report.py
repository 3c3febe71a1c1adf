"""Build <results_dir>/REPORT.md (tables + PNG plots) from whatever result JSON files are present.

    python -m experiments.report [--results_dir=experiments/results]

Reads sweep_{budget,concurrency,context}.json, breakdown.json, bench_round.json and the kernel benchmarks
(bench_moe, bench_mla: their markdown tables are included as they are). Missing files are skipped and listed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import flags  # noqa: E402

from ddtree_jax.errors import run_app  # noqa: E402
from experiments import common  # noqa: E402
from experiments.workload import SHIPPED_TARGET  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("results_dir", str(common.RESULTS_DIR), "where the JSON records are; REPORT.md goes here too")

SWEEP_COLS = ["method", "budget", "concurrency", "context", "tokens_per_round", "tokens_per_s"]
SWEEP_COLS += ["tokens_per_s_per_request", "speedup", "chosen", "correct", "rows_identical"]
BREAKDOWN_PARTS = ("draft", "tree", "verify", "accept", "step", "other", "idle")
PUBLISHED = [
    {
        "system": "SGLang stack, Kimi + DFlash/DDTree (as cited in issue 7)",
        "hardware": "8x B300",
        "number": "303 vs 133 tok/s at concurrency 1 (2.28x)",
    },
    {
        "system": "same stack, DDTree (as cited in issue 7)",
        "hardware": "8x B300",
        "number": "acceptance 4.48 at budget 8",
    },
    {
        "system": "Kimi-K2.5-DFlash model card (chain, block 8)",
        "hardware": "SGLang",
        "number": "acceptance 3.7 (MT-Bench) - 5.5 (Math500)",
    },
    {
        "system": "DDTree paper, Qwen3-Coder-30B-A3B, HumanEval, T=0",
        "hardware": "HF eager, 1 GPU",
        "number": "8.22x over AR (DFlash 6.09x), acceptance 10.72",
    },
    {"system": "vLLM TP8, Kimi K2.5 INT4, no spec-dec", "hardware": "8x H100", "number": "~112 tok/s single stream"},
]


def load(d: Path, name: str) -> dict[str, Any] | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def meta_line(payload: dict) -> str:
    m = payload["meta"]
    return f"_{m['device']} ({m['backend']}), jax {m['jax_version']}, commit {m['commit'][:10]}, {m['date']}_"


def run_label(payload: dict) -> str:
    """A records file's commit and UTC minute, e.g. "c69b2aa 2026-12-06T08:44"."""
    m = payload["meta"]
    return f"{m['commit'][:7]} {m['date'][:16]}"


def save(fig, d: Path, name: str) -> str:
    (d / "plots").mkdir(exist_ok=True)
    fig.tight_layout()
    fig.savefig(d / "plots" / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"![{name}](plots/{name}.png)"


def by_method(records: list[dict], method: str) -> list[dict]:
    return [r for r in records if r["method"] == method and "error" not in r]


def budget_section(p: dict, d: Path) -> list[str]:
    recs = p["records"]
    ar, chain, tree = by_method(recs, "ar"), by_method(recs, "dflash"), by_method(recs, "ddtree")
    out = ["## Budget sweep (concurrency 1)", meta_line(p), common.markdown_table(recs, SWEEP_COLS)]
    if tree:
        best = max(tree, key=lambda r: r["tokens_per_s"])
        line = f"**Best DDTree budget: {best['budget']}**, {best['tokens_per_s']:.1f} tok/s, {best['speedup']:.2f}x AR"
        if ar:
            line += f"; AR {ar[0]['tokens_per_s']:.1f} tok/s"
        if chain:
            margin = best["tokens_per_s"] / chain[0]["tokens_per_s"] - 1
            line += f"; DFlash chain {chain[0]['tokens_per_s']:.1f} tok/s ({chain[0]['speedup']:.2f}x; best DDTree "
            line += f"{100 * margin:+.1f}% over it)"
        beats = all(best["tokens_per_s"] > r["tokens_per_s"] for r in ar + chain)
        out.append(line + (". DDTree beats both." if beats else ". DDTree does NOT beat both here."))
        for key, label, name in [
            ("tokens_per_round", "acceptance length (tokens / round)", "acceptance_vs_budget"),
            ("tokens_per_s", "tokens / s", "tokens_per_s_vs_budget"),
        ]:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.plot([r["budget"] for r in tree], [r[key] for r in tree], "o-", label="DDTree")
            for r, style in [(c, "s") for c in chain] + [(a, "^") for a in ar]:
                ax.axhline(r[key], ls="--", lw=1, label=f"{r['method']}", color="C1" if style == "s" else "C2")
            ax.set_xscale("log", base=2)
            ax.set_xticks([r["budget"] for r in tree], [str(r["budget"]) for r in tree])
            ax.set(xlabel="budget (tree nodes)", ylabel=label)
            ax.legend()
            out.append(save(fig, d, name))
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for r in [best] + chain:
            hist = r["accept_hist"]
            total = max(sum(hist), 1)
            ax.plot(range(1, len(hist) + 1), [h / total for h in hist], "o-", label=f"{r['method']} b={r['budget']}")
        ax.set(xlabel="tokens committed in a round", ylabel="fraction of rounds")
        ax.legend()
        out.append(save(fig, d, "acceptance_histogram"))
    return out


def concurrency_section(p: dict, d: Path) -> list[str]:
    recs = p["records"]
    out = ["## Concurrency sweep", meta_line(p), common.markdown_table(recs, SWEEP_COLS)]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for method in ("dflash", "ddtree"):
        for budget in sorted({r["budget"] for r in by_method(recs, method)}):
            rs = [r for r in by_method(recs, method) if r["budget"] == budget]
            ax.plot([r["concurrency"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"{method} b={budget}")
    if auto := by_method(recs, "auto"):
        ax.plot([r["concurrency"] for r in auto], [r["speedup"] for r in auto], "k*-", label="auto")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    concs = sorted({r["concurrency"] for r in recs})
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.set(xlabel="concurrency (batch rows)", ylabel="speedup over AR (aggregate tok/s)")
    ax.legend()
    out.append(save(fig, d, "speedup_vs_concurrency"))
    return out


def context_section(p: dict, d: Path) -> list[str]:
    recs = p["records"]
    out = ["## Context sweep (concurrency 1)", meta_line(p)]
    clamped = [r for r in recs if r.get("context_clamped")]
    if clamped:
        limit = recs[0].get("max_position_embeddings", "?")
        asked = sorted({r["context_requested"] for r in clamped})
        out.append(
            f"Contexts {asked} exceed this model's max_position_embeddings ({limit}) and were clamped: every requested "
            "context above the limit (max_position_embeddings - new tokens - D - 2, rounded down to 32) runs as the "
            "one cell at that limit."
        )
    out.append(common.markdown_table(recs, SWEEP_COLS))
    return out


def breakdown_section(p: dict, d: Path) -> list[str]:
    recs = p["records"]
    cols = ["method", "budget", "tokens_per_round", "round_ms", *[f"{k}_ms" for k in BREAKDOWN_PARTS]]
    out = [
        "## Round-time breakdown",
        meta_line(p),
        "Device time per round of each piece inside the generation program (profiler, kernels joined to the "
        "engine's named scopes), `other` = loop ops outside the pieces, `idle` = the rest of the round (launch gaps, "
        "the loop's per-round host sync). XLA runs the loop body as one CUDA graph, so kernels follow each other "
        "without gaps; the profiler stretches graph kernels slightly, which can make `idle` a little negative.",
        common.markdown_table(recs, cols + ["kernels_per_round"]),
    ]
    if recs:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        labels = [f"{r['method']}\nb={r['budget']}" for r in recs]
        bottom = [0.0] * len(recs)
        for part in BREAKDOWN_PARTS:
            vals = [max(r[f"{part}_ms"], 0.0) for r in recs]
            ax.bar(labels, vals, bottom=bottom, label=part)
            bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
        ax.set(ylabel="ms per round")
        ax.legend(fontsize=7)
        out.append(save(fig, d, "round_breakdown"))
        top = max(recs, key=lambda r: (r["method"] == "ddtree", r["budget"]))
        share = {k: top[f"{k}_ms"] / top["round_ms"] for k in BREAKDOWN_PARTS}
        main = max(share, key=share.get)
        out.append(
            f"For {top['method']} at budget {top['budget']} the largest part of the round is **{main}** "
            f"({100 * share[main]:.0f}%), over {top['kernels_per_round']:.0f} kernels per round. Device time per "
            "kernel, per method: "
            + ", ".join(
                f"{r['method']} b{r['budget']} {1e3 * r['round_ms'] / r['kernels_per_round']:.2f} us"
                for r in recs
                if r["kernels_per_round"]
            )
            + ": a round costs about what its kernel count costs."
        )
        tops = [
            {"method": r["method"], "budget": r["budget"], "kernel": name, "us_per_round": us, "launches": n}
            for r in recs
            for name, us, n in r.get("top_kernels", [])[:4]
        ]
        if tops:
            out += ["The four costliest kernels of each round (scope:kernel, device us and launches per round):"]
            out.append(common.markdown_table(tops, ["method", "budget", "kernel", "us_per_round", "launches"]))
        chain = next((r for r in recs if r["method"] == "dflash"), None)
        for r in (r for r in recs if r["method"] == "ddtree" and chain is not None):
            out.append(
                f"DDTree b{r['budget']} vs the chain: +{r['round_ms'] - chain['round_ms']:.3f} ms per round, "
                f"+{r['kernels_per_round'] - chain['kernels_per_round']:.0f} kernels, tree build "
                f"{r['tree_ms']:.3f} ms of device time; tokens per round {r['tokens_per_round']:.2f} vs "
                f"{chain['tokens_per_round']:.2f}."
            )
    return out


def bench_round_section(p: dict) -> list[str]:
    recs = p["records"]
    model = p.get("model", {})
    measured = [r for r in recs if r.get("kind") == "measured"]
    proj = [r for r in recs if r.get("kind") == "projection"]
    cols = ["method", "budget", "concurrency", "context", "ms", "layer_ms", "projected_ms_61", "error"]
    out = [
        "## Full-size cost model (Kimi K2.6 dims, random INT4 weights)",
        meta_line(p),
        f"Built {model.get('layers')} of 61 layers ({model.get('target_weight_gb', 0):.1f} GB target + "
        f"{model.get('drafter_weight_gb', 0):.1f} GB drafter; full model {model.get('full_model_weight_gb', 0):.0f} GB)"
        + (" at TOY dimensions (--tiny)." if model.get("tiny") else "."),
        "### Measured",
        common.markdown_table(measured, cols),
        "### PROJECTION to 61 layers (not a measurement)",
        "t61 = t(L layers) + (61 - L) x t(one MoE layer); tokens/s = acceptance / t61. Acceptance from our small "
        "pair's sweep and from published Kimi figures. Random weights route near uniformly (worst case for experts "
        "touched per verify).",
        common.markdown_table(
            proj,
            ["budget", "concurrency", "context", "acceptance", "acceptance_source", "projected_ms_61"]
            + ["proj_tokens_per_s_per_request", "proj_tokens_per_s", "proj_speedup"],
        ),
    ]
    return out


def tagged_sweeps(d: Path, tag: str) -> list[dict]:
    """The sweep records files whose name carries `tag` (sweep_<axis>_<tag>...), by name."""
    return [json.loads(p.read_text()) for p in sorted(d.glob(f"sweep_*_{tag}*.json")) if "_calibration" not in p.stem]


def auto_section(sweeps: list[dict]) -> list[str]:
    """`auto` in every sweep cell (the matrix's and the sweep_<axis>_auto runs' records files): what it chose over
    the cell's calls, its speedup over AR and its rate against the best fixed method."""
    auto = [r for p in sweeps for r in p["records"] if r["method"] == "auto"]
    if not auto:
        return []
    slower = [r for r in auto if r["speedup"] < 1]
    off = [r for r in auto if r["vs_best"] < 0.95]
    cols = ["axis", "concurrency", "context", "repeats", "chosen", "tokens_per_round", "speedup", "vs_best", "correct"]
    return [
        "## auto: the program chosen per batch from the cost table",
        f"`auto` is at least AR's rate in {len(auto) - len(slower)} of {len(auto)} cells (lowest "
        f"{min(r['speedup'] for r in auto):.3f}x) and within 5% of the best fixed method in {len(auto) - len(off)} "
        f"(lowest {min(r['vs_best'] for r in auto):.3f} of it). `vs_best`: auto's tok/s / the best fixed method's; "
        "`chosen`: the programs it ran over the cell's calls. Where it chose `ar` it ran AR's own program, so its "
        "distance from 1.0x there is the timing noise of one program measured twice.",
        common.markdown_table(auto, cols),
    ]


def exact_section(d: Path) -> list[str]:
    """The exact numerics (`--exact`): the sweeps run with the switch on (every cell should be `correct`), and each
    exact_check* record's identical cells, its cost at batch 1 (tokens/s on over off, same run) and `cost_table`."""
    runs = tagged_sweeps(d, "exact")
    recs = [r for p in runs for r in p["records"]]
    checks = [(f.stem, p) for f in sorted(d.glob("exact_check*.json")) if (p := load(d, f.stem)) and p["records"]]
    if not recs and not checks:
        return []
    out = ["## Exact numerics (`--exact`): speculative output bit-identical to AR"]
    if recs:
        good = sum(r["correct"] for r in recs)
        out += [
            f"Sweeps with the switch on ({', '.join(meta_line(p) for p in runs[:1])}): {good} of {len(recs)} cells "
            "give every row AR's tokens.",
            common.markdown_table(
                recs, ["axis", "method", "budget", "concurrency", "context", "tokens_per_s", "speedup", "correct"]
            ),
        ]
    for name, check in checks:
        on = [r for r in check["records"] if r["exact"] == "on"]
        one = [r for r in on if r["batch"] == 1 and r["vs_off"] is not None]
        cost = ", ".join(f"{r['method']} b{r['budget']} ctx {r['context']} {r['vs_off']:.2f}" for r in one)
        out.append(
            f"`{name}` ({meta_line(check)}): {sum(r['rows_differ'] == 0 for r in on)} of {len(on)} cells "
            "with no row differing from batch-1 AR; cost at batch 1, tokens/s on over off: "
            + (cost or "not measured (no batch-1 cell ran without the switch)")
        )
        out += cost_table(check["records"])
    return out + segment_table(d)


def cost_table(recs: list[dict]) -> list[str]:
    """exact_check's cells measured on both sides of the switch: tokens/s with it, the ratio to without and its two
    factors where the record has them (acceptance on over off, round time off over on), acceptance on over off on the
    requests that generate the same text on both sides (and their count), and the rows that differ from batch-1 AR on
    each side."""

    def cell(r: dict) -> tuple:
        return r["context"], r["batch"], r["method"], r["budget"]

    off = {cell(r): r for r in recs if r["exact"] == "off"}
    on = [r for r in recs if r["exact"] == "on" and r["vs_off"] is not None and cell(r) in off]
    rows = [{**r, "rows_differ_off": off[cell(r)]["rows_differ"]} for r in on]
    cols = ["context", "batch", "method", "budget", "tokens_per_s", "vs_off", "accept_vs_off", "round_vs_off"]
    cols += ["same_text_rows", "accept_same_text_vs_off", "rows_differ", "rows_differ_off"]
    return [common.markdown_table(rows, cols)] if rows else []


def segment_table(d: Path) -> list[str]:
    """The exact MLA kernel's segment length (`breakdown --exact --exact_segment=N`, records
    breakdown_exact_seg<N>[_c32]): round time per method and batch, one column per segment length."""
    runs = [p for f in sorted(d.glob("breakdown_exact_seg*.json")) if (p := load(d, f.stem)) and p["records"]]
    if not runs:
        return []
    recs = [r for p in runs for r in p["records"]]
    rows: dict[tuple, dict] = {}
    for r in recs:
        row = rows.setdefault(
            (r["concurrency"], r["method"]),
            {"method": r["method"], "budget": r["budget"], "rows": r["concurrency"], "context": r["context"]},
        )
        row[f"seg {r['exact_segment']}"] = r["round_ms"]
    cols = ["method", "budget", "rows", "context", *(f"seg {s}" for s in sorted({r["exact_segment"] for r in recs}))]
    first = runs[0]
    return [
        f"Exact MLA segment length (round ms; `breakdown --exact --exact_segment=N`, {meta_line(first)}; one process "
        "per segment length and batch, so differences of a few percent are noise):",
        common.markdown_table([rows[k] for k in sorted(rows)], cols),
    ]


def losses_section(sweeps: list[dict], bench: dict | None, window: int, latest: list[dict]) -> list[str]:
    """Where DDTree loses, computed from the data, with the reason (window: the shipped target's training length;
    latest: the sweep_<axis>_auto* runs, whose fixed programs at 32 rows and up are shown as measured there).

    speedup = tokens per round / (round time in AR steps), so a cell loses exactly when a round costs more AR
    steps than it commits tokens; `round_cost_in_ar_steps` = tokens_per_round / speedup shows which side moved.
    """
    out = ["## Where DDTree loses"]
    tree = [r for p in sweeps for r in p["records"] if r["method"] == "ddtree"]
    for r in tree:
        r["round_cost_in_ar_steps"] = r["tokens_per_round"] / r["speedup"]
    cols = ["axis", "budget", "concurrency", "context", "tokens_per_round", "round_cost_in_ar_steps", "speedup"]
    losing = [r for r in tree if r["speedup"] < 1]
    if losing:
        out.append("Measured cells (our engine, small pair) where DDTree is slower than AR:")
        out.append(common.markdown_table(losing, cols))
    elif tree:
        worst = min(tree, key=lambda r: r["speedup"])
        out.append(
            f"No measured cell has DDTree slower than AR; the smallest speedup is {worst['speedup']:.2f}x "
            f"(budget {worst['budget']}, concurrency {worst['concurrency']}, context {worst['context']})."
        )
    chain = {
        (r["axis"], r["concurrency"], r["context"]): r for p in sweeps for r in p["records"] if r["method"] == "dflash"
    }
    versus = [(r, chain.get((r["axis"], r["concurrency"], r["context"]))) for r in tree]
    versus = [(r, c) for r, c in versus if c is not None]
    if versus:
        rows = [
            {
                **r,
                "tokens_per_round_ratio": r["tokens_per_round"] / c["tokens_per_round"],
                "round_time_ratio": (r["tokens_per_round"] / r["tokens_per_s"])
                / (c["tokens_per_round"] / c["tokens_per_s"]),
                "tokens_per_s_ratio": r["tokens_per_s"] / c["tokens_per_s"],
            }
            for r, c in versus
        ]
        slower = [r for r in rows if r["tokens_per_s_ratio"] < 1]
        out.append(
            f"Against the DFlash chain (same run, same cell) DDTree is slower in {len(slower)} of {len(rows)} measured "
            "cells. DDTree wins a cell exactly when its gain in tokens per round outweighs its longer round "
            "(ratios DDTree / chain):"
        )
        cols_vs = ["axis", "budget", "concurrency", "context", "tokens_per_round_ratio", "round_time_ratio"]
        out.append(common.markdown_table(rows, cols_vs + ["tokens_per_s_ratio"]))
        per_budget = []
        for b in sorted({r["budget"] for r in rows}):
            mine = [r for r in rows if r["budget"] == b]
            gain = statistics.mean(r["tokens_per_round_ratio"] for r in mine) - 1
            cost = statistics.mean(r["round_time_ratio"] for r in mine) - 1
            wins = sum(r["tokens_per_s_ratio"] >= 1 for r in mine)
            per_budget.append(
                f"budget {b}: {100 * gain:+.0f}% tokens per round for {100 * cost:+.0f}% round time, "
                f"faster in {wins} of {len(mine)} cells"
            )
        out.append(
            "A DDTree round verifies budget + 1 nodes where the chain verifies D + 1, and builds the tree (one kernel "
            "plus the top-K); on this small pair a round is a string of ~300 small kernels in one CUDA graph, so its "
            "time follows its kernel count (breakdown). Mean "
            "over cells, " + "; ".join(per_budget) + "."
        )
    by_ctx = sorted((r for r in tree if r["axis"] == "context"), key=lambda r: r["context"])
    if by_ctx:
        out.append(
            f"Context: the shipped pair was trained on {window}-token windows (experiments/train_pair.sh). "
            "DDTree tokens per round by context: "
            + ", ".join(f"{r['tokens_per_round']:.2f} at {r['context']}" for r in by_ctx)
            + ". Past its training window a target degrades and the drafter with it: the previous pair, trained on "
            "512-token windows, fell to about 1.4 tokens per round at 1024 (experiments/notes_round.md). The "
            "Generator logs requests longer than the window; the sweep clamps contexts to the position limit."
        )
    conc = sorted((r for r in tree if r["axis"] == "concurrency"), key=lambda r: (r["budget"], r["concurrency"]))
    if conc:
        out.append("DDTree across concurrency: a round's cost in AR steps against the tokens it commits:")
        out.append(common.markdown_table(conc, cols))
    big = [
        r | {"round_cost_in_ar_steps": r["tokens_per_round"] / r["speedup"], "run": run_label(p)}
        for p in latest
        for r in p["records"]
        if r["method"] in ("dflash", "ddtree") and r["concurrency"] >= 32
    ]
    if big:
        out.append(
            "The chain and DDTree at 32 rows and more in the latest `auto` runs (the same cells, the same process as "
            "`ar`): each loses where a round costs more AR steps than the tokens it commits."
        )
        cols_big = ["method", "budget", "concurrency", "context", "tokens_per_round", "round_cost_in_ar_steps"]
        out.append(common.markdown_table(big, [*cols_big, "speedup", "run"]))
    if bench:
        proj = [r for r in bench["records"] if r.get("kind") == "projection"]
        bad = [r for r in proj if r["proj_speedup"] < 1]
        if bad:
            out.append("Full-size PROJECTION cells with speedup < 1:")
            out.append(
                common.markdown_table(bad, ["budget", "concurrency", "context", "acceptance_source", "proj_speedup"])
            )
        meas = [r for r in bench["records"] if r.get("kind") == "measured" and "error" not in r]
        ar_layer = {(r["concurrency"], r["context"]): r["layer_ms"] for r in meas if r["method"] == "ar"}
        rows = [
            {**r, "verify_layer_over_ar_layer": r["layer_ms"] / ar_layer[(r["concurrency"], r["context"])]}
            for r in meas
            if r["method"] == "ddtree" and (r["concurrency"], r["context"]) in ar_layer
        ]
        if rows:
            out.append(
                "One full-size MoE layer on a verify block (B x (budget + 1) tokens) relative to the same layer "
                "in an AR step (B tokens): the break-even acceptance length at that layer cost."
            )
            out.append(common.markdown_table(rows, ["budget", "concurrency", "context", "verify_layer_over_ar_layer"]))
    out.append(
        "Why: an AR step at batch B runs B tokens through each layer; a DDTree round runs B x (budget + 1). At "
        "concurrency 1 the step is memory bound (weights read once), so verifying 9-65 tokens costs little more "
        "than 1 and the accepted tokens are nearly free. As B grows, the tokens of a verify touch more distinct "
        "experts (up to all 384 per layer, about 9.5 GB per layer at INT4) and the matmuls become compute bound, so "
        "a round's cost in AR steps grows with B x budget while the tokens it commits do not: the speedup shrinks "
        "and then falls below 1. Large budgets lose first. At concurrency 1 a loss means the fixed per-round work "
        "(draft, tree build, walk and compaction: see the breakdown) is not repaid by the acceptance length."
    )
    return out


def correctness_section(sweeps: list[dict], d: Path, window: int) -> list[str]:
    """Which sweep cells left AR's tokens, and the held-out acceptance runs (bf16 and float32) for comparison;
    contexts past `window` (the shipped target's training length) get their own paragraph."""
    cells = [r for p in sweeps for r in p["records"] if r["method"] != "ar"]
    differ = [r for r in cells if not r["correct"]]
    out = [
        "## Correctness",
        f"`correct` = every row of the cell token-identical to AR's in the same run; `rows_identical` = the share "
        f"that is. {len(differ)} of {len(cells)} speculative sweep cells differ from AR somewhere"
        + (f" (dtype {sweeps[0]['config'].get('dtype', 'bfloat16')})." if sweeps else "."),
    ]
    contexts = sorted(f.stem for f in d.glob("acceptance*_ctx*.json"))
    for name in ("acceptance", "acceptance_float32", *contexts):
        if p := load(d, name):
            rows = [{k: r[k] for k in ("method", "budget", "tokens_per_round", "rows_differing")} for r in p["records"]]
            out += [
                f"`eval_acceptance` ({p.get('dtype', 'bfloat16')}, {p['prompts']} held-out prompts, "
                + (f"cut to {p['context']} tokens, " if isinstance(p.get("context"), int) else "")
                + f"{p['max_new_tokens']} tokens):",
                meta_line(p),
                common.markdown_table(rows, ["method", "budget", "tokens_per_round", "rows_differing"]),
            ]
            if p.get("divergences"):
                cols = ["method", "row", "position", "ar_token", "token", "gap", "gap_f32"]
                out += ["First differing positions and the target's logit gap there:"]
                out += [common.markdown_table(p["divergences"], cols)]
    if f32_short := load(d, "sweep_budget_float32"):
        out += [
            "Float32 budget sweep (`sweep --axis=budget --dtype=float32`, matmul precision "
            f"`{f32_short['config'].get('matmul_precision')}`; the MoE runs on the reference, so its timings are not "
            "comparable):",
            meta_line(f32_short),
            common.markdown_table(
                f32_short["records"], ["method", "budget", "tokens_per_round", "correct", "rows_identical"]
            ),
        ]
    long = [r for p in sweeps for r in p["records"] if r.get("axis") == "context" and r["context"] > window]
    runs = [load(d, name) for name in contexts]
    f32 = load(d, "sweep_context_float32")
    precision = f32 and f32["config"].get("matmul_precision")
    if f32:
        out += [
            "Float32 context sweep (`sweep --axis=context --dtype=float32`), matmul precision "
            + (
                f"`{precision}`:"
                if precision
                else "not recorded: the run predates the setting, so its f32 matmuls (XLA's and the Triton MLA "
                "kernel's) ran at the GPU default, TF32, and it cannot separate rounding from a kernel error:"
            ),
            meta_line(f32),
            common.markdown_table(
                f32["records"], ["method", "budget", "context", "tokens_per_round", "correct", "rows_identical"]
            ),
        ]
    if long and runs:
        out.append(
            "Long contexts: in the sweep ("
            + ", ".join(
                f"{r['method']}{'' if r['method'] == 'dflash' else ' b' + str(r['budget'])} at {r['context']}: "
                f"{r['rows_identical']:.0%}"
                for r in long
                if r["method"] != "ar"
            )
            + " of rows identical to AR, on the GPU kernels) against `eval_acceptance` on the CPU reference kernels ("
            + ", ".join(
                f"{p['dtype']} at {p['context']}: {sum(r['rows_differing'] for r in p['records'])} rows differing"
                for p in runs
            )
            + (
                "). The float32 GPU run at full f32 matmul precision is identical to AR in every row: the bf16 GPU "
                "differences are rounding, not a kernel error."
                if precision == "highest" and all(r["correct"] for r in f32["records"])
                else "). Until a float32 GPU run at full f32 matmul precision is identical to AR there, read the GPU "
                "long-context cells as unverified."
            )
        )
    if differ:
        out.append(
            "Verification accepts a drafted token only if it equals the target's own choice in the verify pass, so "
            "a difference from AR is a difference between the target's bf16 logits for one token computed two ways "
            "(a 1-token decode step vs a (budget+1)-node verify: different matmul shapes, kernel tilings and "
            "reduction orders). It shows up where two logits are within bf16 noise; float32 removes it "
            "(docs/exactness.md)."
        )
    return out


def kernel_section(d: Path) -> list[str]:
    out = []
    rank = sorted(d.glob("bench_rank*.md"))
    for md in rank:
        body = md.read_text().split("\n", 2)[-1]
        out += [
            f"## 8xH200 PROJECTION from one measured rank ({md.stem})",
            "One rank's share of an 8-GPU K2.6 deployment measured on one H200, target share scaled to 61 layers, "
            "plus a written communication model (bench_rank.py docstring); tau values are assumptions (the SGLang "
            "team's K2.6 acceptance), not measurements of a real K2.6 drafter.",
            body,
        ]
    for name in (
        "bench_moe",
        "bench_mla_carry",
        "bench_mla",
        "bench_tree_build",
        "bench_tree_build_e2e",
        "bench_tree_warps",
        "bench_topk",
        "ab_topk",
        "ab_flags_mla_mosaic",
        "bench_mla_stream",
    ):
        md = d / f"{name}.md"
        if md.is_file():
            body = md.read_text().split("\n", 2)[-1]
            out += [f"## Kernel benchmark: {name}", body]
    return out


def build(d: Path) -> Path:
    sweeps = {a: load(d, f"sweep_{a}") for a in ("budget", "concurrency", "context")}
    breakdown, bench = load(d, "breakdown"), load(d, "bench_round")
    parts = [
        "# DDTree on Kimi-shaped models: findings",
        "Generated by `python -m experiments.report` from the JSON records in this directory. Measured numbers are "
        "from our engine; rows marked PROJECTION are computed, and the published numbers are other systems on "
        "other hardware.",
    ]
    if sweeps["budget"]:
        parts += budget_section(sweeps["budget"], d)
    if sweeps["concurrency"]:
        parts += concurrency_section(sweeps["concurrency"], d)
    if sweeps["context"]:
        parts += context_section(sweeps["context"], d)
    if breakdown:
        parts += breakdown_section(breakdown, d)
    if bench:
        parts += bench_round_section(bench)
    from ddtree_jax.api import trained_context

    window = trained_context(SHIPPED_TARGET) or 0  # the shipped target's training window (its manifest)
    matrix, auto_runs = [p for p in sweeps.values() if p], tagged_sweeps(d, "auto")
    parts += auto_section([*matrix, *auto_runs])
    parts += exact_section(d)
    parts += losses_section(matrix, bench, window, auto_runs)
    parts += correctness_section(matrix, d, window)
    parts += kernel_section(d)
    parts += [
        "## Published numbers (other systems, other hardware: context only, not comparable)",
        common.markdown_table(PUBLISHED, ["system", "hardware", "number"]),
    ]
    missing = [n for n, p in [*((f"sweep_{a}", p) for a, p in sweeps.items()), ("breakdown", breakdown)] if not p]
    missing += [] if bench else ["bench_round"]
    if missing:
        parts.append(f"_Not present when this report was built: {', '.join(missing)}._")
    out = d / "REPORT.md"
    out.write_text("\n\n".join(parts) + "\n")
    return out


def main(_) -> None:
    print(build(Path(FLAGS.results_dir)))


if __name__ == "__main__":
    run_app(main)
