"""Training steps on tiny configs: losses fall, the router bias is balanced (not trained), and the drafter's
block attention sees exactly the context strictly before its anchor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.training import trainers
from tests.conftest import tiny_dflash_config, tiny_kimi_config

SEQ = 24


def _patterned_tokens(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Rows cycling through a short random motif: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(3, vocab - 1, size=6)
    starts = rng.integers(0, 6, size=batch)
    return np.stack([np.roll(np.resize(motif, length), -s) for s in starts]).astype(np.int32)


def _target(seed: int = 0) -> KimiForCausalLM:
    return KimiForCausalLM(tiny_kimi_config(quantized=False), rngs=nnx.Rngs(seed), dtype=jnp.float32)


def test_target_loss_decreases_and_bias_is_balanced_not_trained():
    model = _target()
    trainer = trainers.TargetTrainer(model, trainers.adamw(1e-2, 0.0), bias_rate=1e-2, compute_dtype=jnp.float32)
    tokens = _patterned_tokens(4, SEQ + 1, model.config.vocab_size)
    losses = [trainer.step(tokens, 1e-2)[0] for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0], losses
    biases = [v.get_value() for _, v in nnx.to_flat_state(trainer.bias)]
    assert len(biases) == len(model.config.moe_layers)
    for b in biases:  # 12 sign steps of 1e-2 each: every entry moved by a multiple of the rate
        assert np.any(b != 0)
        np.testing.assert_allclose(np.round(np.asarray(b) / 1e-2), np.asarray(b) / 1e-2, atol=1e-3)


def test_balance_bias_moves_towards_underloaded_experts():
    model = _target()
    _, _, bias = nnx.split(model, trainers.TRAINABLE, nnx.Param)
    paths = [p for p, _ in nnx.to_flat_state(bias)]
    load = jnp.arange(model.config.n_routed_experts, dtype=jnp.float32)  # expert 0 starved, the last overloaded
    loads = nnx.from_flat_state([((*p[:-1], "expert_load"), nnx.Intermediate((load,))) for p in paths])
    moved = dict(nnx.to_flat_state(trainers.balance_bias(bias, loads, 0.5)))
    for p in paths:
        assert moved[p].get_value()[0] == 0.5 and moved[p].get_value()[-1] == -0.5


def _pair(block: int = 4):
    target = _target(1)
    cfg = tiny_dflash_config(target.config, block_size=block)
    return target, DFlashDrafter(cfg, rngs=nnx.Rngs(2), dtype=jnp.float32)


def test_drafter_loss_decreases():
    target, drafter = _pair()
    trainer = trainers.DrafterTrainer(
        drafter, target, trainers.adamw(1e-2, 0.0), anchors=6, gamma=4.0, distill=0.0, compute_dtype=jnp.float32
    )
    tokens = _patterned_tokens(3, SEQ, target.config.vocab_size, seed=1)
    key = jax.random.key(0)
    losses = [trainer.step(tokens, key, 1e-2)[0] for _ in range(15)]  # same anchors: a deterministic objective
    assert losses[-1] < 0.85 * losses[0], losses


def _block_hidden(target, drafter, tokens: np.ndarray, anchor: int, features=None) -> np.ndarray:
    tokens = jnp.asarray(tokens[None])
    if features is None:
        features = trainers.target_forward(target, tokens, drafter.config.target_layer_ids).features
    anchors = jnp.array([[anchor]], jnp.int32)
    return np.asarray(trainers.drafter_block_hidden(drafter, target.embed, features, tokens, anchors))[0, 0]


def test_block_sees_context_strictly_before_the_anchor():
    target, drafter = _pair()
    tokens = _patterned_tokens(1, SEQ, target.config.vocab_size, seed=3)[0]
    anchor = 10
    base = _block_hidden(target, drafter, tokens, anchor)

    def changed(pos: int) -> np.ndarray:
        t = tokens.copy()
        t[pos] = (t[pos] + 7) % target.config.vocab_size
        return t

    for pos in (anchor + 1, anchor + 3, SEQ - 1):  # after the anchor: invisible
        np.testing.assert_array_equal(_block_hidden(target, drafter, changed(pos), anchor), base)
    for pos in (0, anchor - 1):  # before the anchor: visible through the target features
        assert np.abs(_block_hidden(target, drafter, changed(pos), anchor) - base).max() > 1e-4
    # the anchor's own target feature is never context; the one just before it is
    feats = trainers.target_forward(target, jnp.asarray(tokens[None]), drafter.config.target_layer_ids).features
    at_anchor = feats.at[:, anchor].add(1.0)
    np.testing.assert_array_equal(_block_hidden(target, drafter, tokens, anchor, at_anchor), base)
    before = feats.at[:, anchor - 1].add(1.0)
    assert np.abs(_block_hidden(target, drafter, tokens, anchor, before) - base).max() > 1e-4


def test_block_is_bidirectional_and_targets_follow_the_anchor():
    target, drafter = _pair()
    tokens = jnp.arange(SEQ, dtype=jnp.int32)[None] + 3
    anchors = jnp.array([[5, 11]], jnp.int32)
    np.testing.assert_array_equal(trainers.block_targets(tokens, anchors, 4)[0], [[8, 9, 10, 11], [14, 15, 16, 17]])
    w = trainers.position_weights(4, 2.0)
    np.testing.assert_allclose(w, np.exp(-np.arange(3) / 2.0), rtol=1e-6)
    # the anchor (block position 0) sees the masks after it: its output depends on the mask embedding
    feats = trainers.target_forward(target, tokens, drafter.config.target_layer_ids).features
    h = trainers.drafter_block_hidden(drafter, target.embed, feats, tokens, anchors[:, :1])
    swapped = lambda t: jnp.where((t == drafter.config.mask_token_id)[..., None], 0.0, target.embed(t))  # noqa: E731
    h2 = trainers.drafter_block_hidden(drafter, swapped, feats, tokens, anchors[:, :1])
    assert np.abs(np.asarray(h - h2)[0, 0, 0]).max() > 1e-4


@pytest.mark.parametrize("layers,inner", [(3, 96), (4, 160), (2, 128)])
def test_grown_drafter_computes_what_the_original_did(layers, inner):
    rng = np.random.default_rng(1)
    cfg = tiny_dflash_config(tiny_kimi_config())
    old = DFlashDrafter(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 20))), dtype=jnp.float32)
    for layer in old.layers:  # norms away from 1, so a copied norm that landed in the wrong place shows
        for w in (layer.input_layernorm, layer.post_attention_layernorm, layer.q_norm, layer.k_norm):
            w[...] = jnp.asarray(rng.uniform(0.5, 1.5, w[...].shape), jnp.float32)
    new = trainers.grow_drafter(old, layers, inner, seed=int(rng.integers(1 << 20)))
    assert (new.config.num_hidden_layers, new.config.intermediate_size) == (layers, inner)
    assert len(new.layers) == layers and new.layers[0].mlp.gate_proj[...].shape[1] == inner
    b, c, s = 2, 5, cfg.block_size
    feats = jnp.asarray(rng.normal(size=(b, c, len(cfg.target_layer_ids) * cfg.hidden_size)), jnp.float32)
    block = jnp.asarray(rng.normal(size=(b, s, cfg.hidden_size)), jnp.float32)
    ctx_len = jnp.asarray([c, 3])
    outs = []
    for d in (old, new):
        cache = d.append_context(d.init_cache(b, 16), feats, jnp.arange(c)[None].repeat(b, 0), jnp.zeros(b, int))
        outs.append(np.asarray(d(block, ctx_len[:, None] + jnp.arange(s)[None], cache, ctx_len)))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    # the new units and layers are live parameters, not copies of zeros everywhere
    assert float(jnp.abs(new.layers[-1].q_proj[...]).sum()) > 0


def test_grow_drafter_refuses_shrinking():
    old = DFlashDrafter(tiny_dflash_config(tiny_kimi_config()), rngs=nnx.Rngs(0), dtype=jnp.float32)
    with pytest.raises(ValueError, match="can grow 2 layers x 96"):
        trainers.grow_drafter(old, 1, 96)
    with pytest.raises(ValueError, match="can grow"):
        trainers.grow_drafter(old, 2, 64)
