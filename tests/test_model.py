"""The target model against the independent float64 NumPy implementation (tests/np_kimi.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import np_kimi
import numpy as np
import pytest
from conftest import tiny_kimi_config
from flax import nnx

from ddtree_jax.config import YarnConfig, load_kimi_config
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.models.layers import yarn_inv_freq
from ddtree_jax.training.synthetic import hf_tensors_from_model


def unpack_spec(packed: np.ndarray) -> np.ndarray:
    """compressed-tensors INT4 per kimi_k2.md §5, by shift-and-mask: element j in word j//8, bits 4(j%8).."""
    words = packed.astype(np.int64) & 0xFFFFFFFF
    nib = np.stack([(words >> (4 * k)) & 0xF for k in range(8)], axis=-1)
    return nib.reshape(packed.shape[0], -1) - 8


def np_weights(model: KimiForCausalLM) -> dict[str, np.ndarray]:
    """HF tensors of `model` with prefixes stripped and routed experts dequantized in float64."""
    cfg = model.config
    hf = hf_tensors_from_model(model)
    prefix = "language_model." if cfg.layout == "nested" else ""
    out = {}
    for name, t in hf.items():
        if not name.startswith(prefix) or name.endswith(("weight_scale", "weight_shape")):
            continue
        short = name[len(prefix) :].removeprefix("model.")
        if name.endswith("weight_packed"):
            base = name[: -len("weight_packed")]
            scale = np.asarray(hf[base + "weight_scale"], np.float64)
            q = unpack_spec(t)
            out[short.replace("weight_packed", "weight")] = q * np.repeat(scale, q.shape[1] // scale.shape[1], 1)
        else:
            out[short] = np.asarray(t, np.float64)
    return out


def make_model(cfg, seed=0, bias=True) -> KimiForCausalLM:
    m = KimiForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32)
    # Round every float weight to bf16 values: HF checkpoints store bf16, so the NumPy side sees exactly these.
    state = nnx.state(m)
    nnx.update(
        m,
        jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype) if x.dtype == jnp.float32 else x, state),
    )
    rng = np.random.default_rng(seed)
    for layer in cfg.moe_layers:  # nonzero correction bias: it must change the selection, not the weights
        mlp = m.layers[layer].mlp
        mlp.e_score_correction_bias[...] = jnp.asarray(
            rng.normal(0, 0.5 if bias else 0, cfg.n_routed_experts), jnp.float32
        )
    return m


def full_forward(m, tokens, positions, mask=None, naive=False, feature_layers=()):
    b, n = tokens.shape
    out = m(
        tokens,
        positions,
        m.init_cache(b, n + 4),
        jnp.zeros((b,), jnp.int32),
        mask,
        feature_layers=feature_layers,
        naive=naive,
    )
    return out, m.logits(out.hidden)


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_prefill_logits_match_numpy(layout):
    cfg = tiny_kimi_config(layout)
    m = make_model(cfg, seed=np.random.randint(1 << 30))
    n = 11
    tokens = np.random.randint(0, cfg.vocab_size, (1, n))
    pos = np.arange(n)[None]
    out, logits = full_forward(m, jnp.asarray(tokens), jnp.asarray(pos), feature_layers=(0, 2))
    ref, feats = np_kimi.forward(np_weights(m), cfg, tokens[0], pos[0], np.tril(np.ones((n, n), bool)), capture=(0, 2))
    assert rel(logits[0], ref) < 1e-4
    assert rel(out.features[0], np.concatenate([feats[0], feats[2]], -1)) < 1e-4


def test_absorbed_equals_naive():
    cfg = tiny_kimi_config()
    m = make_model(cfg, seed=np.random.randint(1 << 30))
    tokens = jnp.asarray(np.random.randint(0, cfg.vocab_size, (2, 9)))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    (_, a), (_, b) = full_forward(m, tokens, pos, naive=False), full_forward(m, tokens, pos, naive=True)
    assert rel(a, np.asarray(b, np.float64)) < 1e-5


