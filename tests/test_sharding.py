"""Sharding: mesh specs, the rules table, and the sharded engine on 8 simulated CPU devices.

The 8-device checks run once in a subprocess (tests/sharded_checks.py; the device count must be set before jax
initialises) and report JSON; the tests here assert on it. Meshes: expert=8,tensor=1 / expert=4,tensor=2 /
expert=2,tensor=4 / data=2,expert=4 (batch split), tiny config in f32 against the single-device program.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from ddtree_jax import sharding
from ddtree_jax.mesh_spec import MeshSpecError, parse_mesh_spec

# Under `make test` (`--dist=loadgroup`) the module's tests share one xdist worker: the other keeps running other
# tests while the shared subprocesses below run, instead of waiting on their lock.
pytestmark = pytest.mark.xdist_group("sharded_runs")
MESHES = ["expert=8,tensor=1", "expert=4,tensor=2", "expert=2,tensor=4", "data=2,expert=4"]
TESTS = Path(__file__).resolve().parent


def _finish(proc: subprocess.Popen, name: str, out: Path) -> None:
    """Wait for `proc`; its stdout to out/<name>.out, or on failure its stderr's tail to out/<name>.err."""
    stdout, stderr = proc.communicate(timeout=600)
    if proc.returncode == 0:
        (out / f"{name}.out").write_text(stdout)
    else:
        (out / f"{name}.err").write_text(f"exit {proc.returncode}: {stderr[-4000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The module's two subprocesses (the 8-device checks and the bench_rank smoke run), run together once per test
    session: under pytest-xdist the first worker to take the lock runs them into the session's shared temporary
    directory and the others wait for it and read the same files. -> that directory."""
    base = tmp_path_factory.getbasetemp()  # a worker's is <the session's>/popen-gw<i>
    out = (base.parent if hasattr(request.config, "workerinput") else base) / "sharded_runs"
    out.mkdir(exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".done").exists():
            env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
            pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
            script = [sys.executable, str(TESTS / "sharded_checks.py"), *MESHES, str(out)]
            checks = subprocess.Popen(script, env=env, **pipes)
            cmd = [sys.executable, "-m", "experiments.bench_rank", "--tiny", "--prompt_len=8", "--budgets=4"]
            cmd += ["--warmup=2", "--steps=1", f"--out_dir={out}"]
            bench = subprocess.Popen(cmd, cwd=TESTS.parent, **pipes)
            try:
                _finish(checks, "checks", out)
                _finish(bench, "bench", out)
            finally:
                for proc in (checks, bench):
                    if proc.poll() is None:
                        proc.kill()
            (out / ".done").touch()
    return out


def _output(out: Path, name: str) -> str:
    """A subprocess's stdout, or the test fails with its error."""
    err = out / f"{name}.err"
    assert not err.exists(), err.read_text()
    return (out / f"{name}.out").read_text()


@pytest.fixture(scope="module")
def sharded(runs: Path) -> dict:
    return json.loads(_output(runs, "checks").strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", MESHES)
def test_logits_equal_single_device(sharded, mesh):
    r = sharded[mesh]
    assert r["logits_scale"] > 0.1
    assert r["logits_max_diff"] <= 1e-5 * r["logits_scale"]


@pytest.mark.parametrize("mesh", MESHES)
def test_drafter_equals_single_device(sharded, mesh):
    """The drafter's attention per device on its heads and its SwiGLU on its inner columns (reference and the Pallas
    kernels in interpret mode)."""
    r = sharded[mesh]
    assert r["drafter_scale"] > 0.1
    assert all(d <= 1e-5 * r["drafter_scale"] for d in r["drafter_max_diff"].values()), r["drafter_max_diff"]


@pytest.mark.parametrize("mesh", MESHES)
def test_greedy_ddtree_equals_single_device_ar(sharded, mesh):
    assert len(sharded["ar"][0]) == 16
    assert sharded[mesh]["ddtree"] == sharded["ar"]
    assert sharded[mesh]["ddtree_tau"] > 1.5  # the oracle drafts are accepted: deep walks and compaction ran


@pytest.mark.parametrize("mesh", [m for m in MESHES if "tensor=1" not in m and "tensor" in m])
@pytest.mark.parametrize("key", ["tree", "tree_chunked"])  # vocab 96, and 8192: shards past topk.CHUNK
def test_tree_from_vocab_sharded_logits_equals_full(sharded, mesh, key):
    tree = sharded[mesh][key]
    assert tree["structure_equal"]
    assert tree["score_max_diff"] < 1e-5
    assert tree["n_valid"] > 40  # 4 rows x 12 nodes, a few missing in the row with -inf logits


# Independent of the weight declarations' logical axes: what each kind of leaf must be split over.
EXPECTED_SPLIT = [
    (r"layers\.\d+\.mlp\.experts\..*", ("expert", "tensor")),
    (r"lm_head|layers\.\d+\.self_attn\.(q_b_proj|w_uk|w_uv|o_proj)", ("tensor",)),
    (r"layers\.\d+\.mlp\.(shared_experts\.)?(gate|up|down)_proj", ("tensor",)),
]


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_loader_places_each_leaf(sharded, mesh):
    sizes = parse_mesh_spec(mesh)
    leaves = sharded[mesh]["loader"]
    assert len(leaves) > 30
    for name, leaf in leaves.items():
        axes = next((axes for pattern, axes in EXPECTED_SPLIT if re.fullmatch(pattern, name)), ())
        want = 1
        for a in axes:
            want *= sizes[a]
        assert leaf["as_rule"], name
        assert leaf["shards"] == want, name
        assert leaf["bytes_per_device"] * want == leaf["bytes"], name
    assert leaves["layers.1.mlp.experts.gate_up_q"]["shards"] == 8 // sizes["data"]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("expert=8,pipeline=2", "'pipeline=2'"),
        ("expert=0", "sizes >= 1"),
        ("expert8", "'expert8'"),
        ("expert=2,expert=4", "given twice"),
        ("tensor=x", "'tensor=x'"),
    ],
)
def test_bad_mesh_spec(spec, message):
    with pytest.raises(MeshSpecError, match=re.escape(message)):
        parse_mesh_spec(spec)


