"""`method="auto"`: the cost table (JSON, interpolation, the choice, running acceptance), auto through the API and
`ddtree-generate` (lossless: greedy output equals `ar`'s; the choice is reported), the refusals (no table, a table
from another device or dtype, a budget), and `ddtree-calibrate` on a tiny pair."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Sequence
from pathlib import Path

import jax
import pytest
from absl import flags

from ddtree_jax import api, generate
from ddtree_jax.calibration import measure
from ddtree_jax.cost_table import AR_MARGIN, Acceptance, Candidate, CostTable
from ddtree_jax.errors import UserError, cli_main
from experiments import workload

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
KW = {"max_new_tokens": 8, "ignore_eos": True}  # the CLI runs below use the same settings: same programs


def make_table(
    names: Sequence[str] = ("ar", "ddtree-4"),
    round_ms: dict[str, float] | None = None,
    tokens_per_round: dict[str, float] | None = None,
    call_ms: dict[str, float] | None = None,
    **identity: str | int,
) -> CostTable:
    """A one-point table of `names` (round and call times and acceptance default to 1 ms, 1 ms and 1 token; the
    acceptance measured over 10 rounds), measured on this machine's device kind, one device, float32 unless
    `identity` says otherwise."""
    ms, tpr, call = round_ms or {}, tokens_per_round or {}, call_ms or {}
    measured = {"device_kind": jax.devices()[0].device_kind, "device_count": 1, "dtype": "float32"} | identity
    return CostTable(
        **measured,
        jax_version=jax.__version__,
        target="t",
        drafter="d",
        batches=(1,),
        contexts=(64,),
        round_ms={n: ((ms.get(n, 1.0),),) for n in names},
        call_ms={n: ((call.get(n, 1.0),),) for n in names},
        tokens_per_round={n: tpr.get(n, 1.0) for n in names},
        acceptance_rounds=10,
    )


N = 9  # tokens generated in the choices below: a 1 ms call, then 8 tokens in rounds
TREE_WINS = make_table(round_ms={"ddtree-4": 1.5}, tokens_per_round={"ddtree-4": 3.0})  # 1 + 8/3 x 1.5 = 5 ms vs 9
AR_WINS = make_table(round_ms={"ddtree-4": 5.0}, tokens_per_round={"ddtree-4": 3.0})  # 1 + 8/3 x 5 = 14.3 ms


# ---- the table -----------------------------------------------------------------------------------------------


def test_candidate_names() -> None:
    assert [Candidate.parse(n).name for n in ("ar", "dflash", "ddtree-8")] == ["ar", "dflash", "ddtree-8"]
    assert Candidate.parse("ddtree-8") == Candidate("ddtree", 8) and Candidate("ar").spec_budget == 16
    for bad in ("beam", "ddtree", "ddtree-x", "ddtree-0", "ar-4"):
        with pytest.raises(ValueError):
            Candidate.parse(bad)


def test_table_round_trips_through_json(tmp_path: Path) -> None:
    table = CostTable(
        device_kind="NVIDIA H200",
        device_count=8,
        dtype="bfloat16",
        jax_version="0.11.2",
        target="checkpoints/kimi-mini",
        drafter="checkpoints/kimi-mini-dflash",
        batches=(1, 8),
        contexts=(64, 1024, 4096),
        round_ms={"ar": ((1.0, 1.1, 1.5), (1.2, 1.3, 2.0)), "ddtree-8": ((1.5, 1.7, 2.5), (2.5, 2.9, 4.0))},
        call_ms={"ar": ((3.0, 9.0, 30.0), (4.0, 20.0, 80.0)), "ddtree-8": ((4.0, 11.0, 35.0), (5.0, 24.0, 90.0))},
        tokens_per_round={"ar": 1.0, "ddtree-8": ((4.5, 3.98, 3.2), (4.4, 3.9, 3.1))},
        acceptance_rounds=1200,
        settings={"max_new_tokens": 64, "repeats": 3},
    )
    table.save(tmp_path / "calibration.json")
    back = CostTable.load(tmp_path / "calibration.json")
    assert back == table and back.source == str(tmp_path / "calibration.json")
    assert back.candidates == (Candidate("ar"), Candidate("ddtree", 8))
    assert json.loads((tmp_path / "calibration.json").read_text())["device_kind"] == "NVIDIA H200"
    assert back.tokens_per_round["ar"] == ((1.0,) * 3,) * 2  # one number per candidate: the same at every point


def test_a_table_of_the_previous_format_holds_its_one_acceptance_everywhere(tmp_path: Path) -> None:
    raw = make_table(tokens_per_round={"ddtree-4": 3.0}).to_json()
    raw["format"] = "ddtree-cost-table/2"
    raw["candidates"]["ar"]["tokens_per_round"], raw["candidates"]["ddtree-4"]["tokens_per_round"] = 1.0, 3.0
    (tmp_path / "calibration.json").write_text(json.dumps(raw))
    table = CostTable.load(tmp_path / "calibration.json")
    assert table.acceptance(1, 64) == table.acceptance(128, 8192) == {"ar": 1.0, "ddtree-4": 3.0}


def test_acceptance_per_grid_point_moves_the_choice_with_the_context() -> None:
    """The chain accepts more at short context and the tree at long (as the shipped pair does past its training
    window): a table that knows it at each grid point picks each where it wins; one pooled figure could not."""
    table = dataclasses.replace(
        make_table(("ar", "dflash", "ddtree-8")),
        contexts=(64, 2048),
        round_ms={"ar": ((1.0, 1.0),), "dflash": ((1.0, 1.0),), "ddtree-8": ((1.2, 1.2),)},
        call_ms={n: ((1.0, 1.0),) for n in ("ar", "dflash", "ddtree-8")},
        tokens_per_round={"ar": 1.0, "dflash": ((5.0, 3.0),), "ddtree-8": ((5.2, 4.2),)},
    )
    assert table.choose(1, 64, 1001, table.acceptance(1, 64)).candidate.name == "dflash"  # 5.0 / 1.0 > 5.2 / 1.2
    assert table.choose(1, 2048, 1001, table.acceptance(1, 2048)).candidate.name == "ddtree-8"  # 4.2 / 1.2 > 3.0
    assert table.acceptance(1, 1056)["dflash"] == pytest.approx(4.0)  # linear in context between points
    acceptance = Acceptance(table)
    acceptance.observe("dflash", 400.0, 100, 1, 2048)  # 300 drafted where the table expects 200 at that point
    assert acceptance.factor > 1 and acceptance.means(1, 2048)["dflash"] == pytest.approx(1 + 2 * acceptance.factor)
    silent = Acceptance(dataclasses.replace(table, tokens_per_round=table.tokens_per_round | {"dflash": ((5.0, 1.0),)}))
    silent.observe("dflash", 400.0, 100, 1, 2048)  # where the table saw no draft accepted: no expectation to scale
    assert silent.factor == 1.0


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "malformed cost table"),
        ('{"format": "other"}', "not a cost table"),
        (json.dumps(make_table().to_json() | {"batches": [8, 1]}), "batches must be increasing"),
        (json.dumps(make_table().to_json() | {"candidates": {}}), "at least one"),
        (json.dumps(make_table().to_json() | {"format": "ddtree-cost-table/1"}), "want 'ddtree-cost-table/3'"),
        (json.dumps(make_table().to_json() | {"acceptance_rounds": 0}), "acceptance_rounds must be an integer >= 1"),
    ],
)
def test_malformed_table_is_a_user_error_naming_the_file(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "calibration.json").write_text(text)
    with pytest.raises(UserError, match=f"calibration.json: .*{says}"):
        CostTable.load(tmp_path / "calibration.json")
    with pytest.raises(UserError, match="no cost table there"):
        CostTable.load(tmp_path / "missing.json")


def test_round_time_is_linear_in_batch_and_context_and_clamped() -> None:
    grid = ((1.0, 3.0), (5.0, 11.0))  # batches 1, 9 x contexts 100, 300
    table = dataclasses.replace(
        make_table(("ar",)),
        batches=(1, 9),
        contexts=(100, 300),
        round_ms={"ar": grid},
        call_ms={"ar": grid},
        tokens_per_round={"ar": 1.0},
    )
    assert table.round_time("ar", 1, 100) == 1.0 and table.round_time("ar", 9, 300) == 11.0
    assert table.round_time("ar", 1, 200) == 2.0  # halfway in context
    assert table.round_time("ar", 5, 100) == 3.0  # halfway in batch
    assert table.round_time("ar", 5, 200) == pytest.approx((2.0 + 8.0) / 2)
    assert table.round_time("ar", 64, 8192) == 11.0 and table.round_time("ar", 1, 1) == 1.0  # clamped at the ends
    calls = dataclasses.replace(table, call_ms={"ar": tuple(tuple(2 * v for v in row) for row in grid)})
    assert calls.call_time("ar", 5, 200) == pytest.approx(10.0) and calls.round_time("ar", 5, 200) == 5.0


def test_the_choice_follows_the_table() -> None:
    assert AR_WINS.choose(1, 64, N, AR_WINS.acceptance(1, 64)).candidate == Candidate("ar")
    choice = TREE_WINS.choose(1, 64, N, TREE_WINS.acceptance(1, 64))
    assert choice.candidate == Candidate("ddtree", 4)
    assert choice.expected_tokens_per_s == pytest.approx({"ar": 1000.0, "ddtree-4": 1800.0})  # 9 tokens / 9 vs 5 ms
    assert choice.to_dict()["chosen"] == "ddtree-4" and choice.to_dict()["reason"] == "cost table"
    assert TREE_WINS.choose(4, 64, N, TREE_WINS.acceptance(4, 64)).expected_tokens_per_s["ar"] == pytest.approx(4000.0)


def tree_wins_by(faster: float, names: Sequence[str] = ("ar", "ddtree-4"), dflash_ms: float = 9.0) -> CostTable:
    """TREE_WINS (ddtree-4: 1 + 8/3 x 1.5 = 5 ms, 1800 tok/s) with ar's rounds set so that ddtree-4's expected rate is
    `faster` above ar's, and a dflash (3 tokens per round) whose run takes `dflash_ms`."""
    ar_ms = 5.0 * (1 + faster)
    return make_table(
        names,
        round_ms={"ar": (ar_ms - 1) / 8, "ddtree-4": 1.5, "dflash": (dflash_ms - 1) * 3 / 8},
        tokens_per_round={"ddtree-4": 3.0, "dflash": 3.0},
    )


