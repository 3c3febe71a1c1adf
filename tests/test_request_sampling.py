"""Sampling randomness is per request: a request's samples depend on (seed, its index in the prompts file) alone,
not on the batch it lands in, the batch size, padding rows or --resume (`sampling.request_keys`)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx
from test_engine import chi_square_z

from ddtree_jax import generate
from ddtree_jax.checkpoint import load_target
from ddtree_jax.dflash_checkpoint import save_drafter
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.training import synthetic

VOCAB = 8
PROMPT = [1, 4, 2, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target (HF format, INT4 experts) and drafter on disk, as the CLI reads them."""
    tmp = tmp_path_factory.mktemp("pair")
    cfg = tiny_kimi_config(vocab_size=VOCAB)
    target = synthetic.write_hf_checkpoint(tmp / "target", cfg, seed=3)
    drafter = save_drafter(DFlashDrafter(tiny_dflash_config(cfg), rngs=nnx.Rngs(4), dtype=jnp.float32), tmp / "d")
    return target, drafter


def run_cli(pair: tuple[Path, Path], prompts: Path, output: Path, *extra: str) -> list[dict]:
    argv = [f"--target={pair[0]}", f"--drafter={pair[1]}", f"--prompts={prompts}", f"--output={output}"]
    common = ["--dtype=float32", "--ignore_eos", "--temperature=1.0", "--seed=11"]
    try:
        generate.main(flags.FLAGS(["ddtree-generate", *argv, *common, *extra]))
    finally:
        flags.FLAGS.unparse_flags()
    return [json.loads(line) for line in output.read_text().splitlines()]


def write_prompts(path: Path, rows: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(rows)))
    return path


def first_token_distribution(target_dir: Path) -> np.ndarray:
    """The target's exact next-token distribution after PROMPT at temperature 1, `[VOCAB]` float64."""
    target = load_target(target_dir, dtype=jnp.float32)
    n = len(PROMPT)
    out = target(jnp.asarray([PROMPT]), jnp.arange(n)[None], target.init_cache(1, n), jnp.zeros((1,), jnp.int32))
    return np.asarray(jax.nn.softmax(target.logits(out.hidden[0, -1])), np.float64)


def test_one_prompt_repeated_over_batches_samples_the_target_distribution(pair, tmp_path):
    """1,024 copies of one prompt in batches of 64 (`ar`, first token): the frequencies follow the target's exact
    distribution. With one key for every batch, each batch repeated the first one's 64 draws (z in the hundreds)."""
    n = 1024
    records = run_cli(
        pair, write_prompts(tmp_path / "p.jsonl", [PROMPT] * n), tmp_path / "o.jsonl", "--method=ar",
        "--batch_size=64", "--max_new_tokens=1",
    )  # fmt: skip
    first = np.array([[r["token_ids"][0]] for r in records])
    probs = first_token_distribution(pair[0])
    assert abs(chi_square_z(first, np.arange(VOCAB)[:, None], probs, VOCAB)) < 5
    batches = first.reshape(n // 64, 64)
    assert len({tuple(b) for b in batches}) == n // 64  # no batch repeats another


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_outputs_do_not_depend_on_batch_size_or_resume(pair, tmp_path, method):
    """The same file at --batch_size 1, 4 and 64 (one batch of all 10), and at 4 resumed after 6 requests, gives
    every request the same sampled tokens; equal prompts at different indices draw different samples."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, VOCAB - 1, int(rng.integers(1, 9))).tolist() for _ in range(7)] + [PROMPT] * 3
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    extra = [f"--method={method}", "--budget=4", "--max_new_tokens=6"]
    runs = {b: run_cli(pair, prompts, tmp_path / f"o{b}.jsonl", f"--batch_size={b}", *extra) for b in (1, 4, 64)}
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(json.dumps(r) + "\n" for r in runs[4][:6]))
    runs["resumed"] = run_cli(pair, prompts, resumed, "--batch_size=4", "--resume", *extra)
    tokens = {name: [r["token_ids"] for r in recs] for name, recs in runs.items()}
    assert tokens[1] == tokens[4] == tokens[64] == tokens["resumed"]
    assert len({tuple(t) for t in tokens[1][7:]}) > 1  # the three copies of PROMPT are independent draws
