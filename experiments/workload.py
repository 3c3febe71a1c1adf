"""What the experiments run on: the model pair (the shipped one, or a tiny synthetic stand-in) and prompts.

Prompts come from the held-out file (text through the target's tokenizer) when both exist, else are random token
ids (a synthetic pair has no tokenizer); `prompt_source` says which, and goes into every record.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHIPPED_TARGET = REPO / "checkpoints" / "kimi-mini"
SHIPPED_DRAFTER = REPO / "checkpoints" / "kimi-mini-dflash"
DEMO_PROMPTS = REPO / "checkpoints" / "demo_prompts.jsonl"
RANDOM_PROMPT_LEN = 48


def write_tiny_pair(out_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Write the tests' tiny random target + drafter (tests/conftest.py configs) -> (target_dir, drafter_dir)."""
    from flax import nnx

    from ddtree_jax.dflash_checkpoint import save_drafter
    from ddtree_jax.models.dflash import DFlashDrafter
    from ddtree_jax.training.synthetic import write_hf_checkpoint

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import tiny_dflash_config, tiny_kimi_config

    out = Path(out_dir)
    cfg = tiny_kimi_config()
    target = write_hf_checkpoint(out / "target", cfg, seed=seed)
    drafter = out / "drafter"
    save_drafter(DFlashDrafter(tiny_dflash_config(cfg), rngs=nnx.Rngs(seed + 1)), drafter)
    return target, drafter


def load_prompts(gen, path: str | Path, n: int, seed: int = 0) -> tuple[list[list[int]], str]:
    """Up to `n` prompts as token ids (cycled when the file has fewer) and their source label."""
    from ddtree_jax.prompts import read_prompts

    vocab = gen.target_config.vocab_size
    if gen.tokenizer is not None and Path(path).is_file():
        ids = [list(p.token_ids) for p in read_prompts(path, gen.tokenizer, vocab)]
        return [ids[i % len(ids)] for i in range(n)], str(path)
    rng = np.random.default_rng(seed)
    high = vocab - 1  # keep the drafter's mask token (the last id) out of prompts
    return [rng.integers(3, high, RANDOM_PROMPT_LEN).tolist() for _ in range(n)], "random token ids"