@pytest.mark.parametrize(("faster", "chosen"), [(0.03, "ar"), (0.10, "ddtree-4")])
def test_a_drafter_replaces_ar_only_when_expected_faster_by_the_margin(faster: float, chosen: str) -> None:
    """A table's prediction errs by a few percent: a drafting candidate expected 3% faster than ar leaves ar running,
    10% faster replaces it. The reported expected rates stay the plain ones."""
    assert 0.03 < AR_MARGIN < 0.10
    table = tree_wins_by(faster)
    choice = table.choose(1, 64, N, table.acceptance(1, 64))
    assert choice.candidate.name == chosen and choice.to_dict()["reason"] == "cost table"
    rates = choice.expected_tokens_per_s
    assert rates["ddtree-4"] == pytest.approx(1800.0) and rates["ddtree-4"] / rates["ar"] == pytest.approx(1 + faster)


def test_the_margin_only_guards_leaving_ar() -> None:
    """Between drafting candidates the higher expected rate wins however close (ddtree-4 3% above dflash, which comes
    first in table order), with ar in the table or not; without ar the highest rate wins."""
    near = 5.0 * 1.03  # dflash's ms: ddtree-4's 5 ms is a 3% higher rate
    with_ar = tree_wins_by(0.5, ("ar", "dflash", "ddtree-4"), dflash_ms=near)
    choice = with_ar.choose(1, 64, N, with_ar.acceptance(1, 64))
    assert choice.candidate.name == "ddtree-4"
    assert choice.expected_tokens_per_s["ddtree-4"] / choice.expected_tokens_per_s["dflash"] == pytest.approx(1.03)
    without_ar = tree_wins_by(0.5, ("dflash", "ddtree-4"), dflash_ms=near)
    assert without_ar.choose(1, 64, N, without_ar.acceptance(1, 64)).candidate.name == "ddtree-4"
    slower = tree_wins_by(0.5, ("dflash", "ddtree-4"), dflash_ms=5.0 / 1.03)  # now dflash's rate is 3% higher
    assert slower.choose(1, 64, N, slower.acceptance(1, 64)).candidate.name == "dflash"


