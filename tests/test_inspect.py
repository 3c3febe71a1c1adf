"""`ddtree-inspect` / `sizing.model_sizes` on the real K2.6 and K2-Thinking configs (kimi_k2.md §4, §8): JSON on
stdout, human units on stderr, the memory plan, and this machine's check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_jax.config import load_kimi_config
from ddtree_jax.sizing import model_sizes
from experiments.common import RELEASED_CONFIGS

REPO = Path(__file__).resolve().parents[1]


def spec_numbers() -> dict[str, int]:
    """Written out from the spec's tables: 61 layers (1 dense + 60 MoE), 384 experts, top-8, vocab 163,840."""
    hidden, vocab, layers, moe_layers = 7168, 163840, 61, 60
    attn = (
        1536 * 7168  # q_a_proj
        + 1536  # q_a_layernorm
        + 12288 * 1536  # q_b_proj
        + 576 * 7168  # kv_a_proj_with_mqa
        + 512  # kv_a_layernorm
        + 16384 * 512  # kv_b_proj
        + 7168 * 8192  # o_proj
    )
    assert attn == 101_124_096  # "101.1M params/layer"
    expert = 2 * 2048 * 7168 + 7168 * 2048
    assert expert == 44_040_192  # kimi_k2.md §4
    expert_bytes = expert // 2 + expert // 32 * 2  # int4 + bf16 scale per 32 inputs
    norms = 2 * hidden * layers + hidden
    dense = 3 * 18432 * 7168
    shared = 3 * 2048 * 7168 * moe_layers
    router, bias = 384 * 7168 * moe_layers, 384 * moe_layers
    embed = lm_head = vocab * hidden
    bf16 = attn * layers + norms + dense + shared + router + lm_head
    return {
        "total_params": bf16 + embed + bias + 384 * expert * moe_layers,
        "active_params_per_token": bf16 + bias + 8 * expert * moe_layers,
        "weight_bytes": 2 * (bf16 + embed) + 4 * bias + 384 * moe_layers * expert_bytes,
        "kv_cache_bytes_per_token": 576 * 2 * layers,
        "decode_bytes_per_token": 2 * bf16 + 4 * bias + 8 * moe_layers * expert_bytes,
        "decode_fixed_bytes": 2 * bf16 + 4 * bias,
        "expert_bytes": expert_bytes,
    }


@pytest.mark.parametrize("name", ["kimi-k2.6", "kimi-k2-thinking"])
def test_model_sizes_real_configs(name):
    got = model_sizes(load_kimi_config(RELEASED_CONFIGS / name))
    assert got == spec_numbers()
    # The spec's rounded figures (§4, §5, §8).
    assert round(got["total_params"] / 1e9, 1) == 1026.4
    assert 31e9 < got["active_params_per_token"] < 33e9
    assert got["expert_bytes"] == 24_772_608
    assert round(got["weight_bytes"] / 1e9) == 594
    assert got["kv_cache_bytes_per_token"] == 70_272
    assert round(got["decode_bytes_per_token"] / 1e9, 1) == 33.0
    assert round(got["decode_fixed_bytes"] / 1e9, 1) == 21.1


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddtree_jax.inspect", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=None if env is None else os.environ | env,
    )


def test_cli_prints_json():
    out = _cli(f"--target={RELEASED_CONFIGS / 'kimi-k2.6'}", "--nomachine")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == spec_numbers()


def test_cli_human_units_on_stderr():
    out = _cli(f"--target={RELEASED_CONFIGS / 'kimi-k2.6'}", "--nomachine")
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        "parameters      1.03 T params, 31.7 B active per token",
        "weights         594.2 GB as stored (one routed expert 24.8 MB)",
        "KV cache        70.3 KB per token",
        "decode reads    33.0 GB of weights per step at batch 1 (21.1 GB besides the routed experts)",
    ]


def test_cli_machine_on_cpu():
    out = _cli(f"--target={RELEASED_CONFIGS / 'kimi-k2.6'}")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got.pop("machine") | {"kind": None} == {
        "devices": 1,
        "platform": "cpu",
        "kind": None,
        "device_limit_bytes": None,
        "device_bytes": None,
        "mem_fraction_in_effect": None,
        "run": {"batch": 1, "max_len": 8192, "prompt_len": None, "method": "ar", "budget": 16, "exact": False},
        "fits": None,
    }
    assert got == spec_numbers()
    assert out.stderr.splitlines()[-1] == "this machine    no accelerator (1 cpu device): no memory plan to check"
    assert "tpu" not in out.stderr.lower()


def test_cli_malformed_config(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "kimi_k2", "hidden_size": 7168}))
    out = _cli(f"--target={tmp_path}")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(bad) in lines[0], out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_cli_prints_the_memory_plan():
    from ddtree_jax import memory
    from ddtree_jax.config import load_dflash_config

    target, drafter = RELEASED_CONFIGS / "kimi-k2.6", RELEASED_CONFIGS / "kimi-k2.5-dflash"
    args = ["--batch_size=4", "--max_len=8192", "--prompt_len=1024", "--mesh=expert=8", "--device_gb=141"]
    out = _cli(f"--target={target}", f"--drafter={drafter}", "--method=ddtree", *args, "--nomachine")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    plan = got.pop("plan")
    assert got == spec_numbers()  # the size fields are unchanged
    t, d = load_kimi_config(target), load_dflash_config(drafter)
    kw = {"method": "ddtree", "budget": 16, "layout": memory.Layout(expert=8)}
    want = memory.plan(t, d, batch=4, max_len=8192, prompt_len=1024, **kw)
    assert plan["total_bytes"] == want.total and plan["weights"] == want.weights
    assert plan["layout"] == {"data": 1, "expert": 8, "tensor": 1} and plan["fits"] is True
    assert plan["largest_batch"] == memory.largest_batch(t, d, 141e9, max_len=8192, prompt_len=1024, **kw) > 4
    # With the chunked prefill a prompt filling the context no longer needs prompt^2 memory: beyond 8K fits.
    assert plan["longest_context"] > 8192
    lines = out.stderr.splitlines()
    assert lines[4] == "plan            batch 4 x 8192 tokens (ddtree budget 16, --mesh=expert=8): 114.7 GB per device"
    assert lines[6].startswith(f"                fits 141.0 GB: largest batch {plan['largest_batch']} at this context")