def test_mesh_spec_sizes_and_device_count():
    assert parse_mesh_spec(" data = 2, expert=4") == {"data": 2, "expert": 4, "tensor": 1}
    mesh = sharding.make_mesh(None)
    assert dict(mesh.shape) == {"data": 1, "expert": jax.device_count(), "tensor": 1}
    with pytest.raises(MeshSpecError, match="multiply to 8, but there are 1 devices"):
        sharding.make_mesh("expert=8", devices=jax.devices()[:1])


def test_single_device_keeps_unsharded_program():
    assert sharding.resolve_mesh(None) is None  # this process has one device
    assert sharding.active_mesh() is None


def test_split_dim_must_divide():
    mesh = sharding.make_mesh("tensor=1")
    assert sharding.logical_spec(mesh, ("vocab", None), (97, 4)) == jax.sharding.PartitionSpec(("tensor",), None)
    fake = type("FakeMesh", (), {"shape": {"data": 1, "expert": 1, "tensor": 2}})()
    with pytest.raises(MeshSpecError, match="lm_head: dim 1 .vocab. has size 97, not divisible by tensor=2"):
        sharding.logical_spec(fake, (None, "vocab"), (64, 97), "lm_head")


def test_cli_rejects_bad_mesh_before_loading(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt_ids": [1]}\n')
    cmd = [sys.executable, "-m", "ddtree_jax.generate", "--target=nowhere", f"--prompts={prompts}"]
    cmd += [f"--output={tmp_path / 'o.jsonl'}", "--method=ar", "--mesh=expert=4,gpus=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --mesh 'expert=4,gpus=2'")


def test_bench_rank_tiny(runs):
    _output(runs, "bench")
    result = json.loads((runs / "bench_rank_tiny.json").read_text())
    ar, tree = result["records"]
    assert (ar["method"], ar["T"], tree["method"], tree["T"]) == ("ar", 1, "ddtree", 5)
    assert result["layout"]["experts_per_rank"] == 2 and result["layout"]["heads_per_rank"] == 1
    # t=8 (expert=1,tensor=8): per layer an attention and an FFN all-reduce over 8, plus the routed psum.
    assert ar["collectives"] == 3 + 3 + 2 + 1
    assert tree["collectives"] == ar["collectives"] + 2 * 2 + 2
    assert 0 < ar["rank_ms"] < ar["round_ms"] and ar["tok_s_8gpu"] == pytest.approx(1e3 / ar["round_ms"])