def test_the_call_time_counts_more_the_fewer_tokens_a_run_makes() -> None:
    """A program whose rounds are cheaper per token but whose call costs more (a drafter's prefill) wins only when
    the run is long enough to pay that back."""
    table = make_table(round_ms={"ddtree-4": 1.5}, tokens_per_round={"ddtree-4": 3.0}, call_ms={"ddtree-4": 20.0})
    assert table.choose(1, 64, N, table.acceptance(1, 64)).candidate.name == "ar"  # 1 + 8 = 9 ms vs 20 + 4 = 24
    assert table.run_time("ddtree-4", 1, 64, 1001, 3.0) == pytest.approx(520.0)
    assert table.choose(1, 64, 1001, table.acceptance(1, 64)).candidate.name == "ddtree-4"  # 520 ms vs 1001


def test_acceptance_scales_every_drafting_candidate_by_what_was_observed() -> None:
    table = make_table(("ar", "ddtree-4", "dflash"), tokens_per_round={"ddtree-4": 3.0, "dflash": 2.0})
    acceptance = Acceptance(table)  # its 10 rounds worth 10 x 1.5 drafted
    assert acceptance.factor == 1.0 and acceptance.means(1, 64) == {"ar": 1.0, "ddtree-4": 3.0, "dflash": 2.0}
    acceptance.observe("ar", 5.0, 5, 1, 64)  # ar drafts nothing: no news of the content
    acceptance.observe("ddtree-4", 10.0, 10, 1, 64)  # 10 rounds, none accepting a draft: 0 drafted of 20 expected
    assert acceptance.factor == pytest.approx(15 / 35)
    want = {"ar": 1.0, "ddtree-4": 1 + 2 * 15 / 35, "dflash": 1 + 15 / 35}
    assert acceptance.means(1, 64) == pytest.approx(want)
    acceptance.observe("dflash", 300.0, 100, 1, 64)  # 200 drafted where the table expects 100
    assert acceptance.factor == pytest.approx((15 + 200) / (35 + 100))


