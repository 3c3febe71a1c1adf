"""The MLA split-KV Pallas kernel (interpret mode on CPU) against `mla_attention_reference`.

Full head dims (576 / 512), few heads and short caches; ragged prefixes in every batch, cache lengths and node
counts that are not multiples of any tile, random DDTree masks, empty KV splits, and NaN-poisoned partial
outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import tree as ddtree
from pallas_kernels.mla_attention import MLAConfig, mla_attention_pallas, mla_attention_split
from pallas_kernels.reference import mla_attention_reference

DK, DV, SCALE = 576, 512, 0.1446796
# Small tiles so that short caches still span several tiles and splits (16 is Triton's smallest dot size).
SMALL = MLAConfig(block_r=16, block_k=16, num_splits=3, num_warps=4, num_stages=2)


def random_parent_mask(rng: np.random.Generator, batch: int, n: int) -> np.ndarray:
    """Ancestor-or-self masks `[B, N, N]` of random trees: node i > 0 has a random parent < i."""
    mask = np.zeros((batch, n, n), bool)
    for b in range(batch):
        for i in range(n):
            if i:
                mask[b, i] = mask[b, rng.integers(0, i)]
            mask[b, i, i] = True
    return mask


def inputs(rng: np.random.Generator, batch: int, n: int, heads: int, length: int, prefix: list[int]):
    """Random bf16 q `[B, N, Hq, 576]`, cache `[B, L, 576]` and prefix_len `[B]` (prefix + N <= L)."""
    assert max(prefix) + n <= length
    q = jnp.asarray(rng.standard_normal((batch, n, heads, DK)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((batch, length, DK)), jnp.bfloat16)
    return q, cache, jnp.asarray(prefix, jnp.int32)


def reference(q, cache, prefix, mask) -> np.ndarray:
    """The reference on f32 copies of the bf16 inputs."""
    out = mla_attention_reference(q.astype(jnp.float32), cache.astype(jnp.float32), prefix, mask, SCALE, DV)
    return np.asarray(out, np.float64)


def rel_err(out, ref: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def run(q, cache, prefix, mask, config: MLAConfig | None) -> jax.Array:
    """The kernel with `config` (poisoned partials), or the public entry point when config is None."""
    if config is None:
        return mla_attention_pallas(q, cache, prefix, mask, SCALE, DV, interpret=True)
    return mla_attention_split(q, cache, prefix, mask, SCALE, DV, config=config, interpret=True, poison=True)


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small_tiles"])
@pytest.mark.parametrize("n", [9, 17])
def test_tree_verify_random_parents(n: int, config: MLAConfig | None):
    rng = np.random.default_rng(n)
    batch, heads, length = 3, 4, 131
    q, cache, prefix = inputs(rng, batch, n, heads, length, [0, 37, length - n])
    mask = jnp.asarray(random_parent_mask(rng, batch, n))
    out = run(q, cache, prefix, mask, config)
    ref = reference(q, cache, prefix, mask)
    assert out.shape == (batch, n, heads, DV) and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-2
    # The mask matters on these inputs: letting every node see the whole block gives a different answer.
    assert rel_err(out, reference(q, cache, prefix, jnp.ones_like(mask))) > 5e-2


@pytest.mark.parametrize("heads", [8, 64])
def test_decode_single_node(heads: int):
    rng = np.random.default_rng(heads)
    batch, length = 4, 75
    q, cache, prefix = inputs(rng, batch, 1, heads, length, [0, 5, 48, length - 1])
    mask = decode_mask(batch)
    ref, ref_self = reference(q, cache, prefix, mask), reference(q, cache, prefix, jnp.ones_like(mask))
    for config in (None, MLAConfig(block_r=16, block_k=16, num_splits=4, num_warps=4, num_stages=2)):
        # prefix 0 leaves 3 of the 4 splits without a tile: their empty partials must weigh nothing.
        out = run(q, cache, prefix, mask, config)
        assert rel_err(out, ref) < 1e-2 and rel_err(out[1], ref_self[1]) > 5e-2


def decode_mask(batch: int) -> jax.Array:
    """`[B, 1, 1]`: every node sees itself but sequence 1's (the kernels fold that bit into the prefix)."""
    return jnp.ones((batch, 1, 1), bool).at[1].set(False)


def builder_masks(rng: np.random.Generator, budget: int, depth: int = 4, vocab: int = 11) -> jax.Array:
    """`[2, budget + 1, budget + 1]` ancestor masks of two trees from the project's tree builder on random drafter
    logits; the second row's drafter puts all its mass on one token, so its tree is a `depth`-node chain padded
    out to the budget."""
    logits = jnp.asarray(rng.standard_normal((2, depth, vocab)), jnp.float32)
    logits = logits.at[1, :, 1:].set(-jnp.inf)
    trees = jax.vmap(lambda lg: ddtree.build_tree(lg, jnp.int32(1), budget))(logits)
    mask = jax.vmap(ddtree.ancestor_mask)(trees)
    assert not bool(trees.valid[1].all()) and bool(mask[0].sum() > budget + 1)  # padding; a branching tree
    return mask


def test_ddtree_builder_masks():
    """Masks from the project's tree builder (random drafter logits, padding nodes included)."""
    rng = np.random.default_rng(7)
    batch, heads, budget = 2, 4, 12
    mask = builder_masks(rng, budget)
    n = budget + 1
    q, cache, prefix = inputs(rng, batch, n, heads, 90, [23, 70])
    out = run(q, cache, prefix, mask, SMALL)
    assert rel_err(out, reference(q, cache, prefix, mask)) < 1e-2


def test_causal_prefill_block():
    rng = np.random.default_rng(3)
    batch, n, heads = 2, 40, 4
    q, cache, prefix = inputs(rng, batch, n, heads, 100, [0, 60])
    mask = jnp.asarray(np.broadcast_to(np.tril(np.ones((n, n), bool)), (batch, n, n)))
    for config in (None, SMALL):
        assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


def test_cache_shorter_than_a_tile():
    rng = np.random.default_rng(11)
    q, cache, prefix = inputs(rng, 2, 3, 4, 7, [0, 4])
    mask = jnp.asarray(random_parent_mask(rng, 2, 3))
    assert rel_err(run(q, cache, prefix, mask, None), reference(q, cache, prefix, mask)) < 1e-2
