"""`ddtree_jax.machine`: the K2.6 + K2.5-DFlash plan against described GPU machines (no GPU needed): the mesh and
XLA memory fraction it suggests, and what it says when nothing fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_jax import machine, memory
from ddtree_jax.config import load_dflash_config, load_kimi_config

CONFIGS = Path(__file__).resolve().parents[1] / "experiments" / "configs"
GB = 1e9


@pytest.fixture(scope="module")
def pair():
    return load_kimi_config(CONFIGS / "kimi-k2.6"), load_dflash_config(CONFIGS / "kimi-k2.5-dflash")


def gpus(n: int, card_gb: float, kind: str, fraction: float = machine.DEFAULT_MEM_FRACTION) -> machine.Devices:
    return machine.Devices(n, "gpu", kind, int(card_gb * GB * fraction), fraction)


RUN = {"batch": 4, "max_len": 8192, "prompt_len": 1024, "method": "ddtree", "budget": 16}


def test_layouts_divide_the_model(pair):
    target, _ = pair
    got = machine.layouts(8, target)
    assert got[0] == memory.Layout(expert=8)  # the engine's default first
    assert len(got) == len(set(got)) and all(lay.data * lay.expert * lay.tensor == 8 for lay in got)
    assert memory.Layout(expert=1, tensor=8) in got and memory.Layout(data=8) in got
    assert memory.Layout(expert=5) not in machine.layouts(5, target)  # 384 experts do not split 5 ways


def test_eight_h200_fit_with_a_raised_fraction(pair):
    r = machine.report(gpus(8, 141, "NVIDIA H200"), *pair, mesh=None, **RUN)
    want = memory.plan(*pair, layout=memory.Layout(expert=8), **RUN)
    assert r["fits"] is True and r["mesh"] == "expert=8" and r["total_bytes"] == want.total
    assert r["mem_fraction"] == 0.85  # 114.7 GB of 141 GB: more than the default 0.75
    assert machine.report_text(r) == [
        "this machine    8 x NVIDIA H200, 141.0 GB each (XLA may use 105.8 GB at XLA_PYTHON_CLIENT_MEM_FRACTION=0.75)",
        "                batch 4 x 8192 tokens (ddtree) fits with XLA_PYTHON_CLIENT_MEM_FRACTION=0.85: "
        "--mesh=expert=8, 114.7 GB per device",
    ]


def test_fits_as_it_is(pair):
    r = machine.report(gpus(8, 141, "NVIDIA H200", fraction=0.9), *pair, mesh=None, **RUN)
    assert r["fits"] is True and r["mem_fraction"] is None
    assert machine.report_text(r)[1].startswith("                batch 4 x 8192 tokens (ddtree) fits as it is:")


def test_eight_h100_do_not_fit(pair):
    r = machine.report(gpus(8, 80, "NVIDIA H100"), *pair, mesh=None, **RUN)
    assert r["fits"] is False
    least = min(memory.plan(*pair, layout=lay, **RUN).total for lay in machine.layouts(8, pair[0]))
    assert r["total_bytes"] == least > machine.MAX_MEM_FRACTION * 80 * GB
    assert "does not fit: it needs" in machine.report_text(r)[1]


def test_users_mesh_is_checked_as_given(pair):
    r = machine.report(gpus(8, 141, "NVIDIA H200"), *pair, mesh="expert=4,tensor=2", **RUN)
    assert r["mesh"] == "expert=4,tensor=2"
    assert r["total_bytes"] == memory.plan(*pair, layout=memory.Layout(expert=4, tensor=2), **RUN).total
    wrong = machine.report(gpus(8, 141, "NVIDIA H200"), *pair, mesh="expert=4", **RUN)
    assert wrong["fits"] is False and wrong["problem"] == "--mesh expert=4 is not 8 devices"


def test_exact_numerics_run_on_one_device(pair):
    exact = RUN | {"batch": 1, "max_len": 2048, "exact": True}
    many = machine.report(gpus(8, 141, "NVIDIA H200"), *pair, mesh=None, **exact)
    assert many["fits"] is False and many["problem"] == "the exact numerics run on one device, not 8"
    one = machine.report(gpus(1, 141, "NVIDIA H200"), *pair, mesh=None, **exact)
    assert one["mesh"] == "expert=1" and one["total_bytes"] == memory.plan(*pair, **exact).total


def test_no_accelerator(pair):
    cpu = machine.Devices(1, "cpu", "cpu", None, machine.DEFAULT_MEM_FRACTION)
    r = machine.report(cpu, *pair, mesh=None, **RUN)
    assert r["fits"] is None and r["device_bytes"] is None
    assert machine.report_text(r) == ["this machine    no accelerator (1 cpu device): no memory plan to check"]


@pytest.mark.parametrize(("need", "card", "want"), [(50, 100, 0.5), (50.1, 100, 0.55), (81.3, 141, 0.6)])
def test_needed_fraction(need: float, card: float, want: float):
    assert machine.needed_fraction(int(need * GB), int(card * GB)) == want


def test_device_without_memory_stats(pair):
    r = machine.report(machine.Devices(2, "gpu", "Some GPU", None, 0.75), *pair, mesh=None, **RUN)
    assert r["fits"] is None
    assert machine.report_text(r) == ["this machine    2 x Some GPU: reports no memory, no memory plan to check"]