def test_measured_acceptance_moves_the_choice() -> None:
    acceptance = Acceptance(TREE_WINS)  # worth 10 rounds x 2 drafted
    assert TREE_WINS.choose(1, 64, N, acceptance.means(1, 64)).candidate.name == "ddtree-4"
    acceptance.observe("ddtree-4", 10.0, 10, 1, 64)  # factor 20 / 40: 2 tokens per round, 1 + 4 x 1.5 = 7 ms
    assert acceptance.means(1, 64)["ddtree-4"] == 2.0
    assert TREE_WINS.choose(1, 64, N, acceptance.means(1, 64)).candidate.name == "ddtree-4"
    acceptance.observe("ddtree-4", 10.0, 10, 1, 64)  # 20 / 60: 1.67 tokens per round, 8.2 ms vs ar's 9
    assert TREE_WINS.choose(1, 64, N, acceptance.means(1, 64)).candidate.name == "ddtree-4"
    acceptance.observe("ddtree-4", 10.0, 10, 1, 64)  # 20 / 80: 1.5 per round, 9 ms as ar's: within the margin, ar
    assert TREE_WINS.choose(1, 64, N, acceptance.means(1, 64)).candidate.name == "ar"


FakeSpec = collections.namedtuple("FakeSpec", "kernels key")  # hashable, as a GenSpec is