def test_incremental_decode_equals_full_recompute():
    cfg = tiny_kimi_config()
    m = make_model(cfg, seed=np.random.randint(1 << 30))
    b, n, p = 2, 12, 5
    tokens = jnp.asarray(np.random.randint(0, cfg.vocab_size, (b, n)))
    pos = jnp.broadcast_to(jnp.arange(n), (b, n))
    _, full = full_forward(m, tokens, pos)
    cache = m.init_cache(b, n + 2)
    out = m(tokens[:, :p], pos[:, :p], cache, jnp.zeros((b,), jnp.int32), naive=True)
    steps = [m.logits(out.hidden)]
    cache = out.cache
    for j in range(p, n):
        out = m(tokens[:, j : j + 1], pos[:, j : j + 1], cache, jnp.full((b,), j, jnp.int32))
        cache = out.cache
        steps.append(m.logits(out.hidden))
    assert rel(jnp.concatenate(steps, 1), np.asarray(full, np.float64)) < 1e-5
    # The cache holds exactly what a one-shot prefill writes.
    ref_cache = m(tokens, pos, m.init_cache(b, n + 2), jnp.zeros((b,), jnp.int32)).cache
    for c, r in zip(cache, ref_cache, strict=True):
        np.testing.assert_allclose(c[:, :n], r[:, :n], rtol=1e-5, atol=1e-6)


def random_tree(rng, t):
    parents = np.array([-1] + [rng.integers(0, i) for i in range(1, t)])
    depth = np.zeros(t, int)
    for i in range(1, t):
        depth[i] = depth[parents[i]] + 1
    vis = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return parents, depth, vis


def test_tree_verify_equals_linear_recompute_of_each_path():
    cfg = tiny_kimi_config()
    m = make_model(cfg, seed=np.random.randint(1 << 30))
    w = np_weights(m)
    rng = np.random.default_rng(1)
    prefix_len, t = 6, 7
    prefix = rng.integers(0, cfg.vocab_size, prefix_len)
    parents, depth, vis = random_tree(rng, t)
    tree_tokens = rng.integers(0, cfg.vocab_size, t)
    cache = m.init_cache(1, prefix_len + t + 1)
    out = m(jnp.asarray(prefix[None]), jnp.arange(prefix_len)[None], cache, jnp.zeros((1,), jnp.int32), naive=True)
    out = m(
        jnp.asarray(tree_tokens[None]),
        jnp.asarray(prefix_len + depth[None]),
        out.cache,
        jnp.full((1,), prefix_len, jnp.int32),
        jnp.asarray(vis[None]),
    )
    logits = np.asarray(m.logits(out.hidden)[0], np.float64)
    for i in range(t):
        path = [j for j in range(t) if vis[i, j]]  # ancestors-or-self in order = the root-to-node path
        seq = np.concatenate([prefix, tree_tokens[path]])
        n = len(seq)
        ref, _ = np_kimi.forward(w, cfg, seq, np.arange(n), np.tril(np.ones((n, n), bool)))
        assert rel(logits[i], ref[-1]) < 1e-4, f"node {i} path {path}"


def test_routing_with_correction_bias_matches_numpy():
    cfg = tiny_kimi_config()
    m = make_model(cfg, seed=np.random.randint(1 << 30))
    w = np_weights(m)
    x = np.random.randn(20, cfg.hidden_size)
    layer = cfg.moe_layers[0]
    ids, wts = m.layers[layer].mlp.route(jnp.asarray(x, jnp.float32))
    rid, rw = np_kimi.route(x, w, f"layers.{layer}.mlp", cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), np.sort(rid, -1))
    order = np.argsort(np.asarray(ids), -1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(wts), order, -1),
        np.take_along_axis(rw, np.argsort(rid, -1), -1),
        rtol=1e-5,
    )
    # The bias changed the selection (otherwise this test could not catch its misuse).
    plain = np.argsort(-(x @ w[f"layers.{layer}.mlp.gate.weight"].T), -1)[:, : cfg.num_experts_per_tok]
    assert not np.array_equal(np.sort(plain, -1), np.sort(rid, -1))


def test_group_limited_routing():
    cfg = tiny_kimi_config(n_group=4, topk_group=2)
    m = make_model(cfg, seed=np.random.randint(1 << 30))
    mlp = m.layers[cfg.moe_layers[0]].mlp
    x = np.random.randn(16, cfg.hidden_size)
    ids, _ = mlp.route(jnp.asarray(x, jnp.float32))
    logits = x @ np.asarray(mlp.gate[...], np.float64)
    sel = 1 / (1 + np.exp(-logits)) + np.asarray(mlp.e_score_correction_bias[...], np.float64)
    g = sel.reshape(16, 4, -1)
    gscore = np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.argsort(-gscore, -1)[:, :2]
    for t in range(16):
        allowed = np.concatenate([np.arange(k * 2, k * 2 + 2) for k in keep[t]])
        masked = np.full(8, -np.inf)
        masked[allowed] = sel[t, allowed]
        np.testing.assert_array_equal(np.sort(np.asarray(ids[t])), np.sort(np.argsort(-masked)[:2]))


