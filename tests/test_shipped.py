"""The shipped pair (checkpoints/kimi-mini + kimi-mini-dflash): loads, is what its manifest says, generates, and
greedy DDTree reproduces ar exactly while accepting more than one token per round."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ddtree_jax.config import check_pair, load_dflash_config, load_kimi_config

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = ROOT / "checkpoints" / "kimi-mini", ROOT / "checkpoints" / "kimi-mini-dflash"
PROMPTS = ROOT / "checkpoints" / "demo_prompts.jsonl"


def test_shipped_checkpoints_are_small_kimi_shaped_and_documented():
    t, d = load_kimi_config(TARGET), load_dflash_config(DRAFTER)
    check_pair(t, d)
    assert t.quant is not None and t.quant.group_size == 32
    assert t.first_k_dense_replace == 1 and t.n_routed_experts == 16 and t.n_shared_experts == 1
    assert t.rope_scaling is not None and d.block_size == 8
    size = sum(f.stat().st_size for p in (TARGET, DRAFTER) for f in p.iterdir())
    assert size < 40e6, size
    manifest = json.loads((TARGET / "training_manifest.json").read_text())["data"]
    listing = json.dumps(manifest["train_files"], sort_keys=True).encode()
    assert hashlib.sha256(listing).hexdigest() == manifest["train_files_sha256"]
    assert hashlib.sha256((TARGET / "tokenizer.json").read_bytes()).hexdigest() == manifest["tokenizer_sha256"]
    trained = {f["path"] for f in manifest["train_files"]}
    for line in PROMPTS.read_text().splitlines():
        assert json.loads(line)["id"].split("#")[0] not in trained


@pytest.fixture(scope="module")
def generator():
    import jax.numpy as jnp

    from ddtree_jax.api import Generator

    return Generator.load(TARGET, DRAFTER, dtype=jnp.float32)  # bf16 near-ties can flip across verify shapes


def test_tokenizer_specials_match_the_configs(generator):
    tok = generator.tokenizer
    assert tok.vocab_size == generator.target_config.vocab_size
    assert tok.stop_ids == generator.target_config.eos_token_ids
    assert tok.encode("[MASK]") == [generator.drafter.config.mask_token_id]
    assert tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"


def test_greedy_ddtree_equals_ar_and_accepts(generator):
    prompt = generator.tokenizer.encode(json.loads(PROMPTS.read_text().splitlines()[0])["prompt"])[:60]
    kw = dict(max_new_tokens=32, ignore_eos=True)
    ar = generator.generate([prompt], method="ar", **kw)
    tree = generator.generate([prompt], method="ddtree", budget=16, **kw)
    assert len(ar.tokens[0]) == 32
    assert tree.tokens == ar.tokens
    assert tree.stats[0]["tokens_per_round"] > 1.5


def test_a_request_past_the_trained_window_is_logged(generator, monkeypatch):
    """The target was trained on 2048-token windows (its manifest says so); a longer request runs, and says so once.
    The window is lowered for the test so that both requests share one small compiled program."""
    from absl import logging

    assert generator.trained_context == 2048
    warnings = []
    monkeypatch.setattr(logging, "log_first_n", lambda level, msg, n, *args: warnings.append(msg % args))
    monkeypatch.setattr(generator, "trained_context", 22)
    generator.generate([[5] * 18], method="ar", max_new_tokens=4, ignore_eos=True)
    assert warnings == []
    generator.generate([[5] * 20], method="ar", max_new_tokens=4, ignore_eos=True)
    assert len(warnings) == 1 and "24 tokens" in warnings[0] and "22-token windows" in warnings[0]


def test_trained_context_reads_the_manifest(tmp_path):
    from ddtree_jax.api import trained_context
    from ddtree_jax.errors import UserError

    assert trained_context(tmp_path) is None  # no manifest: a checkpoint we did not train
    (tmp_path / "training_manifest.json").write_text('{"flags": {"seq_len": 2048}}')
    assert trained_context(tmp_path) == 2048
    (tmp_path / "training_manifest.json").write_text('{"flags": {}}')
    with pytest.raises(UserError, match="flags.seq_len"):
        trained_context(tmp_path)