class TimedGenerator:
    """A Generator whose runs take fixed walls: a 1-token run 1 ms, a full run 13 ms, in which row 0 takes 4 rounds
    and row 1 8 for the tokens past the prefill's (ar: every round commits one token)."""

    drafter = object()

    def device_identity(self) -> dict:
        return {"device_kind": "cpu", "device_count": 1, "dtype": "float32", "exact": False}

    def spec_for(self, rows, **kw):
        return FakeSpec("Kernels()", (len(rows), kw["method"], kw["max_new_tokens"]))

    def precompile(self, specs, workers: int) -> float:
        return 0.0

    def generate(self, rows, *, method: str, max_new_tokens: int, **kw):
        rounds = [4, 8] if method != "ar" else [max_new_tokens - 1] * 2
        stats = [{"rounds": r, "tokens_per_round": (max_new_tokens - 1) / r} for r in rounds]
        wall = 0.001 if max_new_tokens == 1 else 0.013
        return types.SimpleNamespace(stats=stats[: len(rows)], wall_s=wall, batch_rounds=max(rounds))


def test_round_time_is_per_round_of_the_mean_row() -> None:
    """A batch waits for its slowest row: 12 ms over rows of 4 and 8 rounds is 2 ms per round of the mean row (not
    12 / 8), so that the call plus the mean row's rounds is the batch's real time."""
    table = measure(
        TimedGenerator(),
        [[1, 2, 3]],
        candidates=[Candidate("ddtree", 8)],
        batches=[2],
        contexts=[3],
        max_new_tokens=16,
        repeats=1,
        compile_workers=1,
        target="t",
        drafter="d",
    )
    assert table.round_time("ddtree-8", 2, 3) == pytest.approx(2.0) and table.call_time("ddtree-8", 2, 3) == 1.0
    assert table.acceptance(2, 3)["ddtree-8"] == pytest.approx(30 / 12) and table.acceptance_rounds == 12
    rate = table.choose(2, 3, 16, table.acceptance(2, 3)).expected_tokens_per_s["ddtree-8"]
    assert rate == pytest.approx(2 * 16 / 0.013)  # 2 rows x 16 tokens in the 13 ms the run took


class RowsGenerator(TimedGenerator):
    """TimedGenerator whose rows' acceptance is their first token (tokens per round), recording the full runs."""

    def __init__(self):
        self.full_runs = []

    def generate(self, rows, *, method: str, max_new_tokens: int, **kw):
        res = super().generate(rows, method=method, max_new_tokens=max_new_tokens, **kw)
        if max_new_tokens > 1:
            self.full_runs.append([r[0] for r in rows])
            res.stats = [{"rounds": 10, "tokens_per_round": float(r[0])} for r in rows]
        return res


def test_acceptance_is_measured_over_more_rows_than_a_small_batch() -> None:
    """At batch 1, the untimed runs that measure acceptance take one row per prompt (up to ACCEPTANCE_ROWS); the
    timed runs stay on the first row."""
    gen, prompts = RowsGenerator(), [[t] * 4 for t in (2, 3, 4, 5, 6)]
    kw = {"contexts": [4], "max_new_tokens": 8, "compile_workers": 1, "target": "t", "drafter": "d"}
    table = measure(gen, prompts, candidates=[Candidate("dflash")], batches=[1], repeats=2, **kw)
    assert gen.full_runs == [[2], [3], [4], [5], [6], [2], [2]]  # 5 untimed rows, then 2 timed runs of row 0
    assert table.acceptance(1, 4)["dflash"] == pytest.approx(4.0) and table.acceptance_rounds == 50
    gen = RowsGenerator()
    measure(gen, prompts, candidates=[Candidate("dflash")], batches=[2], repeats=1, **kw)
    assert gen.full_runs == [[2, 3], [4, 5], [6, 2], [2, 3]]  # 3 batches of 2 cover the 5 prompts, then row 0's


