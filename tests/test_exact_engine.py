"""Exact numerics end to end (CPU, the invariant kernels in interpret mode), in bfloat16: the target's residual
stream and logits of the same tokens are bitwise the same as decode steps, as a block, as a tree branch and beside
other rows (and are not without the exact numerics); every request's greedy tokens as dflash or ddtree in a batch
of 3 equal its own `ar` tokens run alone."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx

from ddtree_jax import api, engine
from ddtree_jax.api import Generator
from ddtree_jax.errors import UserError
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM
from experiments.invariance import chain_tree, decode_steps, prefilled, run_block
from pallas_kernels.dispatch import Kernels

INTERPRET = Kernels(mla_attention="interpret", matmul="interpret", rms_norm="interpret")


@pytest.fixture(scope="module")
def exact_generator() -> Generator:
    cfg = tiny_kimi_config(quantized=False)
    target = KimiForCausalLM(cfg, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    drafter = DFlashDrafter(tiny_dflash_config(cfg), rngs=nnx.Rngs(4), dtype=jnp.bfloat16)
    return Generator(target, drafter, exact=True)


def same_everywhere(target, kernels: Kernels) -> bool:
    """Tokens 20..24 of row 1 as decode steps == as a causal block (under its mask, and as the prefill runs it,
    reading the cache) == as a 9-node tree's branch == as decode steps in a batch of 3, bitwise (residuals after
    every layer and logits). Each forward is a compiled program with the engine's compiler options, as the engine
    runs it (XLA fuses across ops)."""
    rows = np.random.default_rng(1).integers(3, 97, (3, 25))
    cache = prefilled(target, kernels, rows[1:2, :20], jit=True)
    want = decode_steps(target, kernels, cache, 20, rows[1:2, 20:], jit=True)
    block = run_block(target, kernels, cache, 20, rows[1:2, 20:], np.tril(np.ones((1, 5, 5), bool)), jit=True)
    prefill = run_block(target, kernels, cache, 20, rows[1:2, 20:], None, jit=True)
    mask, chain = chain_tree(np.random.default_rng(2), 9, 5)
    tokens = np.random.default_rng(3).integers(3, 97, (1, 9))
    tokens[0, chain] = rows[1, 20:]
    feats, logits = run_block(target, kernels, cache, 20, tokens, mask[None], jit=True)
    batch = decode_steps(
        target, kernels, prefilled(target, kernels, rows[:, :20], jit=True), 20, rows[:, 20:], jit=True
    )
    got = [block, prefill, (feats[:, chain], logits[:, chain]), (batch[0][1:2], batch[1][1:2])]
    return all(np.array_equal(g, w) for case in got for g, w in zip(case, want, strict=True))


def test_a_tokens_forward_is_the_same_in_every_call(exact_generator):
    target = exact_generator.target
    assert same_everywhere(target, dataclasses.replace(INTERPRET, exact=True))
    assert not same_everywhere(target, Kernels())  # control: XLA's bf16 products round by the call's shape


def test_exact_speculative_batches_equal_ar_alone_in_bf16(exact_generator):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, n).tolist() for n in (9, 5, 12)]
    settings = {"max_new_tokens": 12, "ignore_eos": True, "kernels": INTERPRET}
    alone = [exact_generator.generate([p], method="ar", **settings).tokens[0] for p in prompts]
    for method, budget in (("dflash", 1), ("ddtree", 8)):
        res = exact_generator.generate(prompts, method=method, budget=budget, **settings)
        assert res.spec.kernels.exact
        assert res.tokens == alone, (method, budget)


def test_exact_programs_compile_without_excess_precision():
    """Under the exact numerics XLA may not keep a bf16 intermediate in f32 inside a fusion (which ops share one
    follows the shapes); the fast path keeps XLA's defaults."""
    assert engine.compiler_options(dataclasses.replace(INTERPRET, exact=True)) == {"xla_allow_excess_precision": False}
    assert engine.compiler_options(INTERPRET) is None


def test_exact_prefill_passes_bound_the_batchs_tokens():
    """Exact prefill chunks: the spec's 512 at a few rows, 4096 tokens over many rows, never below MAX_BLOCK (the
    attention's partials grow with rows x chunk); the fast path takes the spec's chunk."""
    exact = dataclasses.replace(INTERPRET, exact=True)
    chunk = {b: engine.prefill_chunk(engine.GenSpec("ar", b, 1024, 8, kernels=exact)) for b in (1, 8, 32, 128)}
    assert chunk == {1: 512, 8: 512, 32: 128, 128: 64}
    assert engine.prefill_chunk(engine.GenSpec("ar", 128, 1024, 8, kernels=INTERPRET)) == 512


@pytest.mark.parametrize(
    "backend,mesh,dtype,want",
    [
        ("gpu", None, jnp.bfloat16, True),  # the default where its batch-1 cost is within 10%
        ("gpu", None, jnp.float32, False),
        ("gpu", "a mesh", jnp.bfloat16, False),  # not covered with a mesh: off by default, not refused
        ("cpu", None, jnp.bfloat16, False),  # a CPU runs float32 by default, exact there without the kernels
    ],
)
def test_exact_defaults_on_for_bf16_on_one_gpu_only(monkeypatch, backend, mesh, dtype, want) -> None:
    monkeypatch.setattr(api.jax, "default_backend", lambda: backend)
    assert api.resolve_exact(None, mesh, dtype) is want
    assert api.resolve_exact(False, None, dtype) is False


def test_exact_asked_with_a_mesh_is_refused() -> None:
    with pytest.raises(UserError, match="the exact numerics do not cover a device mesh yet"):
        api.resolve_exact(True, "a mesh", jnp.bfloat16)