def test_cli_plan_without_drafter_is_ar():
    out = _cli(f"--target={RELEASED_CONFIGS / 'kimi-k2.6'}", "--batch_size=1", "--max_len=1024", "--nomachine")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["plan"]["method"] == "ar"
    assert "--method=auto without --drafter is ar" in out.stderr


def test_cli_auto_plans_its_largest_candidate(tmp_path):
    """--method=auto (the default) plans for the candidate verifying the most tokens: of ddtree-calibrate's
    defaults, or of the calibration.json beside the drafter."""
    from test_auto import make_table

    target, drafter = RELEASED_CONFIGS / "kimi-k2.6", tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_bytes((RELEASED_CONFIGS / "kimi-k2.5-dflash" / "config.json").read_bytes())
    args = [f"--target={target}", f"--drafter={drafter}", "--batch_size=1", "--max_len=1024", "--nomachine"]
    out = _cli(*args)
    assert out.returncode == 0, out.stderr
    assert (json.loads(out.stdout)["plan"]["method"], json.loads(out.stdout)["plan"]["budget"]) == ("ddtree", 32)
    assert "--method=auto: planned for its largest candidate, ddtree-32 (default candidates)" in out.stderr
    make_table(("ar", "dflash", "ddtree-4")).save(drafter / "calibration.json")
    out = _cli(*args)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["plan"]["method"] == "dflash"  # 1 + D = 8 tokens verified, more than 1 + 4
    assert _cli(*args, "--budget=8").stderr.strip() == (
        "error: --method=auto chooses the budget: pass --budget with --method=ddtree"
    )


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_cli_explicit_method_needs_drafter(method):
    out = _cli(f"--target={RELEASED_CONFIGS / 'kimi-k2.6'}", "--batch_size=1", "--max_len=1024", f"--method={method}")
    assert out.returncode == 2 and out.stderr.strip() == f"error: --method={method} needs --drafter"


def test_cli_plan_needs_both_sizes():
    out = _cli(f"--target={RELEASED_CONFIGS / 'kimi-k2.6'}", "--batch_size=4")
    assert out.returncode == 2 and "error: --batch_size and --max_len go together" in out.stderr


def test_cli_hub_ids_from_the_offline_cache(tmp_path):
    from test_hub import write_hub_model

    write_hub_model(
        tmp_path, "moonshotai/Kimi-K2.6", {"config.json": (RELEASED_CONFIGS / "kimi-k2.6/config.json").read_bytes()}
    )
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = _cli("--target=moonshotai/Kimi-K2.6", "--nomachine", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == spec_numbers()
    missing = _cli("--target=moonshotai/Kimi-K2.6", "--drafter=z-lab/Kimi-K2.5-DFlash", env=env)
    assert missing.returncode == 2 and missing.stdout == ""
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: z-lab/Kimi-K2.5-DFlash: no such local directory")


def test_cli_plans_the_exact_numerics_on_one_device():
    from ddtree_jax import memory
    from ddtree_jax.config import load_dflash_config

    target, drafter = RELEASED_CONFIGS / "kimi-k2.6", RELEASED_CONFIGS / "kimi-k2.5-dflash"
    run = ["--method=ddtree", "--batch_size=2", "--max_len=2048", "--prompt_len=1024", "--nomachine"]
    out = _cli(f"--target={target}", f"--drafter={drafter}", *run, "--exact")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["plan"]
    t, d = load_kimi_config(target), load_dflash_config(drafter)
    want = memory.plan(t, d, batch=2, max_len=2048, prompt_len=1024, method="ddtree", budget=16, exact=True)
    assert plan["exact"] is True and plan["total_bytes"] == want.total and plan["workspace"] == want.workspace
    assert "(ddtree budget 16, exact, --mesh=" in out.stderr
    refused = _cli(f"--target={target}", f"--drafter={drafter}", *run, "--exact", "--mesh=expert=8")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == "error: --exact runs on one device: drop --mesh"


@pytest.mark.parametrize(
    ("backend", "devices", "args", "want"),
    [
        ("gpu", 1, [], True),  # what ddtree-generate runs there by default in bf16
        ("gpu", 8, [], False),  # several GPUs get a mesh, where the exact numerics are off
        ("gpu", 1, ["--mesh=expert=1"], False),
        ("gpu", 1, ["--noexact"], False),
        ("cpu", 1, [], False),  # float32 there, exact without them
        ("cpu", 1, ["--exact"], True),
    ],
)
def test_the_plans_exact_default_follows_ddtree_generates(backend: str, devices: int, args: list, want: bool):
    """`planned_exact` with the backend and device count faked (the flags parsed as the CLI parses them)."""
    script = (
        "import sys, jax; from absl import flags\n"
        f"jax.default_backend = lambda: {backend!r}; jax.device_count = lambda: {devices}\n"
        "from ddtree_jax import inspect\n"
        "flags.FLAGS(sys.argv)\n"
        "print(inspect.planned_exact())\n"
    )
    target = f"--target={RELEASED_CONFIGS / 'kimi-k2.6'}"
    out = subprocess.run(
        [sys.executable, "-c", script, target, *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(want)
