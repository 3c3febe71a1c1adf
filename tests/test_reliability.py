"""`ddtree-generate` end to end on a tiny synthetic target + drafter: bad checkpoints and configs, the memory
refusal, and real runs (ar / dflash / ddtree agree at temperature 0; --resume skips finished ids).

Every bad input must give exit code 2, one `error:` line naming the problem, and no output file (nor a temp
file). Most runs are in process (`cli_main(generate.main)`, the entry point's own wrapper) to share one jax
import; one per kind of failure also goes through `python -m ddtree_jax.generate`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from absl import flags
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx
from test_generate_cli import Cli, drafter_config, target_config

from ddtree_jax import api, generate, memory
from ddtree_jax.dflash_checkpoint import save_drafter
from ddtree_jax.errors import cli_main
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.training import synthetic

CFG = tiny_kimi_config()
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
PROMPTS = [{"id": f"r{i}", "prompt_ids": list(range(3 + i, 3 + 4 * (i + 1)))} for i in range(4)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """target/ and drafter/ checkpoints, written once; tests copy them."""
    root = tmp_path_factory.mktemp("pair")
    synthetic.write_hf_checkpoint(root / "target", CFG, seed=5)
    save_drafter(DFlashDrafter(tiny_dflash_config(CFG), rngs=nnx.Rngs(6)), root / "drafter")
    return root


class Run:
    """A copy of the pristine pair, a prompts file, and `generate` invoked in process or as a subprocess."""

    def __init__(self, pristine: Path, tmp: Path):
        self.tmp = tmp
        for name in ("target", "drafter"):
            shutil.copytree(pristine / name, tmp / name)
        self.target, self.drafter = tmp / "target", tmp / "drafter"
        self.prompts = tmp / "prompts.jsonl"
        self.prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
        self.output = tmp / "out.jsonl"

    def argv(self, **overrides: object) -> list[str]:
        args = {
            "target": self.target,
            "drafter": self.drafter,
            "prompts": self.prompts,
            "output": self.output,
        }
        args |= {"method": "ddtree", "max_new_tokens": 6, "batch_size": 2, "dtype": "float32", "ignore_eos": True}
        args |= overrides
        return [f"--{k}={v}" if not isinstance(v, bool) else f"--{'' if v else 'no'}{k}" for k, v in args.items()]

    def in_process(self, capsys: pytest.CaptureFixture, **overrides: object) -> tuple[int, str]:
        """(exit code, stderr) of `cli_main(generate.main)` on these flags."""
        try:
            cli_main(generate.main)(flags.FLAGS(["ddtree-generate", *self.argv(**overrides)]))
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            flags.FLAGS.unparse_flags()
        return code, capsys.readouterr().err

    def subprocess(self, env: dict[str, str] | None = None, **overrides: object) -> tuple[int, str]:
        proc = subprocess.run(
            [sys.executable, "-m", "ddtree_jax.generate", *self.argv(**overrides)],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")} | (env or {}),
        )
        return proc.returncode, proc.stderr

    def records(self, path: Path | None = None) -> list[dict]:
        return [json.loads(line) for line in (path or self.output).read_text().splitlines()]

    def assert_user_error(self, result: tuple[int, str], *fragments: str) -> None:
        code, err = result
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2, err
        assert len(errors) == 1 and "Traceback" not in err, err
        for fragment in fragments:
            assert fragment in errors[0], errors[0]
        assert not self.output.exists()
        assert {p.name for p in self.tmp.iterdir()} == {"target", "drafter", "prompts.jsonl"}  # no temp file


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Iterator[Run]:
    yield Run(pristine, tmp_path)


def rewrite_target(r: Run, edit: Callable[[dict[str, np.ndarray]], object]) -> None:
    tensors = synthetic.random_hf_tensors(CFG, seed=5)
    edit(tensors)
    shutil.rmtree(r.target)
    synthetic.write_hf_checkpoint(r.target, CFG, tensors)


# ---- bad checkpoints: found while loading, after every cheaper check passed ----------------------------


def test_missing_shard(run: Run, capsys: pytest.CaptureFixture) -> None:
    (run.target / SHARD2).unlink()
    run.assert_user_error(run.in_process(capsys), f"{SHARD2}: shard file missing")


def test_missing_tensor(run: Run, capsys: pytest.CaptureFixture) -> None:
    rewrite_target(run, lambda t: t.pop("lm_head.weight"))
    run.assert_user_error(run.in_process(capsys), "tensor 'lm_head.weight' missing")


def test_wrong_shape(run: Run, capsys: pytest.CaptureFixture) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite_target(run, lambda t: t.__setitem__(name, t[name][:, :-1].copy()))
    run.assert_user_error(run.in_process(capsys), f"tensor '{name}' has shape [64, 95], expected [64, 96]")


def test_wrong_dtype(run: Run, capsys: pytest.CaptureFixture) -> None:
    rewrite_target(run, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].astype(np.float32)))
    run.assert_user_error(run.in_process(capsys), "tensor 'model.norm.weight' has dtype F32, expected bfloat16")


def test_truncated_safetensors_through_the_entry_point(run: Run) -> None:
    shard = run.target / SHARD1
    shard.write_bytes(shard.read_bytes()[:-100])
    run.assert_user_error(run.subprocess(), f"{SHARD1}: truncated safetensors file")


def test_drafter_missing_tensor(run: Run, capsys: pytest.CaptureFixture) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(run.drafter / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(run.drafter / "model.safetensors"))
    run.assert_user_error(run.in_process(capsys), "tensor 'layers.1.mlp.up_proj.weight' missing")


# ---- bad configs: refused before any weight is read (no jax import) -------------------------------------


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path)


def test_unsupported_architecture(cli: Cli) -> None:
    (cli.target / "config.json").write_text(json.dumps(target_config(model_type="llama")))
    cli.assert_user_error(cli.run(), "config.json: model_type 'llama' is not supported")


def test_unsupported_quant_format(cli: Cli) -> None:
    qc = {"quant_method": "awq", "format": "gemm"}
    (cli.target / "config.json").write_text(json.dumps(target_config(quantization_config=qc)))
    cli.assert_user_error(cli.run(), "quantization_config 'awq'/'gemm' is not supported")


def test_drafter_not_dflash(cli: Cli) -> None:
    (cli.drafter / "config.json").write_text(json.dumps(drafter_config(architectures=["Qwen3ForCausalLM"])))
    cli.assert_user_error(cli.run(), "is not a DFlash drafter")


def test_drafter_vocabulary_mismatch(cli: Cli) -> None:
    (cli.drafter / "config.json").write_text(json.dumps(drafter_config(vocab_size=1024)))
    cli.assert_user_error(cli.run(), "drafter vocab_size 1024 does not match the target's 512")


def test_drafter_config_missing(cli: Cli) -> None:
    (cli.drafter / "config.json").unlink()
    cli.assert_user_error(cli.run(), "drafter/config.json: config.json not found")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"id": "e", "prompt_ids": []}, "prompt 'e' is empty"),
        ({"prompt_ids": [1]}, "missing 'id'"),
        ({"id": "q", "prompt": "x", "prompt_ids": [1]}, "needs exactly one of 'prompt', 'prompt_ids' and 'messages'"),
    ],
)
def test_more_bad_prompts(cli: Cli, record: dict, message: str) -> None:
    cli.write_prompts(record)
    cli.assert_user_error(cli.run(), message)


# ---- memory refusal ---------------------------------------------------------------------------------------


def test_memory_refusal_nothing_fits(run: Run) -> None:
    result = run.subprocess(env={memory.FREE_BYTES_ENV: "1000"})
    run.assert_user_error(result, "not enough device memory: batch 2 x context 38 (ddtree)", "nothing fits")


def test_memory_refusal_says_the_largest_batch(run: Run, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    # Prompts pad to 32 tokens; + 6 new tokens = context 38; float32 activations and weights.
    kw = {"max_len": 38, "prompt_len": 32, "method": "ddtree", "budget": 16, "dtype_bytes": 4}
    one = memory.plan(CFG, tiny_dflash_config(CFG), batch=1, **kw).total
    monkeypatch.setenv(memory.FREE_BYTES_ENV, str(one))
    run.assert_user_error(
        run.in_process(capsys, batch_size=3),
        "batch 3 x context 38 (ddtree) needs",
        "free; largest batch at this context: 1",
    )


# ---- real runs ------------------------------------------------------------------------------------------


def test_methods_agree_and_resume_skips_done_ids(
    run: Run, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One Generator for all runs: the resumed run reuses the compiled ddtree program (CPU compiles are slow).
    loaded: dict[tuple, api.Generator] = {}
    load = api.Generator.load

    def cached_load(*args: object, **kw: object) -> api.Generator:
        key = (*args, *sorted(kw.items()))
        if key not in loaded:
            loaded[key] = load(*args, **kw)
        return loaded[key]

    monkeypatch.setattr(api.Generator, "load", cached_load)
    outputs = {}
    for method in ("ar", "dflash", "ddtree"):
        out = run.tmp / f"{method}.jsonl"
        code, err = run.in_process(capsys, method=method, budget=6, output=out)
        assert code == 0, err
        outputs[method] = run.records(out)
        out.unlink()
    ids = [p["id"] for p in PROMPTS]
    for method, recs in outputs.items():
        assert [r["id"] for r in recs] == ids, method
        assert all(len(r["token_ids"]) == 6 for r in recs), method
        assert [r["token_ids"] for r in recs] == [r["token_ids"] for r in outputs["ar"]], method
    assert all(r["stats"]["tokens_per_round"] == 1.0 for r in outputs["ar"])
    assert len(loaded) == 1
    # An interrupted run: the first batch (r0, r1) is done. --resume generates only r2, r3, keeps r0, r1 as
    # they are (the marker proves they were not regenerated) and keeps input order.
    done = [outputs["ar"][0] | {"marker": 1}, outputs["ar"][1] | {"marker": 1}]
    run.output.write_text("".join(json.dumps(r) + "\n" for r in reversed(done)))
    seen: list[list[list[int]]] = []
    real = api.Generator.generate

    def spy(self: api.Generator, prompts: list[list[int]], **kw: object) -> api.GenerationResult:
        seen.append(prompts)
        return real(self, prompts, **kw)

    monkeypatch.setattr(api.Generator, "generate", spy)
    code, err = run.in_process(capsys, method="ddtree", budget=6, resume=True)
    assert code == 0, err
    assert seen == [[PROMPTS[2]["prompt_ids"], PROMPTS[3]["prompt_ids"]]]
    resumed = run.records()
    assert resumed[:2] == done and [r["id"] for r in resumed] == ids
    assert [r["token_ids"] for r in resumed[2:]] == [r["token_ids"] for r in outputs["ddtree"][2:]]
