"""experiments/layer_profile.py on CPU: --tiny end to end into a tmp folder (both layouts, an AR step and a DDTree
round), and its HLO-path labelling and expert count."""

from __future__ import annotations

import json
import math

import pytest
from test_experiments import META, records, run

from experiments import layer_pieces
from experiments.common import RELEASED_CONFIGS
from experiments.rank_model import tiny_configs

PIECES = {
    "dense": {"prologue", "cache_write", "attention", "o_proj", "ffn", "norms_residual", "total"},
    "moe": {"prologue", "cache_write", "attention", "o_proj", "router", "experts", "shared_expert", "norms_residual"}
    | {"total"},
}


def test_tiny_run_reports_every_piece_of_both_layer_kinds(tmp_path):
    run(
        "layer_profile",
        "--tiny",
        "--budgets=8",
        "--concurrency=2",
        "--inner=2",
        "--repeats=1",
        "--compile_workers=2",
        f"--out_dir={tmp_path}",
    )
    recs = records(tmp_path / "layer_profile.json")
    cells = {(r["layout"], r["method"]) for r in recs}
    assert cells == {(lay, m) for lay in ("single", "rank") for m in ("ar", "ddtree")}
    for cell in cells:
        mine = [r for r in recs if (r["layout"], r["method"]) == cell]
        for kind, want in PIECES.items():
            rows = [r for r in mine if r["layer_kind"] == kind]
            assert {r["piece"] for r in rows} == want, (cell, kind)
            for r in rows:
                assert r["kernels"] > 0 and r["us"] > 0 and r["bytes"] > 0, r
                assert math.isfinite(r["copy_fraction"]), r
        lm_head = "step_lm_head" if cell[1] == "ar" else "verify_lm_head"
        assert any(r["piece"] == lm_head and r["bytes"] > 0 for r in mine if r["layer_kind"] == "round")
    payload = json.loads((tmp_path / "layer_profile.json").read_text())
    assert len(payload["cells"]) == 4
    # a difference of two timings: its sign on a loaded 2-core CPU is noise, so only its presence is checked
    assert all(math.isfinite(payload["copy_rates_tbps"][lay]["loop"]) for lay in ("single", "rank"))
    for c in payload["cells"]:
        assert all(c[k] for k in META) and c["kernels_per_iteration"] > 0 and c["busy_us"] > 0
        assert c["kernels"] and c["moe_kernels"] > 0 and c["dense_kernels"] > 0
    # the routed experts' bytes grow with the tokens of a verify block; the rank holds fewer experts
    moe = {(r["layout"], r["method"]): r["bytes"] for r in recs if r["piece"] == "experts"}
    assert moe["single", "ddtree"] > moe["single", "ar"] and moe["rank", "ddtree"] > moe["rank", "ar"]
    assert "## Cells" in (tmp_path / "layer_profile.md").read_text()


def test_piece_label_and_expected_experts():
    cfg, _ = tiny_configs(str(RELEASED_CONFIGS / "kimi-k2.6"), str(RELEASED_CONFIGS / "kimi-k2.5-dflash"))
    label = layer_pieces.piece_label
    body = ["jit(run)", "while", "body", "eval_jaxpr"]
    assert label([*body, "verify", "layer_1", "router", "dot_general"], cfg) == "moe/router"
    assert label([*body, "step", "layer_0", "ffn", "dot_general"], cfg) == "dense/ffn"
    assert label([*body, "verify", "layer_1", "shared_expert", "ffn", "mul"], cfg) == "moe/shared_expert"
    assert label([*body, "verify", "layer_0", "add"], cfg) == "dense/norms_residual"
    assert label([*body, "draft", "lm_head", "dot_general"], cfg) == "round/draft_lm_head"
    assert label([*body, "add"], cfg) == "round/loop"
    assert label(["jit(run)", "copy"], cfg) == "round/outside_loop"
    assert layer_pieces.expected_distinct(384, 8) == pytest.approx(7.93, abs=0.01)  # decode_budget.md's table
    assert layer_pieces.expected_distinct(384, 72) == pytest.approx(65.7, abs=0.1)
