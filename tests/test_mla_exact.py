"""The batch- and tree-invariant MLA kernel (interpret mode on CPU): it matches `mla_attention_reference`, and a
token's output is bitwise the same as a one-token decode step, as a node of trees of 1, 9, 17 and 65 nodes, inside
a causal (prefill) block, and beside other rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_attention import MLAConfig, mla_attention_split
from pallas_kernels.mla_exact import mla_attention_exact
from pallas_kernels.reference import mla_attention_reference

SCALE = 0.125
HEADS = 4


def random_tree_mask(rng: np.random.Generator, n: int) -> np.ndarray:
    """Ancestor-or-self mask `[N, N]` of a random tree: node i > 0 has a random parent < i."""
    mask = np.zeros((n, n), bool)
    for i in range(n):
        if i:
            mask[i] = mask[rng.integers(0, i)]
        mask[i, i] = True
    return mask


def exact(q, cache, prefix, mask, value_dim: int) -> np.ndarray:
    out = mla_attention_exact(
        q, cache, jnp.asarray(prefix, jnp.int32), jnp.asarray(mask), SCALE, value_dim, interpret=True
    )
    return np.asarray(out)


def split_kv(q, cache, prefix, mask, value_dim: int) -> np.ndarray:
    """The split-KV kernel, 16-slot tiles, 3 splits: a kernel whose reduction follows the node count and slots."""
    config = MLAConfig(block_r=16, block_k=16, num_splits=3, num_warps=4, num_stages=2)
    args = (jnp.asarray(prefix, jnp.int32), jnp.asarray(mask), SCALE, value_dim)
    return np.asarray(mla_attention_split(q, cache, *args, config=config, interpret=True))


@pytest.mark.parametrize("dk,dv", [(160, 128), (576, 512)])
def test_matches_the_reference(dk, dv):
    rng = np.random.default_rng(0)
    b, n, length = 2, 9, 192
    mask = np.stack([random_tree_mask(rng, n) for _ in range(b)])
    q = jnp.asarray(rng.standard_normal((b, n, HEADS, dk)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((b, length, dk)), jnp.bfloat16)
    prefix = [70, 130]
    out = exact(q, cache, prefix, mask, dv).astype(np.float64)
    ref = mla_attention_reference(
        q.astype(jnp.float32), cache.astype(jnp.float32), jnp.asarray(prefix), jnp.asarray(mask), SCALE, dv
    )
    ref = np.asarray(ref, np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def chain_setup(rng: np.random.Generator, dtype, dk: int, prefix: int, k: int):
    """A context cache of `prefix` positions, k chain tokens' latents `[k, Dk]` and queries `[k, Hq, Dk]`."""
    context = rng.standard_normal((prefix, dk))
    latents = rng.standard_normal((k, dk))
    queries = rng.standard_normal((k, HEADS, dk))
    return (jnp.asarray(a, dtype) for a in (context, latents, queries))


def decode_steps(kernel, context, latents, queries, length: int, dv: int) -> list[np.ndarray]:
    """Token t's output as a one-token decode step at position prefix + t: `[Hq, dv]` each."""
    prefix = context.shape[0]
    outs = []
    for t in range(latents.shape[0]):
        cache = jnp.zeros((1, length, context.shape[1]), context.dtype)
        cache = cache.at[0, :prefix].set(context).at[0, prefix : prefix + t + 1].set(latents[: t + 1])
        outs.append(kernel(queries[None, t : t + 1], cache, [prefix + t], np.ones((1, 1, 1), bool), dv)[0, 0])
    return outs


def tree_case(kernel, n: int, dtype, dk: int = 160, dv: int = 128) -> list[tuple[np.ndarray, np.ndarray]]:
    """The deepest node's ancestor chain of a random n-node tree, verified in one call with other rows beside it:
    (the chain token's output in the tree, its decode step's output) per chain token."""
    rng = np.random.default_rng(n)
    prefix, length = 100, 192 + 64 * (n > 17)
    mask = random_tree_mask(rng, n)
    depth = mask.sum(-1) - 1
    chain = np.flatnonzero(mask[int(np.argmax(depth))])  # block indices of depths 0..d, ascending
    context, latents, queries = chain_setup(rng, dtype, dk, prefix, len(chain))
    want = decode_steps(kernel, context, latents, queries, length, dv)

    b, row = 3, 1
    cache = jnp.asarray(rng.standard_normal((b, length, dk)), dtype)  # other rows and other nodes: noise
    q = jnp.asarray(rng.standard_normal((b, n, HEADS, dk)), dtype)
    cache = cache.at[row, :prefix].set(context).at[row, prefix + chain].set(latents)
    q = q.at[row, chain].set(queries)
    masks = np.stack([random_tree_mask(rng, n), mask, random_tree_mask(rng, n)])
    out = kernel(q, cache, [37, prefix, 150 - n], masks, dv)
    return [(out[row, node], want[t]) for t, node in enumerate(chain)]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n", [1, 9, 17, 65])
def test_a_tree_node_equals_its_decode_step_bitwise(n, dtype):
    assert all(same_bits(got, want) for got, want in tree_case(exact, n, dtype))


def test_kimi_width_latents_bitwise():
    """576-channel latents (Kimi K2), which run in shorter chunks."""
    assert all(same_bits(got, want) for got, want in tree_case(exact, 17, jnp.bfloat16, 576, 512))


def test_the_check_catches_the_split_kernel():
    """Control: the split-KV kernel, whose splits follow the block's size rather than the node's position, fails
    the comparison (in f32: the bf16 rounding of the output would hide most differences)."""
    assert not all(same_bits(got, want) for got, want in tree_case(split_kv, 65, jnp.float32))


def test_a_prefill_block_equals_decode_steps_bitwise():
    """A causal block of 20 tokens after a 50-token prefix (a chunk of prefill) equals 20 decode steps."""
    rng = np.random.default_rng(1)
    dk, dv, prefix, k, length = 160, 128, 50, 20, 128
    context, latents, queries = chain_setup(rng, jnp.bfloat16, dk, prefix, k)
    want = decode_steps(exact, context, latents, queries, length, dv)
    cache = jnp.zeros((1, length, dk), jnp.bfloat16).at[0, :prefix].set(context).at[0, prefix : prefix + k].set(latents)
    out = exact(queries[None], cache, [prefix], np.tril(np.ones((1, k, k), bool)), dv)
    assert all(same_bits(out[0, t], want[t]) for t in range(k))
