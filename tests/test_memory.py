"""Memory planning (ddtree_jax/memory.py): every term against the arrays the code actually allocates."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import pytest
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx

from ddtree_jax import engine, memory, sharding
from ddtree_jax.config import load_dflash_config, load_kimi_config
from ddtree_jax.dflash_checkpoint import tensor_table
from ddtree_jax.errors import UserError
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM, weight_table
from ddtree_jax.sizing import drafter_params
from experiments.common import RELEASED_CONFIGS
from pallas_kernels import mla_exact


def _leaf_bytes(x: jax.ShapeDtypeStruct) -> float:
    bits = 4 if x.dtype == jnp.int4 else 8 * x.dtype.itemsize
    return x.size * bits / 8


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize(("expert", "tensor"), [(1, 1), (2, 2), (8, 1), (4, 2)])
def test_weights_per_device_follow_the_sharding_rules(quantized: bool, expert: int, tensor: int) -> None:
    # vocab 98 so the lm_head divides tensor=2; sizes by sharding.py's rules, leaf by leaf.
    cfg = tiny_kimi_config(quantized=quantized, vocab_size=98)
    model = nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0), quantized=quantized))
    sizes = {"data": 1, "expert": expert, "tensor": tensor}
    want = 0.0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        x = var.get_value()
        axes = weight_table(cfg, quantized=quantized)[path].logical_axes
        split = math.prod(sizes[a] for name in axes if name for a in sharding.LOGICAL_AXES[name])
        want += _leaf_bytes(x) / split
    p = memory.plan(cfg, None, batch=1, max_len=8, method="ar", layout=memory.Layout(1, expert, tensor))
    assert sum(p.weights.values()) == want
    assert p.weights["drafter"] == 0


def test_drafter_params_match_its_checkpoint() -> None:
    for cfg in (tiny_dflash_config(tiny_kimi_config()), load_dflash_config(RELEASED_CONFIGS / "kimi-k2.5-dflash")):
        assert drafter_params(cfg) == sum(math.prod(shape) for _, shape, _ in tensor_table(cfg))


@pytest.mark.parametrize(("method", "budget"), [("ar", 16), ("dflash", 16), ("ddtree", 5), ("ddtree", 40)])
def test_caches_match_the_engine(method: str, budget: int) -> None:
    target = tiny_kimi_config()
    dcfg = tiny_dflash_config(target, block_size=4)
    spec = engine.GenSpec(method=method, batch=3, prompt_len=64, max_new_tokens=20, budget=budget)
    draft_len = 0 if method == "ar" else dcfg.num_draft
    cap = engine.cache_capacity(spec, draft_len)
    assert cap % 64 == 0 and cap - 64 < 84 + engine.tree_size(spec, draft_len) + 1 <= cap  # whole 64-slot tiles
    p = memory.plan(target, dcfg, batch=3, max_len=84, prompt_len=64, method=method, budget=budget)
    assert (p.capacity, p.tree_size) == (cap, engine.tree_size(spec, draft_len))
    latent = jax.eval_shape(lambda: KimiForCausalLM(target, rngs=nnx.Rngs(0)).init_cache(3, cap))
    assert p.target_cache == sum(x.size * x.dtype.itemsize for x in latent)
    dc = jax.eval_shape(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0)).init_cache(3, cap))
    assert p.drafter_cache == (0 if method == "ar" else (dc.k.size + dc.v.size) * dc.k.dtype.itemsize)


def test_data_axis_splits_the_batch_and_tensor_the_heads() -> None:
    target, dcfg = tiny_kimi_config(vocab_size=98), tiny_dflash_config(tiny_kimi_config(vocab_size=98))
    kw = {"max_len": 100, "method": "ddtree", "budget": 8}
    one = memory.plan(target, dcfg, batch=2, **kw)
    two = memory.plan(target, dcfg, batch=4, layout=memory.Layout(data=2), **kw)
    assert (two.target_cache, two.drafter_cache, two.workspace) == (
        one.target_cache,
        one.drafter_cache,
        one.workspace,
    )
    split = memory.plan(target, dcfg, batch=2, layout=memory.Layout(tensor=2), **kw)
    assert split.target_cache == one.target_cache  # the latent is replicated over tensor
    assert split.workspace["prefill"] < one.workspace["prefill"] and split.workspace["round"] < one.workspace["round"]


CHUNK = engine.GenSpec("ar", 1, 1, 1).prefill_chunk  # the engine's default prefill chunk, which the plan uses


def test_workspace_terms() -> None:
    # Prefill attention is chunked: scores grow as chunk x context, not prompt^2; a short (single-pass) prompt
    # pays prompt^2. The round term grows with the tree and the context.
    t, d = load_kimi_config(RELEASED_CONFIGS / "kimi-k2.6"), load_dflash_config(RELEASED_CONFIGS / "kimi-k2.5-dflash")
    p = memory.plan(t, d, batch=1, max_len=8192, method="ddtree", budget=16)
    chunk_scores = 2 * 64 * CHUNK * p.capacity * 4  # scores + probabilities [1, C, 64, cap] f32
    assert chunk_scores <= p.workspace["prefill"] < 2 * 64 * 8192**2 * 4
    single = memory.plan(t, d, batch=1, max_len=8192, prompt_len=CHUNK, method="ddtree", budget=16)
    assert single.workspace["prefill"] >= 2 * 64 * CHUNK**2 * 4
    short = memory.plan(t, d, batch=1, max_len=8192, prompt_len=128, method="ddtree", budget=16)
    assert short.workspace["prefill"] < single.workspace["prefill"] / 4
    bigger = memory.plan(t, d, batch=1, max_len=8192, prompt_len=1024, method="ddtree", budget=64)
    assert bigger.workspace["round"] > short.workspace["round"]
    assert p.total == sum(p.weights.values()) + p.target_cache + p.drafter_cache + p.workspace["prefill"]


def test_k26_on_eight_gpus() -> None:
    t, d = load_kimi_config(RELEASED_CONFIGS / "kimi-k2.6"), load_dflash_config(RELEASED_CONFIGS / "kimi-k2.5-dflash")
    p = memory.plan(t, d, batch=1, max_len=8192, method="ddtree", layout=memory.Layout(expert=8))
    assert p.weights["routed_experts"] == 48 * 60 * 24_772_608  # 384 / 8 experts per MoE layer, INT4
    assert round(sum(p.weights.values()) / 1e9, 1) == 101.7  # + 23.4 GB replicated + 7.0 GB drafter
    assert p.target_cache == 61 * (8192 + 64) * 576 * 2  # 8192 + 17 + 1 slots in whole 64-slot tiles


def test_largest_batch_and_longest_context_are_the_boundary() -> None:
    target, dcfg = tiny_kimi_config(), tiny_dflash_config(tiny_kimi_config())
    kw = {"method": "ddtree", "budget": 16}
    free = memory.plan(target, dcfg, batch=5, max_len=300, **kw).total + 1
    n = memory.largest_batch(target, dcfg, free, max_len=300, **kw)
    assert n == 5
    assert memory.fits(memory.plan(target, dcfg, batch=n, max_len=300, **kw), free)
    assert not memory.fits(memory.plan(target, dcfg, batch=n + 1, max_len=300, **kw), free)
    ctx = memory.longest_context(target, dcfg, free, limit=2048, batch=5, **kw)
    assert ctx == 300
    assert memory.longest_context(target, dcfg, free, limit=200, batch=5, **kw) == 200
    assert memory.largest_batch(target, dcfg, 1000, max_len=300, **kw) == 0


def test_free_bytes_from_env_or_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.FREE_BYTES_ENV, "12345")
    assert memory.device_free_bytes() == 12345
    monkeypatch.setenv(memory.FREE_BYTES_ENV, "12GB")
    with pytest.raises(UserError, match="DDTREE_FREE_BYTES must be a number of bytes"):
        memory.device_free_bytes()
    monkeypatch.delenv(memory.FREE_BYTES_ENV)
    stats = {"bytes_limit": 1000, "bytes_in_use": 300}
    devices = [type("D", (), {"memory_stats": lambda self, s=s: s})() for s in (stats, stats | {"bytes_in_use": 500})]
    monkeypatch.setattr(jax, "local_devices", lambda: devices)
    assert memory.device_free_bytes() == 500
    monkeypatch.setattr(jax, "local_devices", lambda: devices[:1] + [type("C", (), {"memory_stats": lambda s: None})()])
    assert memory.device_free_bytes() is None


def test_check_fits_logs_skip_on_cpu_and_refuses_with_what_fits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target, dcfg = tiny_kimi_config(), tiny_dflash_config(tiny_kimi_config())
    kw = {"batch": 8, "max_len": 500, "prompt_len": 100, "method": "ddtree", "budget": 16}
    monkeypatch.delenv(memory.FREE_BYTES_ENV, raising=False)
    logged = []
    monkeypatch.setattr(memory.logging, "info", lambda msg, *a: logged.append(msg % a))
    memory.check_fits(target, dcfg, context_limit=2048, **kw)
    assert any("reports no memory stats; skipping the memory check" in m for m in logged)
    free = memory.plan(target, dcfg, **(kw | {"batch": 3})).total
    monkeypatch.setenv(memory.FREE_BYTES_ENV, str(free))
    with pytest.raises(UserError) as info:
        memory.check_fits(target, dcfg, context_limit=2048, **kw)
    msg = str(info.value)
    assert msg.startswith("not enough device memory: batch 8 x context 500 (ddtree) needs")
    assert "largest batch at this context: 3" in msg and "longest context at this batch: " in msg
    monkeypatch.setenv(memory.FREE_BYTES_ENV, "1000")
    with pytest.raises(UserError, match="nothing fits: batch 1 x context 1 already needs"):
        memory.check_fits(target, dcfg, context_limit=2048, **kw)
    monkeypatch.setenv(memory.FREE_BYTES_ENV, str(10**12))
    assert memory.check_fits(target, dcfg, context_limit=2048, **kw) == memory.plan(target, dcfg, **kw)


def test_layout_from_spec() -> None:
    assert memory.Layout.from_spec(None, 8) == memory.Layout(expert=8)
    assert memory.Layout.from_spec("expert=4,tensor=2") == memory.Layout(1, 4, 2)
    with pytest.raises(UserError, match="--mesh"):
        memory.Layout.from_spec("1,1,8")


@pytest.mark.parametrize(("batch", "tokens", "cap"), [(1, 1, 128), (3, 17, 640), (8, 17, 1088)])
def test_exact_partials_bound_the_kernels(batch: int, tokens: int, cap: int) -> None:
    """The exact numerics' MLA partials term is the bytes the segment kernel writes for that many query tokens, one
    node a program; more than it writes when it packs nodes (the last case, 4 a program)."""
    cfg = tiny_kimi_config()
    heads = cfg.num_attention_heads
    q = jax.ShapeDtypeStruct((batch, tokens, heads, cfg.latent_dim), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((batch, cap, cfg.latent_dim), jnp.bfloat16)
    prefix = jax.ShapeDtypeStruct((batch,), jnp.int32)
    run = functools.partial(
        mla_exact._segment_partials, scale=0.1, value_dim=cfg.kv_lora_rank, causal=True, interpret=True
    )
    acc, maxes, sums, _ = jax.eval_shape(lambda *a: run(*a, tree_mask=None), q, cache, prefix)
    want = sum(x.size * 4 for x in (acc, maxes, sums))
    bound = mla_exact.partial_bytes(batch, tokens, cap, heads, cfg.kv_lora_rank)
    packed = mla_exact.nodes_per_program(heads, tokens, batch, cap) > 1
    assert packed == (batch == 8)
    assert bound > want if packed else bound == want


def test_exact_plan_counts_the_partials_and_chunks() -> None:
    target, dcfg = tiny_kimi_config(), tiny_dflash_config(tiny_kimi_config())
    kw = {"batch": 2, "max_len": 700, "prompt_len": 600, "method": "ddtree", "budget": 8}
    off, on = memory.plan(target, dcfg, **kw), memory.plan(target, dcfg, exact=True, **kw)
    partials = mla_exact.partial_bytes(2, on.tree_size, on.capacity, target.num_attention_heads, target.kv_lora_rank)
    assert on.workspace["round"] - off.workspace["round"] == partials
    assert on.workspace["prefill"] != off.workspace["prefill"] and on.total > off.total
