"""Smoke tests of the experiment scripts on CPU with tiny settings: each runs end to end and writes its records."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

from experiments import workload

REPO = Path(__file__).resolve().parents[1]
META = ("device", "jax_version", "commit", "date")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    return workload.write_tiny_pair(tmp_path_factory.mktemp("pair"))


def run(module: str, *args: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def records(path: Path) -> list[dict]:
    payload = json.loads(path.read_text())
    assert all(payload["meta"][k] for k in META)
    assert payload["records"]
    return payload["records"]


def test_sweep_all_axes_then_report(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    run(
        "sweep",
        "--axis=budget,concurrency,context",
        f"--target={target}",
        f"--drafter={drafter}",
        "--budgets=4",
        "--axis_budgets=4",
        "--concurrency=1",  # B=1 and context 60 reuse the budget axis' compiled programs
        "--contexts=60,3000",
        "--methods=ar,dflash,ddtree",  # auto: test_sweep_auto_tables_per_axis
        "--num_prompts=2",
        "--repeats=1",
        "--max_new_tokens=8",
        f"--out_dir={tmp_path}",
    )
    for axis in ("budget", "concurrency", "context"):
        recs = records(tmp_path / f"sweep_{axis}.json")
        assert [r["method"] for r in recs[:3]] == ["ar", "dflash", "ddtree"]
        for r in recs:
            assert all(r[k] for k in META)
            assert r["wall_s"] > 0 and r["tokens_per_s"] > 0 and r["tokens_per_s_per_request"] > 0
            assert r["tokens_per_round"] >= 1 and r["speedup"] > 0
            assert r["correct"] is True, r  # greedy speculative decoding must reproduce AR exactly
        assert (tmp_path / f"sweep_{axis}.md").is_file()
    ctx = records(tmp_path / "sweep_context.json")
    assert {r["context"] for r in ctx} == {60, 2016} and any(r["context_clamped"] for r in ctx)
    assert {r["concurrency"] for r in records(tmp_path / "sweep_concurrency.json")} == {1}
    # a float32 exactness run goes to its own file, at full f32 matmul precision, and leaves the bf16 matrix alone
    run(
        "sweep",
        "--axis=context",
        f"--target={target}",
        f"--drafter={drafter}",
        "--axis_budgets=4",
        "--contexts=60",
        "--methods=ar,ddtree",
        "--num_prompts=1",
        "--repeats=1",
        "--max_new_tokens=8",
        "--dtype=float32",
        f"--out_dir={tmp_path}",
    )
    f32 = records(tmp_path / "sweep_context_float32.json")
    assert [r["method"] for r in f32] == ["ar", "ddtree"] and all(r["correct"] is True for r in f32)
    assert all(r["dtype"] == "float32" and r["matmul_precision"] == "highest" for r in f32)
    assert {r["context"] for r in records(tmp_path / "sweep_context.json")} == {60, 2016}

    run("report", f"--results_dir={tmp_path}")
    report = (tmp_path / "REPORT.md").read_text()
    assert "Float32 context sweep (`sweep --axis=context --dtype=float32`), matmul precision `highest`" in report
    for heading in ("Budget sweep", "Concurrency sweep", "Context sweep", "Where DDTree loses", "Published numbers"):
        assert f"## {heading}" in report
    for plot in ("acceptance_vs_budget", "tokens_per_s_vs_budget", "speedup_vs_concurrency", "acceptance_histogram"):
        assert f"plots/{plot}.png" in report and (tmp_path / "plots" / f"{plot}.png").stat().st_size > 0
    assert "bench_round" in report.split("Not present")[-1]  # missing inputs are listed


def test_report_reads_the_tagged_auto_and_exact_sweeps(tmp_path):
    """The report's auto section takes auto rows from sweep_<axis>_auto* records too, and its exact section the
    sweep_<axis>_exact* records (their `correct` counted), each exact_check* record's batch-1 cost (a cell without
    one is counted, not costed) and its cells measured on both sides, and a table of the
    breakdown_exact_seg<N>[_c32] round times, a column per segment length."""
    meta = {"device": "H100", "backend": "gpu", "jax_version": "0.11.2", "commit": "abc", "date": "2026-12-06"}
    cell = {"axis": "concurrency", "concurrency": 64, "context": 60, "repeats": 7, "tokens_per_round": 4.6}
    cell |= {"tokens_per_s": 1.0, "correct": True, "budget": 7}
    auto = [cell | {"method": "auto", "chosen": "dflash x8", "speedup": 1.05, "vs_best": 1.0}]
    auto += [cell | {"method": "ddtree", "budget": 8, "speedup": 0.92}]  # 4.6 tokens for 5 AR steps
    exact = [cell | {"method": m, "speedup": 1.0, "correct": m == "ar"} for m in ("ar", "dflash")]
    check = [{"exact": "on", "batch": 1, "method": "ar", "budget": 1, "context": 60, "rows_differ": 0, "vs_off": 0.92}]
    check.append(check[0] | {"method": "dflash", "budget": 7, "vs_off": None})  # its run without the switch cut short
    cost = [check[0] | {"vs_off": 1.04, "accept_vs_off": 0.98, "round_vs_off": 1.061}]
    cost[0] |= {"same_text_rows": 19, "accept_same_text_vs_off": 0.995}
    cost.append(check[0] | {"exact": "off", "rows_differ": 13, "vs_off": None})
    runs = [("sweep_concurrency_auto_repeat", auto), ("sweep_budget_exact", exact), ("exact_check", check)]
    for name, recs in [*runs, ("exact_check_cost_ctx60", cost)]:
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "records": recs}))
    for seg, rows, ms in ((128, 1, 0.4), (256, 1, 0.3), (256, 32, 0.5)):
        rec = {"method": "ar", "budget": 1, "concurrency": rows, "context": 1024, "exact_segment": seg, "round_ms": ms}
        name = f"breakdown_exact_seg{seg}" + ("_c32" if rows == 32 else "")
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "records": [rec]}))
    (tmp_path / "sweep_concurrency_auto_calibration.json").write_text("{}")  # a table, not records: skipped
    run("report", f"--results_dir={tmp_path}")
    report = (tmp_path / "REPORT.md").read_text()
    assert "at least AR's rate in 1 of 1 cells" in report and "| dflash x8 |" in report
    assert "| ddtree | 8 | 64 | 60 | 4.6 | 5 | 0.92 | abc 2026-12-06 |" in report  # the fixed rows at 32+ rows
    assert "1 of 2 cells give every row AR's tokens" in report and "ar b1 ctx 60 0.92" in report
    assert "2 of 2 cells with no row differing" in report and "dflash b7" not in report
    assert "`exact_check_cost_ctx60`" in report
    assert "| 60 | 1 | ar | 1 |  | 1.04 | 0.98 | 1.061 | 19 | 0.995 | 0 | 13 |" in report
    assert "| method | budget | rows | context | seg 128 | seg 256 |" in report
    assert "| ar | 1 | 1 | 1024 | 0.4 | 0.3 |" in report and "| ar | 1 | 32 | 1024 |  | 0.5 |" in report


def test_sweep_auto_tables_per_axis(tiny_pair, tmp_path):
    """--calibrate_only writes one table per axis and no records; a later sweep takes a --calibration_dir table that
    fits its axis and measures the one missing, its records named by --tag (run_gpu_matrix's calibrate and auto).
    auto runs beside the fixed methods in every cell, lossless: its row counts the programs it chose over the cell's
    calls (1 untimed, 1 timed) and gives its rate against the best fixed one."""
    target, drafter = tiny_pair
    common = [f"--target={target}", f"--drafter={drafter}", "--axis_budgets=4", "--methods=ar,ddtree,auto"]
    common += ["--concurrency=1", "--contexts=60", "--num_prompts=1", "--repeats=1", "--max_new_tokens=8"]
    common += ["--ignore_eos", "--tag=auto"]
    tables, out = tmp_path / "tables", tmp_path / "run"
    run("sweep", *common, "--axis=concurrency", "--calibrate_only", f"--out_dir={tables}")
    assert sorted(p.name for p in tables.iterdir()) == ["sweep_concurrency_auto_calibration.json"]
    run("sweep", *common, "--axis=concurrency,context", f"--calibration_dir={tables}", f"--out_dir={out}")
    used = {a: {r["calibration"] for r in records(out / f"sweep_{a}_auto.json")} for a in ("concurrency", "context")}
    assert used == {
        "concurrency": {str(tables / "sweep_concurrency_auto_calibration.json")},
        "context": {"measured in this run (sweep_context_auto_calibration.json)"},
    }
    assert not (out / "sweep_concurrency_auto_calibration.json").exists()
    recs = records(out / "sweep_concurrency_auto.json")
    assert [r["method"] for r in recs] == ["ar", "ddtree", "auto"] and all(r["correct"] for r in recs)
    assert re.fullmatch(r"(ar|ddtree-4) x2|(ar|ddtree-4) x1,(ar|ddtree-4) x1", recs[2]["chosen"])
    assert recs[2]["vs_best"] > 0 and recs[2]["speedup"] > 0
    table = json.loads((out / "sweep_context_auto_calibration.json").read_text())
    assert (table["batches"], table["contexts"], list(table["candidates"])) == ([1], [60], ["ar", "ddtree-4"])


def test_breakdown(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    run(
        "breakdown",
        f"--target={target}",
        f"--drafter={drafter}",
        "--methods=ar,ddtree",
        "--budgets=4",
        "--repeats=5",
        "--max_new_tokens=256",
        "--compile_workers=2",
        "--save_hlo",
        f"--out_dir={tmp_path}",
    )
    ar, dd = records(tmp_path / "breakdown.json")
    assert "ENTRY" in gzip.decompress((tmp_path / "breakdown_ddtree4.hlo.txt.gz").read_bytes()).decode()
    assert all(dd[k] for k in META) and ar["round_ms"] > 0 and dd["round_ms"] > 0
    # every kernel of a round lands in its own piece: the AR step has none of the speculative pieces and v.v.
    assert ar["step_kernels"] > 0 and all(ar[f"{p}_kernels"] == 0 for p in ("draft", "tree", "verify", "accept"))
    assert dd["step_kernels"] == 0 and all(dd[f"{p}_kernels"] > 0 for p in ("draft", "tree", "verify", "accept"))
    assert dd["busy_ms"] == pytest.approx(sum(dd[f"{p}_ms"] for p in ("draft", "tree", "verify", "accept", "other")))
    assert ar["prefill_kernels"] > 0 and dd["prefill_ms"] > 0 and dd["prefill_top_kernels"]  # apart from the rounds'
    assert all(name.startswith("prefill:") for name, _, _ in dd["prefill_top_kernels"])


def test_bench_tree_build(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    run(
        "bench_tree_build",
        f"--target={target}",
        f"--drafter={drafter}",
        "--budgets=4",
        "--batches=2",
        "--e2e_budgets=4",
        "--steps=2",
        "--warps=1,2",
        "--topk_vocabs=600",
        "--repeats=1",
        "--max_new_tokens=12",
        "--kernel_mode=interpret",
        f"--out_dir={tmp_path}",
    )
    one, two = records(tmp_path / "bench_tree_warps.json")
    assert (one["num_warps"], two["num_warps"]) == (1, 2) and one["default"] and one["us_per_build"] > 0
    topk = records(tmp_path / "bench_topk.json")
    assert len(topk) == 4 * 6 and all(r["identical"] is True and r["us"] > 0 for r in topk)
    build, ar, chain, tree = records(tmp_path / "bench_tree_build.json")
    assert (build["part"], build["budget"], build["batch"]) == ("build", 4, 2) and build["identical"] is True
    assert [r["method"] for r in (ar, chain, tree)] == ["ar", "dflash", "ddtree"]
    assert all(r["identical"] is True and r["pallas"] > 0 and r["reference"] > 0 for r in (ar, chain, tree))
    assert tree["tokens_per_round"] >= 1 and tree["vs_chain"] > 0


def test_bench_drafter_tiny(tmp_path):
    """Every (mode, concurrency, allocation) cell timed in loops of 2 and 4 forwards (a smoke test: on a CPU the
    difference is noise, so only its presence is checked); the kernel path in interpret mode."""
    run(
        "bench_drafter",
        "--tiny",
        "--modes=reference,interpret",
        "--concurrency=2",
        "--allocations=32,64",
        "--context=10",
        "--inner=2",
        "--repeats=1",
        f"--out_dir={tmp_path}",
    )
    recs = records(tmp_path / "bench_drafter.json")
    assert [(r["mode"], r["allocation"]) for r in recs] == [
        (m, a) for m in ("reference", "interpret") for a in (32, 64)
    ]
    assert all(math.isfinite(r["ms"]) and r["context"] == 10 and r["max_diff"] < 0.1 for r in recs)


def test_ticket_probe_interpret(tmp_path):
    """The ticket join in interpret mode: its output equals the residual plus its own partials in head order, and
    every counter is back at 0 after each call (the memory ordering needs a GPU: interpret mode runs one program at a
    time)."""
    run("ticket_probe", "--interpret", "--batches=2", "--checks=2", "--inner=1", "--repeats=1", f"--out_dir={tmp_path}")
    ticket, two = records(tmp_path / "ticket_probe.json")
    assert ticket["mismatched_calls"] == 0 and ticket["calls_leaving_counters"] == 0
    assert ticket["variant"] == "ticket" and two["variant"] == "two_kernels"


def test_bench_round_tiny(tmp_path):
    sweep = tmp_path / "sweep_budget.json"
    sweep.write_text(
        json.dumps({"records": [{"method": "ddtree", "budget": 8, "concurrency": 1, "tokens_per_round": 3.0}]})
    )
    run(
        "bench_round",
        "--tiny",
        "--nopieces",  # breakdown.py covers the pieces
        "--budgets=8",
        "--concurrency=2",
        "--contexts=64",
        "--repeats=1",
        f"--sweep_json={sweep}",
        f"--out_dir={tmp_path}",
    )
    payload = json.loads((tmp_path / "bench_round.json").read_text())
    assert payload["model"]["layers"] == 3 and payload["model"]["tiny"] is True
    recs = records(tmp_path / "bench_round.json")
    ar, dd = (next(r for r in recs if r["kind"] == "measured" and r["method"] == m) for m in ("ar", "ddtree"))
    assert "error" not in dd and dd["finite_logits"] is True
    for r in (ar, dd):
        assert all(r[k] for k in META) and r["ms"] > 0 and r["projected_ms_61"] > r["ms"]
    proj = {r["acceptance_source"]: r for r in recs if r["kind"] == "projection"}
    assert set(proj) == {"ours (sweep, b8)", "published DDTree b8 (SGLang, K2.5)"}
    ours = proj["ours (sweep, b8)"]
    assert ours["proj_speedup"] == pytest.approx(3.0 * ar["projected_ms_61"] / dd["projected_ms_61"])

    # --reproject: the same measured rows and metadata, projections from another acceptance (twice the file: merged)
    sweep.write_text(sweep.read_text().replace("3.0", "5.0"))
    again = tmp_path / "again"
    run(
        "bench_round",
        f"--reproject={tmp_path / 'bench_round.json'},{tmp_path / 'bench_round.json'}",
        f"--sweep_json={sweep}",
        f"--out_dir={again}",
    )
    re = json.loads((again / "bench_round.json").read_text())
    assert re["meta"] == payload["meta"] and re["reprojected"]["sweep_json"] == str(sweep)
    assert [r for r in re["records"] if r["kind"] == "measured"] == [r for r in recs if r["kind"] == "measured"] * 2
    ours = [r for r in re["records"] if r.get("acceptance_source") == "ours (sweep, b8)"]
    assert len(ours) == 2 and all(r["acceptance"] == 5.0 for r in ours)
    assert ours[0]["proj_speedup"] == pytest.approx(5.0 * ar["projected_ms_61"] / dd["projected_ms_61"])


def test_notebook_executes():
    nb = nbformat.read(REPO / "experiments" / "notebooks" / "explore.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO / "experiments")}}
    )
    client.execute()
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the drawn tree and the per-depth acceptance


def test_divergence_finds_the_first_difference_and_the_target_gap_there():
    import np_kimi
    import numpy as np
    from conftest import tiny_kimi_config
    from test_model import make_model, np_weights

    from experiments.exactness import divergence

    cfg = tiny_kimi_config()
    rng = np.random.default_rng(1)
    model = make_model(cfg, seed=int(rng.integers(1 << 30)))
    prompt = rng.integers(0, cfg.vocab_size, 5).tolist()
    ref = rng.integers(0, cfg.vocab_size, 9).tolist()
    pos = int(rng.integers(0, 7))
    out = list(ref)
    out[pos] = (ref[pos] + 1 + int(rng.integers(cfg.vocab_size - 1))) % cfg.vocab_size
    out[pos + 2] = (ref[pos + 2] + 1) % cfg.vocab_size  # a later difference must not matter
    row = divergence(model, model, prompt, ref, out)
    seq = np.array(prompt + ref[:pos])
    causal = np.tril(np.ones((len(seq), len(seq)), bool))
    logits, _ = np_kimi.forward(np_weights(model), cfg, seq, np.arange(len(seq)), causal)
    want = logits[-1, ref[pos]] - logits[-1, out[pos]]
    assert (row["position"], row["ar_token"], row["token"]) == (pos, ref[pos], out[pos])
    assert row["gap"] == row["gap_f32"] == pytest.approx(want, abs=2e-3)


def test_timing_is_interleaved():
    """After one untimed run per (setting, batch), each timing round runs every setting once in turn; a batch's time
    is its median over rounds, so a slow spell in one round cannot land on one setting only."""
    import io
    from types import SimpleNamespace

    from tqdm import tqdm

    from experiments import common

    calls, clock = [], iter(range(1, 1000))

    class FakeGen:
        def generate(self, batch, method, budget):
            calls.append((method, budget, batch[0][0]))
            return SimpleNamespace(wall_s=float(next(clock)))

    kws = [{"method": "ar", "budget": 1}, {"method": "ddtree", "budget": 8}]
    bar = tqdm(total=len(kws) + 3, file=io.StringIO())
    (ar_first, ar_med), (dd_first, dd_med) = common.time_interleaved(FakeGen(), [[[10]], [[20]]], kws, 3, bar)
    assert bar.n == bar.total  # one step per setting's warm-up and per timing round
    warm = [("ar", 1, 10), ("ar", 1, 20), ("ddtree", 8, 10), ("ddtree", 8, 20)]
    assert calls == warm + warm * 3
    assert [f.wall_s for f in ar_first + dd_first] == [1, 2, 3, 4]  # the untimed runs, returned for their outputs
    # timed calls get wall times 5, 6, 7, 8 | 9, 10, 11, 12 | 13, 14, 15, 16 in that order: medians per batch
    assert ar_med == [9, 10] and dd_med == [11, 12]


def test_ab_topk(tiny_pair, tmp_path):
    """Chunk 0 (lax.top_k) and a chunk shorter than the tiny vocabulary: separate programs, the same outputs and
    acceptance (the two top-k forms return the same candidates)."""
    target, drafter = tiny_pair
    run(
        "ab_topk",
        f"--target={target}",
        f"--drafter={drafter}",
        "--budgets=4",
        "--chunks=0,16",
        "--num_prompts=2",
        "--repeats=1",
        "--max_new_tokens=8",
        "--compile_workers=2",
        f"--out_dir={tmp_path}",
    )
    ar, chain, lax_tree, chunked = records(tmp_path / "ab_topk.json")
    assert (ar["method"], chain["method"], lax_tree["chunk"], chunked["chunk"]) == ("ar", "dflash", 0, 16)
    assert all(r["identical"] is True and r["tokens_per_s"] > 0 for r in (ar, chain, lax_tree, chunked))
    assert lax_tree["tokens_per_round"] == chunked["tokens_per_round"]  # vocab 97: three chunks, one padded
    assert lax_tree["vs_lax"] == 1.0 and chunked["vs_lax"] > 0


def test_ab_flags(tiny_pair, tmp_path):
    """Two XLA flag settings, each in its own sweep process: flags change speed, never acceptance."""
    target, drafter = tiny_pair
    run(
        "ab_flags",
        "--setting=base=",
        "--setting=text=--xla_dump_hlo_as_text=false DDTREE_MLA_KERNEL=triton",
        f"--target={target}",
        f"--drafter={drafter}",
        "--budgets=4",
        "--cycles=1",
        "--repeats=1",
        "--num_prompts=1",
        "--max_new_tokens=8",
        f"--out_dir={tmp_path}",
    )
    recs = records(tmp_path / "ab_flags.json")
    assert [(r["setting"], r["method"]) for r in recs] == [
        (s, m) for s in ("base", "text") for m in ("ar", "dflash", "ddtree")
    ]
    assert all(r["same_acceptance"] and r["tokens_per_s"] > 0 for r in recs)
    assert [r["vs_first"] for r in recs[:3]] == [1.0, 1.0, 1.0]
    assert recs[4]["xla_flags"] == "--xla_dump_hlo_as_text=false" and recs[1]["vs_chain"] == 1.0
    assert recs[4]["env"] == "DDTREE_MLA_KERNEL=triton" and recs[0]["env"] == ""


@pytest.mark.parametrize(
    "module,arg,says",
    [
        ("ab_flags", "--setting=--xla_foo", "want NAME=FLAGS"),  # raised by the script
        ("ab_flags", "--setting=x=xla_foo", "neither an --xla flag nor VAR=value"),
        ("ab_flags", "--cycles=two", "--cycles"),  # a flag absl cannot parse
        ("sweep", "--repeats=", "--repeats"),
        ("bench_mla", "--kernels=mosaic_dup", "unknown"),
        ("bench_mla", "--mosaic_tiling=compute_registers=244", "compute_registers must be"),
        ("bench_mla", "--mosaic_tiling=compute_registers=many", "takes an int"),
        ("bench_mla", "--mosaic_tiling=num_stages=0", "num_stages >= 1"),
        ("bench_mla", "--interpret --kernels=triton,mosaic", "Triton kernel only"),
        ("bench_mla", "--mosaic_tiling=registers=240", "FIELD=VALUE"),
        ("profile_mla", "--cells=8192/1/x/64", "--cells"),
        ("bench_mla", "--cells=8192/0/8/64", "--cells"),
        ("bench_mla", "--cells=8192/17/8/64 --cache_len=8200", "--cache_len=8200 is shorter"),
        ("profile_mla", "--tiling=softmax=split", "FIELD=VALUE"),
        ("ptxas_report", "--cells=8192/1/8", "--cells"),
        ("ptxas_report", "--ptxas=/nonexistent/ptxas", "ptxas not found"),
        ("bench_mla_stream", "--rings=64x", "--rings"),
        ("bench_mla_stream", "--loop=yes", "--loop"),  # absl rejects it
    ],
)
def test_experiment_bad_input_is_one_line_and_exit_2(module, arg, says):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", *arg.split()], cwd=REPO, env=env, capture_output=True, text=True
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], lines


def test_bench_mla_interpret(tmp_path):
    """bench_mla on CPU (Triton kernel in interpret mode): ceilings, checks against the f32 reference, one cell."""
    run(
        "bench_mla",
        "--interpret",
        "--cells=20/3/2/8",
        "--cache_len=100",
        "--kernels=triton",
        "--ceiling_size=256",
        f"--out_dir={tmp_path}",
    )
    payload = json.loads((tmp_path / "bench_mla.json").read_text())
    assert all(c["ok"] and c["kernel"] == "triton" for c in payload["checks"]) and len(payload["checks"]) == 5
    assert all(c["slots"] >= c["context"] + c["nodes"] for c in payload["checks"])  # checks ignore --cache_len
    (rec,) = records(tmp_path / "bench_mla.json")
    assert (rec["context"], rec["nodes"], rec["kernel"]) == (20, 3, "triton") and rec["kernel_us"] > 0
    assert rec["slots"] == 128  # --cache_len rounded up to whole 64-slot tiles (64 without it)
    # the 20-slot read is below CPU timing noise, so its sign is not checked; the copy fraction must follow from it
    read_bytes = 2 * (20 + 3) * 576 * 2
    bw = payload["ceilings"]["roofline_bw_tbps"] * 1e12
    assert math.isclose(rec["read_of_copy"] * rec["read_us"] * 1e-6, read_bytes / bw, rel_tol=1e-3)


FAKE_PY = """#!/usr/bin/env bash
# stands in for python: records the call, creates --out_dir and the loss curve the module writes
echo "$*" >> "$CALLS"
for a in "$@"; do case $a in --out_dir=*) out=${a#--out_dir=};; --results_dir=*) res=${a#--results_dir=};; esac; done
mkdir -p "$out" "$res" && echo weights > "$out/model.safetensors"
case $2 in
  experiments.train_target) echo "$2" > "$res/train_target_loss.json";;
  experiments.train_dflash) echo "$2 $*" > "$res/train_dflash_loss.json";;
  experiments.selfdistill_dflash) echo "$2 $*" > "$res/train_dflash_selfdistill_loss.json";;