def test_acceptance_at_a_context_is_pooled_over_the_grids_batches() -> None:
    """A row's acceptance follows its text and context, not its batch: the table holds, at each batch of a
    context, the tokens per round of every row run there (batch 1: rows 2-6; batch 2: rows 2-6 and 2 again)."""
    kw = {"contexts": [4], "max_new_tokens": 8, "compile_workers": 1, "target": "t", "drafter": "d", "repeats": 1}
    prompts = [[t] * 4 for t in (2, 3, 4, 5, 6)]
    table = measure(RowsGenerator(), prompts, candidates=[Candidate("dflash")], batches=[1, 2], **kw)
    pooled = (2 + 3 + 4 + 5 + 6 + 2 + 3 + 4 + 5 + 6 + 2) / 11
    assert table.acceptance(1, 4)["dflash"] == table.acceptance(2, 4)["dflash"] == pytest.approx(pooled)


def test_a_table_from_another_device_dtype_or_exact_setting_is_refused() -> None:
    here = {"device_kind": jax.devices()[0].device_kind, "device_count": 1, "dtype": "float32", "exact": False}
    make_table().check(**here)
    with pytest.raises(UserError, match="measured on 1 x NVIDIA H200 in float32, but this run is on 1 x"):
        make_table(device_kind="NVIDIA H200").check(**here)
    with pytest.raises(UserError, match="in bfloat16, but this run is on .* in float32: run ddtree-calibrate"):
        make_table(dtype="bfloat16").check(**here)
    with pytest.raises(UserError, match="measured on 8 x"):
        make_table(device_count=8).check(**here)
    with pytest.raises(UserError, match="in float32, exact, but this run is on .* in float32: run ddtree-calibrate"):
        make_table(exact=True).check(**here)


# ---- auto through the API and ddtree-generate ---------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return workload.write_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def gen(pair: tuple[Path, Path]) -> api.Generator:
    return api.Generator.load(*pair)  # float32 on a CPU: every method gives ar's tokens


def test_auto_is_lossless_and_reports_its_choice(gen: api.Generator) -> None:
    ar = gen.generate(PROMPTS, method="ar", **KW)
    gen.use_calibration(TREE_WINS)
    res = gen.generate(PROMPTS, method="auto", **KW)
    assert res.tokens == ar.tokens
    assert (res.method, res.budget, res.auto.candidate.name, res.auto.batch, res.auto.context) == (
        "ddtree",
        4,
        "ddtree-4",
        2,
        4,
    )
    committed = sum(s["tokens_per_round"] * s["rounds"] for s in res.stats)
    rounds = sum(s["rounds"] for s in res.stats)
    factor = (10 * 2 + committed - rounds) / (10 * 2 + 2 * rounds)  # the table's 10 rounds, then the batch's
    assert gen.acceptance.means(2, 4)["ddtree-4"] == pytest.approx(1 + 2 * factor)
    gen.use_calibration(AR_WINS)
    res = gen.generate(PROMPTS, method="auto", **KW)
    assert (res.method, res.budget, res.tokens) == ("ar", None, ar.tokens)
    assert gen.acceptance.means(2, 4) == {"ar": 1.0, "ddtree-4": 3.0}  # ar's runs say nothing of the drafts