@pytest.mark.parametrize(
    "factor,beta_fast,beta_slow,expect",
    [
        (
            64.0,
            32.0,
            1.0,
            {0: 1.0, 8: 6.687403e-2, 9: 4.377666e-2, 19: 1.583750e-4, 20: 1.807023e-5, 31: 4.382206e-7},
        ),
        (64.0, 1.0, 1.0, {19: 1.621760e-3, 20: 1.807023e-5}),
        (32.0, 1.0, 1.0, {20: 3.614047e-5}),
    ],
)
def test_yarn_tables_match_spec_constants(factor, beta_fast, beta_slow, expect):
    y = YarnConfig(
        factor=factor,
        original_max_position_embeddings=4096,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    inv = yarn_inv_freq(64, 50000.0, y)
    for i, v in expect.items():
        assert inv[i] == pytest.approx(v, rel=1e-5)


def test_drafter_yarn_table_matches_spec_constants():
    y = YarnConfig(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)
    inv = yarn_inv_freq(128, 50000.0, y)
    for i, v in {17: 5.647238e-2, 18: 4.555482e-2, 39: 2.139859e-5, 63: 3.700594e-7}.items():
        assert inv[i] == pytest.approx(v, rel=1e-5)


def test_softmax_scale_matches_spec(spec_configs):
    assert load_kimi_config(spec_configs / "kimi-k2.6").softmax_scale == pytest.approx(0.1446796, rel=1e-6)
    assert load_kimi_config(spec_configs / "kimi-k2-thinking").softmax_scale == pytest.approx(0.1446796, rel=1e-6)
    c = load_kimi_config(spec_configs / "kimi-k2.6")
    instruct = dataclasses.replace(c, rope_scaling=dataclasses.replace(c.rope_scaling, factor=32.0))
    assert instruct.softmax_scale == pytest.approx(0.1308608, rel=1e-6)


def test_full_size_model_builds_abstractly(spec_configs):
    """The real K2.6 config constructs shape-only at full size with the expected parameter count."""
    cfg = load_kimi_config(spec_configs / "kimi-k2.6")
    state = nnx.state(nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0))))
    # Parameters = weights; the INT4 group scales (*_s) are storage, not parameters.
    n = sum(int(np.prod(v.shape)) for path, v in nnx.to_flat_state(state) if not str(path[-1]).endswith("_s"))
    assert n == pytest.approx(1.0264e12, rel=2e-3)
    experts = state["layers"][1]["mlp"]["experts"]
    assert experts["gate_up_q"].shape == (384, 4096, 7168) and experts["gate_up_q"].dtype == jnp.int4
    assert experts["down_s"].shape == (384, 64, 7168)  # group-major scales [E, I/32, H]


@pytest.mark.parametrize("quantized,dtype", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_exact_kernels_give_the_same_model(quantized, dtype):
    """Kernels(exact=True) with every op in interpret mode (row-invariant products, the MoE kernel's fixed tile and
    rank-order combine, or the float experts' per-expert products): finite logits close to exact=False's."""
    from pallas_kernels.dispatch import Kernels

    cfg = tiny_kimi_config(quantized=quantized, moe_intermediate_size=64)  # the MoE kernel takes I = 64k
    m = KimiForCausalLM(cfg, rngs=nnx.Rngs(np.random.randint(1 << 30)), dtype=dtype)
    b, n = 2, 5
    tokens = jnp.asarray(np.random.randint(0, cfg.vocab_size, (b, n)))
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))

    def logits(kernels: Kernels) -> np.ndarray:
        out = m(tokens, positions, m.init_cache(b, 64), jnp.zeros((b,), jnp.int32), kernels=kernels)
        return np.asarray(m.logits(out.hidden, kernels), np.float64)

    exact = logits(Kernels(exact=True).with_mode("interpret"))
    assert np.isfinite(exact).all()
    assert rel(exact, logits(Kernels().with_mode("interpret"))) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)