esac
"""


@pytest.mark.parametrize("calls", [["target drafter selfdistill drafter2 selfdistill2"],
                                   ["target drafter selfdistill", "drafter2 selfdistill2"]])  # fmt: skip
def test_train_pair_chains_the_stages_and_keeps_every_curve(tmp_path, calls):
    """train_pair.sh, with python replaced by a recorder: each stage reads the one before, no loss curve overwrites
    another, and one device call returns at most 8 files."""
    import tarfile

    fake = tmp_path / "py"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    work = tmp_path / "work"
    env = {**os.environ, "PY": str(fake), "WORK": str(work), "CALLS": str(tmp_path / "calls")}
    for i, stages in enumerate(calls):
        out = tmp_path / f"out{i}"
        out.mkdir()
        step = {"OUT": str(out), "STAGES": stages}
        if i:  # the second call continues from the first call's target and drafter
            step |= {"TARGET": str(work / "kimi-mini"), "INIT": str(work / "d2")}
        subprocess.run(["bash", "experiments/train_pair.sh"], env=env | step, check=True, capture_output=True)
        assert len(list(out.iterdir())) <= 8
    with tarfile.open(out / "results.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    curves = {"train_target_loss.json", "train_dflash_loss.json", "train_dflash_selfdistill_stage1_loss.json"}
    curves |= {"train_dflash_stage2_loss.json", "train_dflash_selfdistill_loss.json"}
    assert curves <= names
    assert "--init=" not in (work / "results" / "train_dflash_loss.json").read_text()  # stage 1, not drafter2's
    lines = (tmp_path / "calls").read_text().splitlines()
    assert [line.split()[1] for line in lines] == [
        "experiments.train_target", "experiments.train_dflash", "experiments.selfdistill_dflash",
        "experiments.train_dflash", "experiments.selfdistill_dflash",
    ]  # fmt: skip
    assert f"--drafter={work}/d1" in lines[2] and f"--init={work}/d2" in lines[3] and f"--drafter={work}/d3" in lines[4]
    assert all(f"--target={work}/kimi-mini" in line for line in lines[1:])


def test_bench_mla_loop_modes():
    """bench_mla's timed programs: `inner` straight-line calls; one while loop with the cache loop-invariant; or one
    with the cache in the carry and rewritten once per call (as the engine holds it)."""
    import jax.numpy as jnp

    from experiments.mla_common import looped

    q, cache = jnp.ones((2, 1, 4, 8)), jnp.ones((2, 16, 8))
    prefix, mask = jnp.array([5, 7], jnp.int32), jnp.ones((2, 1, 1), bool)
    fn = lambda q_, c_, p_, m_: jnp.einsum("bnhd,bld->bnhl", q_, jnp.sin(c_))  # noqa: E731
    text = {k: looped(fn, k).lower(q, cache, prefix, mask, 3).as_text() for k in ("unrolled", "while", "carry")}
    assert [text[k].count("stablehlo.sine") for k in text] == [3, 1, 1]
    assert [text[k].count("stablehlo.while") for k in text] == [0, 1, 1]
    assert text["carry"].count("stablehlo.scatter") == 2 * text["while"].count("stablehlo.scatter")  # + cache write
    carry = text["carry"]
    assert carry.index("stablehlo.scatter") < carry.index("stablehlo.sine")  # the write comes before the call
    for loop in text:
        assert looped(fn, loop)(q, cache, prefix, mask, 3).shape == q.shape


def test_per_call_time_leaves_out_the_once_per_program_cost(monkeypatch):
    """Programs of k calls that take 20 ms once plus 5 ms per call (on a clock the programs advance, so no sleep's
    overshoot on a busy machine enters): 5 ms per call, 20 ms once."""
    from experiments import mla_common

    now = [0.0]
    monkeypatch.setattr(mla_common.time, "perf_counter", lambda: now[0])

    def build(k: int):
        def program() -> None:
            now[0] += 0.020 + 0.005 * k

        return program

    per, once = mla_common.per_call_time(build, inner=4, repeats=3)
    assert per == pytest.approx(0.005) and once == pytest.approx(0.020)


def test_per_call_time_logs_an_estimate_at_or_below_zero(caplog):
    """Programs that get faster with more calls (noise larger than a call): the negative estimate is returned as
    measured, and logged."""
    import time

    from experiments.mla_common import per_call_time

    def build(k: int):
        return lambda: time.sleep(0.020 - 0.001 * k)

    per, _ = per_call_time(build, inner=4, repeats=3)
    assert per < 0 and "below the timing noise" in caplog.text


def test_bench_mla_stream_lowers_and_splits_whole_waves():
    """The streaming kernel lowers for a Hopper GPU; split counts divide the tiles and fill at most one wave."""
    import functools

    import jax
    import jax.numpy as jnp

    from experiments.mla_common import stream, whole_wave_splits

    args = (jax.ShapeDtypeStruct((1,), jnp.float32), jax.ShapeDtypeStruct((4, 2048, 576), jnp.bfloat16))
    fn = functools.partial(stream, block_k=64, stages=2, splits=4)
    assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    cases = {(8, 128, 132): 16, (32, 128, 132): 4, (8, 512, 264): 32, (200, 64, 132): 1, (3, 7, 132): 7, (5, 6, 20): 3}
    assert {case: whole_wave_splits(*case) for case in cases} == cases


def test_parse_tiling():
    """--mosaic_tiling / --tiling text -> a MosaicMLAConfig; bad fields and values are user errors."""
    from ddtree_jax.errors import UserError
    from experiments.mla_common import parse_tiling
    from pallas_kernels.mla_mosaic_config import MosaicMLAConfig

    assert parse_tiling("") == MosaicMLAConfig()
    got = parse_tiling("compute_registers=232,num_stages=1,num_splits=3")
    assert got == MosaicMLAConfig(compute_registers=232, num_stages=1, num_splits=3)
    for bad in ("num_stages", "num_stages=x", "block_k=64", "softmax=split", "nope=3", "compute_registers=250"):
        with pytest.raises(UserError, match="tiling"):
            parse_tiling(bad)


def test_bench_mla_mosaic_tilings_and_labels():
    """A --mosaic_tiling keeps the split count it sets (else the shape's), a --mosaic_splits count replaces it, and
    the label names the split count that runs and what differs from the defaults."""
    from experiments.mla_common import mosaic_config, mosaic_label
    from pallas_kernels.mla_mosaic_config import MosaicMLAConfig, default_config

    chosen = default_config(8, 64, 4096).num_splits  # 16 on 132 SMs
    cases = [
        (None, chosen, f"k64s{chosen}st2"),
        (MosaicMLAConfig(num_splits=8), 8, "k64s8st2"),
        (MosaicMLAConfig(num_stages=1), chosen, f"k64s{chosen}st1"),
        (5, 5, "k64s5st2"),
        (MosaicMLAConfig(compute_registers=232), chosen, f"k64s{chosen}st2r232"),
    ]
    for arg, splits, label in cases:
        cfg = mosaic_config(8, 64, 4096, arg)
        assert (cfg.num_splits, mosaic_label(cfg)) == (splits, label), arg


def test_gpu_matrix_packs_only_what_it_wrote(tmp_path):
    """With OUT set (the device tool returns at most 8 files), run_gpu_matrix.sh leaves one results.tgz holding
    what its stages wrote (here only the report), not the earlier records it copied in for that report."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "STAGES": "none", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        ["bash", "experiments/run_gpu_matrix.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["results.tgz"]
    listing = subprocess.run(["tar", "tzf", str(tmp_path / "results.tgz")], capture_output=True, text=True).stdout
    names = {Path(n).name for n in listing.split()}
    assert "REPORT.md" in names and not any(n.startswith("bench_mla") for n in names), names
