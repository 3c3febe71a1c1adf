"""The batch- and tree-invariant MLA kernel (interpret mode on CPU, compiled on a GPU): it matches
`mla_attention_reference`, and a token's output is bitwise the same as a one-token decode step, as a node of trees
of 1, 9, 17 and 65 nodes, inside a causal (prefill) block, beside other rows, on either side of segment boundaries
and under any allocated cache length (so any number of segments in the grid)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_attention import MLAConfig, mla_attention_split
from pallas_kernels.mla_exact import MAX_BLOCK, SEGMENT, merge_partials, mla_attention_exact
from pallas_kernels.reference import mla_attention_reference

SCALE = 0.125
HEADS = 4
INTERPRET = jax.default_backend() != "gpu"


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
        q, cache, jnp.asarray(prefix, jnp.int32), jnp.asarray(mask), SCALE, value_dim, interpret=INTERPRET
    )
    return np.asarray(out)


def split_kv(q, cache, prefix, mask, value_dim: int) -> np.ndarray:
    """The split-KV kernel, 16-slot tiles, 3 splits: a kernel whose reduction follows the node count and slots."""
    config = MLAConfig(block_r=16, block_k=16, num_splits=3, num_warps=4, num_stages=2)
    args = (jnp.asarray(prefix, jnp.int32), jnp.asarray(mask), SCALE, value_dim)
    return np.asarray(mla_attention_split(q, cache, *args, config=config, interpret=INTERPRET))


@pytest.mark.parametrize(("dk", "dv"), [(160, 128), (576, 512)])
@pytest.mark.parametrize(("length", "prefix"), [(192, [70, 130]), (640, [70, 2 * SEGMENT + 20])])
def test_matches_the_reference(dk, dv, length, prefix):
    """One segment, and three (the second row's nodes in the third, partial one)."""
    rng = np.random.default_rng(0)
    b, n = 2, 9
    mask = np.stack([random_tree_mask(rng, n) for _ in range(b)])
    q = jnp.asarray(rng.standard_normal((b, n, HEADS, dk)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((b, length, dk)), jnp.bfloat16)
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


def tree_case(
    kernel, n: int, dtype, dk: int = 160, dv: int = 128, prefix: int = 100, length: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The deepest node's ancestor chain of a random n-node tree at `prefix`, verified in one call with other rows
    beside it: (the chain token's output in the tree, its decode step's output) per chain token. length: the
    allocated cache (default 192, or 256 past 17 nodes)."""
    rng = np.random.default_rng(n)
    length = length or 192 + 64 * (n > 17)
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


@pytest.mark.parametrize(("boundary", "dtype"), [(1, jnp.bfloat16), (2, jnp.float32), (3, jnp.bfloat16)])
def test_a_tree_across_a_segment_boundary_equals_its_decode_steps_bitwise(boundary, dtype):
    """The chain's root sits at the last position of segment `boundary - 1` and its descendants in the next: the
    tree's nodes and their decode steps merge 1 to 4 segments of a 4-segment grid (the last one partial)."""
    prefix = boundary * SEGMENT - 1
    pairs = tree_case(exact, 9, dtype, prefix=prefix, length=3 * SEGMENT + 64)
    assert all(same_bits(got, want) for got, want in pairs)


def test_kimi_width_latents_across_a_segment_boundary_bitwise():
    """576-channel latents, whose 32-position chunks make 8 per segment."""
    pairs = tree_case(exact, 9, jnp.bfloat16, 576, 512, prefix=SEGMENT - 1, length=SEGMENT + 64)
    assert all(same_bits(got, want) for got, want in pairs)


@pytest.mark.parametrize(("prefix", "lengths"), [(150, [192, 320, 1024]), (SEGMENT + 40, [320, 640, 1024])])
def test_the_allocated_length_does_not_change_a_node(prefix, lengths):
    """The same rows in caches of different allocated lengths (1 to 4 segments in the grid; a 192-slot cache runs
    without partials): every node's output is the same bits (in f32, which the output's rounding hides less)."""
    rng = np.random.default_rng(prefix)
    b, n, dk, dv, dtype = 2, 17, 160, 128, jnp.float32
    mask = np.stack([random_tree_mask(rng, n) for _ in range(b)])
    q = jnp.asarray(rng.standard_normal((b, n, HEADS, dk)), dtype)
    rows = jnp.asarray(rng.standard_normal((b, lengths[0], dk)), dtype)
    outs = [
        exact(q, jnp.pad(rows, ((0, 0), (0, length - lengths[0]), (0, 0))), [prefix, prefix - 30], mask, dv)
        for length in lengths
    ]
    assert all(same_bits(out, outs[0]) for out in outs[1:])


def test_the_merge_reads_only_the_segments_a_node_reaches():
    """Partials past a node's last segment (the grid's extra segments under a longer allocation) are not read:
    NaN there changes nothing, and each node's result is the merge of its own segments alone."""
    rng = np.random.default_rng(2)
    b, n, segments, rows, dv = 2, 3, 4, 16, 256
    acc = rng.standard_normal((b, n, segments, rows, dv)).astype(np.float32)
    m = rng.standard_normal((b, n, segments, rows)).astype(np.float32) * 4
    s = rng.uniform(1, 9, (b, n, segments, rows)).astype(np.float32)
    live = np.array([[1, 2, 3], [4, 2, 1]], np.int32)
    past = np.arange(segments)[None, None, :] >= live[..., None]
    garbage = [
        np.where(past[..., None, None], np.nan, acc),
        np.where(past[..., None], np.nan, m),
        np.where(past[..., None], np.nan, s),
    ]
    merged = np.asarray(merge_partials(acc, m, s, live, jnp.float32, interpret=INTERPRET))
    assert same_bits(np.asarray(merge_partials(*garbage, live, jnp.float32, interpret=INTERPRET)), merged)
    for i, j in np.ndindex(b, n):
        k = live[i, j]
        alone = merge_partials(
            acc[i : i + 1, j : j + 1, :k],
            m[i : i + 1, j : j + 1, :k],
            s[i : i + 1, j : j + 1, :k],
            np.array([[k]], np.int32),
            jnp.float32,
            interpret=INTERPRET,
        )
        assert same_bits(np.asarray(alone)[0, 0], merged[i, j])
    weights = np.exp2(m - np.max(np.where(past[..., None], -np.inf, m), axis=2, keepdims=True)) * ~past[..., None]
    want = np.sum(weights[..., None] * acc, axis=2) / np.sum(weights * s, axis=2)[..., None]
    np.testing.assert_allclose(merged, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("prefix", "length"), [(50, 128), (SEGMENT - 10, SEGMENT + 64)])
def test_a_prefill_block_equals_decode_steps_bitwise(prefix, length):
    """A causal block of 20 tokens after the prefix (a chunk of prefill) equals 20 decode steps; the second
    block straddles the first segment boundary."""
    rng = np.random.default_rng(1)
    dk, dv, k = 160, 128, 20
    context, latents, queries = chain_setup(rng, jnp.bfloat16, dk, prefix, k)
    want = decode_steps(exact, context, latents, queries, length, dv)
    cache = jnp.zeros((1, length, dk), jnp.bfloat16).at[0, :prefix].set(context).at[0, prefix : prefix + k].set(latents)
    out = exact(queries[None], cache, [prefix], np.tril(np.ones((1, k, k), bool)), dv)
    assert all(same_bits(out[0, t], want[t]) for t in range(k))


def exact_causal(q, cache, prefix, value_dim: int) -> np.ndarray:
    args = (jnp.asarray(prefix, jnp.int32), None, SCALE, value_dim)
    return np.asarray(mla_attention_exact(q, cache, *args, causal=True, interpret=INTERPRET))


@pytest.mark.parametrize(("prefix", "k", "length"), [(50, 1, 128), (SEGMENT - 40, MAX_BLOCK + 16, 2 * SEGMENT)])
def test_a_causal_block_read_from_the_cache_equals_decode_steps_bitwise(prefix, k, length):
    """The causal path (`causal=True`: nodes read their ancestors straight from the cache) gives each token its
    decode step's bits: one token (the engine's AR step), and a block longer than MAX_BLOCK across a segment
    boundary; the cache past the block holds noise, which the path must not see."""
    rng = np.random.default_rng(2)
    dk, dv = 160, 128
    context, latents, queries = chain_setup(rng, jnp.bfloat16, dk, prefix, k)
    want = decode_steps(exact, context, latents, queries, length, dv)
    cache = jnp.asarray(rng.standard_normal((2, length, dk)), jnp.bfloat16)
    cache = cache.at[1, :prefix].set(context).at[1, prefix : prefix + k].set(latents)
    q = jnp.asarray(rng.standard_normal((2, k, HEADS, dk)), jnp.bfloat16).at[1].set(queries)
    out = exact_causal(q, cache, [7, prefix], dv)
    assert all(same_bits(out[1, t], want[t]) for t in range(k))