def test_auto_refusals(gen: api.Generator, pair: tuple[Path, Path], tmp_path: Path) -> None:
    gen.use_calibration(None)
    with pytest.raises(UserError, match="needs a cost table: run ddtree-calibrate"):
        gen.generate(PROMPTS, method="auto", **KW)
    gen.use_calibration(make_table(device_kind="NVIDIA H200"))
    with pytest.raises(UserError, match="measured on 1 x NVIDIA H200"):
        gen.generate(PROMPTS, method="auto", **KW)
    with pytest.raises(ValueError, match="chooses the budget"):
        gen.generate(PROMPTS, method="auto", budget=8, **KW)
    make_table(dtype="bfloat16").save(tmp_path / "bf16.json")
    with pytest.raises(UserError, match="bf16.json: cost table measured on .* in bfloat16"):
        api.Generator.load(*pair, calibration=tmp_path / "bf16.json")  # refused before any weight is read
    shutil.copytree(pair[1], tmp_path / "drafter")
    (tmp_path / "drafter" / "calibration.json").write_text("{torn")
    beside = api.Generator.load(pair[0], tmp_path / "drafter")  # the drafter's own table is read when auto needs it
    assert beside.generate(PROMPTS, method="ar", **KW).tokens == gen.generate(PROMPTS, method="ar", **KW).tokens
    with pytest.raises(UserError, match="drafter/calibration.json: malformed cost table"):
        beside.generate(PROMPTS, method="auto", **KW)


def test_auto_without_a_drafter_is_ar(gen: api.Generator) -> None:
    res = api.Generator(gen.target).generate(PROMPTS, method="auto", pad_batch_to=8, **KW)
    assert res.method == "ar" and res.auto.to_dict() | {"expected_tokens_per_s": None} == {
        "chosen": "ar",
        "reason": "no drafter",
        "batch": 8,  # the padded batch the program runs
        "context": 4,
        "expected_tokens_per_s": None,
    }


class GenerateCli:
    """`ddtree-generate` in process on the tiny pair, its drafter copied so that a table can be put beside it."""

    def __init__(self, pair: tuple[Path, Path], tmp: Path, capsys: pytest.CaptureFixture):
        self.target, self.drafter, self.tmp, self.capsys = pair[0], tmp / "drafter", tmp, capsys
        shutil.copytree(pair[1], self.drafter)
        self.prompts = tmp / "prompts.jsonl"
        self.prompts.write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))

    def __call__(self, *extra: str) -> tuple[int, str, str]:
        """(exit code, stderr, stdout) of a run with these extra flags."""
        argv = [f"--target={self.target}", f"--drafter={self.drafter}", f"--prompts={self.prompts}"]
        argv += ["--batch_size=2", "--max_new_tokens=8", "--ignore_eos", "--dtype=float32"]
        try:
            cli_main(generate.main)(flags.FLAGS(["ddtree-generate", *argv, *extra]))
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            flags.FLAGS.unparse_flags()
        out = self.capsys.readouterr()
        return code, out.err, out.out


