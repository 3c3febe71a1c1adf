"""Shared test fixtures: tiny Kimi configs in both layouts, a tiny drafter with its inputs."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import DFlashConfig, KimiConfig, QuantConfig, YarnConfig

jax.config.update("jax_default_matmul_precision", "highest")

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config: pytest.Config) -> None:
    """One persistent compilation cache per test session, empty at its start: a program compiled by one test (in
    either xdist worker, or in a test's subprocess, which inherits the environment) is loaded, not recompiled, by
    the next test that builds the same program. The controller makes the folder before the workers start; they and
    the subprocesses find it in the environment."""
    if not hasattr(config, "workerinput"):
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="ddtree-jax-tests-cache-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(CACHE_ENV), ignore_errors=True))
    # every program, however quick to compile (the defaults skip those under 1 s)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def tiny_kimi_config(layout: str = "flat", quantized: bool = True, **overrides) -> KimiConfig:
    """A 3-layer Kimi-shaped config (1 dense + 2 MoE layers) small enough for CPU tests."""
    cfg = KimiConfig(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        routed_scaling_factor=2.827,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        rope_theta=50000.0,
        rope_scaling=YarnConfig(
            factor=64.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        quant=QuantConfig(group_size=32) if quantized else None,
        layout=layout,
        model_type="kimi_k2",
        bos_token_id=1,
        eos_token_ids=(2,),
        pad_token_id=0,
    )
    return dataclasses.replace(cfg, **overrides)


@pytest.fixture
def tiny_cfg() -> KimiConfig:
    return tiny_kimi_config()


@pytest.fixture
def spec_configs() -> Path:
    """The released Kimi configs kept in the repository (experiments/configs)."""
    from experiments.common import RELEASED_CONFIGS  # here: scripts that import conftest run without the repo root

    return RELEASED_CONFIGS


def tiny_dflash_config(target: KimiConfig, block_size: int = 4, **overrides) -> DFlashConfig:
    """A 2-layer drafter for `target` (GQA 4/2 heads, head_dim 16, YaRN like the Kimi drafter)."""
    cfg = DFlashConfig(
        hidden_size=target.hidden_size,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=target.vocab_size,
        num_target_layers=target.num_hidden_layers,
        block_size=block_size,
        target_layer_ids=(0, target.num_hidden_layers - 1),
        mask_token_id=target.vocab_size - 1,
        rope_theta=50000.0,
        rope_scaling=YarnConfig(
            factor=64.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=1e-6,
        yarn_attention_factor=1.4158883083359672,
    )
    return dataclasses.replace(cfg, **overrides)


def tiny_drafter_and_inputs(rng: np.random.Generator, dtype, **overrides):
    """A 2-layer drafter of head dim 32 (the attention kernel's least; `overrides` change its config), its cache
    filled from 12 context tokens, and a block for rows whose contexts are 0, 5 and 12 tokens: (drafter, its call's
    arguments)."""
    from ddtree_jax.models.dflash import DFlashDrafter

    cfg = tiny_dflash_config(tiny_kimi_config(vocab_size=128), head_dim=32, **overrides)  # 2 target layers
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 20))), dtype=dtype)
    b, ctx = 3, 12
    feats = jnp.asarray(rng.standard_normal((b, ctx, 2 * cfg.hidden_size)), dtype)
    cache_len = jnp.asarray([0, 5, ctx], jnp.int32)
    cache = drafter.append_context(
        drafter.init_cache(b, 16), feats, jnp.arange(ctx)[None].repeat(b, 0), jnp.zeros((b,), jnp.int32)
    )
    embeds = jnp.asarray(rng.standard_normal((b, cfg.block_size, cfg.hidden_size)), dtype)
    positions = cache_len[:, None] + jnp.arange(cfg.block_size)[None, :]
    return drafter, (embeds, positions, cache, cache_len)