@pytest.fixture
def cli(
    gen: api.Generator,
    pair: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> GenerateCli:
    """The CLI loading into the module's Generator (the table it is given included), to reuse its programs."""

    def load(
        target: str, drafter: str, dtype: object, mesh: str | None, calibration: str | None, exact: bool | None
    ) -> api.Generator:
        gen.use_calibration(CostTable.load(calibration) if calibration else None)
        return gen

    monkeypatch.setattr(api.Generator, "load", load)
    return GenerateCli(pair, tmp_path, capsys)


def test_cli_auto_is_the_default_lossless_and_recorded(cli: GenerateCli) -> None:
    code, err, _ = cli("--method=ar", f"--output={cli.tmp / 'ar.jsonl'}")
    assert code == 0, err
    TREE_WINS.save(cli.drafter / "calibration.json")
    code, err, out = cli(f"--output={cli.tmp / 'auto.jsonl'}")
    assert code == 0, err
    ar, auto = (
        [json.loads(line) for line in (cli.tmp / f"{m}.jsonl").read_text().splitlines()] for m in ("ar", "auto")
    )
    assert [r["token_ids"] for r in auto] == [r["token_ids"] for r in ar]
    batch = auto[0]["stats"]["batch"]
    assert (batch["method"], batch["budget"], batch["auto"]["chosen"], batch["auto"]["reason"]) == (
        "ddtree",
        4,
        "ddtree-4",
        "cost table",
    )
    assert ar[0]["stats"]["batch"]["auto"] is None and ar[0]["stats"]["batch"]["method"] == "ar"
    head, row = out.splitlines()
    assert head.split()[0] == "method" and row.split()[:3] == ["auto:", "ddtree-4", "x2"]


def test_cli_auto_refusals(cli: GenerateCli) -> None:
    out = cli.tmp / "out.jsonl"

    def error(*extra: str) -> str:
        code, err, _ = cli(f"--output={out}", *extra)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and not out.exists(), err
        return lines[0]

    assert "--method=auto needs a cost table" in error() and "run ddtree-calibrate" in error()
    assert error("--budget=8") == "error: --method=auto chooses the budget: pass --budget with --method=ddtree"
    assert "--calibration is the cost table of --method=auto" in error("--method=ar", "--calibration=x.json")
    make_table(device_kind="NVIDIA H200").save(cli.drafter / "calibration.json")
    assert "measured on 1 x NVIDIA H200 in float32" in error()
    assert "x.json: no cost table there" in error(f"--calibration={cli.tmp / 'x.json'}")


# ---- ddtree-calibrate ----------------------------------------------------------------------------------------


def calibrate(target: Path, drafter: Path, prompts: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [f"--target={target}", f"--drafter={drafter}", f"--prompts={prompts}", *extra]
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_DEBUG"} | {"JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "ddtree_jax.calibrate", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_calibrate_writes_a_table_beside_the_drafter(pair: tuple[Path, Path], tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    shutil.copytree(pair[1], drafter)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    grid = ["--candidates=ar,ddtree-2", "--batches=2", "--contexts=4000", "--max_new_tokens=4", "--repeats=1"]
    proc = calibrate(pair[0], drafter, prompts, *grid, "--dtype=float32", "--compile_workers=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = CostTable.load(drafter / "calibration.json")
    assert [c.name for c in table.candidates] == ["ar", "ddtree-2"]
    assert (table.batches, table.contexts) == ((2,), (2048 - 4 - 3,))  # lowered to the position limit
    at = table.acceptance(2, table.contexts[0])
    assert table.dtype == "float32" and table.device_count == 1 and at["ar"] == 1.0
    assert at["ddtree-2"] >= 1 and table.settings["prompts"] == str(prompts)
    assert "auto's choice for 4 new tokens at the measured acceptance" in proc.stdout
    again = calibrate(pair[0], drafter, prompts, *grid)  # refused before anything is loaded
    assert again.returncode == 2 and again.stderr.strip().endswith("exists: pass --overwrite to replace it")


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--candidates=ar,beam", "--candidates: candidate method 'beam' not one of"),
        ("--candidates=ddtree-0", "--candidates: a ddtree candidate takes a budget >= 1"),
        ("--batches=0,8", "--batches must be integers >= 1, got 0,8"),
        ("--contexts=long", "--contexts must be integers, got long"),
        ("--repeats=0", "--repeats must be >= 1, got 0"),
        ("--max_new_tokens=1", "--max_new_tokens must be >= 2, got 1"),
        ("--max_new_tokens=5000", "--max_new_tokens 5000 leaves no prompt room below the limit 2048"),
    ],
)
def test_calibrate_refuses_bad_input(pair: tuple[Path, Path], tmp_path: Path, flag: str, says: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "prompt_ids": [5, 6]}\n')
    proc = calibrate(*pair, prompts, flag, f"--output={tmp_path / 'cal.json'}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and says in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "cal.json").exists()
