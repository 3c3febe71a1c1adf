"""The batch- and tree-invariant MLA attention and its W_UV product (interpret mode on CPU, compiled on a GPU): it
matches `mla_attention_reference` followed by the W_UV einsum, and a token's output is bitwise the same as a one-
token decode step, as a node of trees of 1, 9, 17 and 65 nodes, inside a causal (prefill) block, beside other rows,
on either side of segment boundaries and under any allocated cache length (so any number of segments in the grid),
and whichever nodes share a program's query rows. The merge inside the W_UV product reads only the segments a token
reaches, and a token's result does not depend on the other tokens of its call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_exact
from pallas_kernels.mla_attention import MLAConfig, mla_attention_split
from pallas_kernels.mla_exact import MAX_BLOCK, SEGMENT, merged_value_matmul, mla_output_exact
from pallas_kernels.reference import mla_attention_reference

SCALE = 0.125
HEADS = 4
V = 32  # W_UV's output columns per head
INTERPRET = jax.default_backend() != "gpu"
SHIPPED_PACKING = {"PACK_MIN_SEGMENTS": mla_exact.PACK_MIN_SEGMENTS, "PACK_MIN_PROGRAMS": mla_exact.PACK_MIN_PROGRAMS}


@pytest.fixture(scope="module", autouse=True)
def pack_small_calls():
    """This module's calls are small: every one packs nodes where its heads allow (the bitwise checks cover the
    packed kernel), except where a test raises the thresholds again."""
    with pytest.MonkeyPatch.context() as patch:
        for name in SHIPPED_PACKING:
            patch.setattr(mla_exact, name, 1)
        jax.clear_caches()
        yield
    jax.clear_caches()


def random_tree_mask(rng: np.random.Generator, n: int) -> np.ndarray:
    """Ancestor-or-self mask `[N, N]` of a random tree: node i > 0 has a random parent < i."""
    mask = np.zeros((n, n), bool)
    for i in range(n):
        if i:
            mask[i] = mask[rng.integers(0, i)]
        mask[i, i] = True
    return mask


def w_uv(dtype, value_dim: int, heads: int = HEADS) -> jax.Array:
    """One fixed W_UV `[heads, V, value_dim]` per (dtype, value_dim, heads)."""
    w = np.random.default_rng(value_dim).standard_normal((heads, V, value_dim)) / np.sqrt(value_dim)
    return jnp.asarray(w, dtype)


def exact(q, cache, prefix, mask, value_dim: int) -> np.ndarray:
    """`[B, N, Hq, V]` f32: the exact attention of the nodes times W_UV."""
    args = (jnp.asarray(prefix, jnp.int32), jnp.asarray(mask), w_uv(q.dtype, value_dim, q.shape[2]), SCALE, value_dim)
    return np.asarray(mla_output_exact(q, cache, *args, interpret=INTERPRET))


def split_kv(q, cache, prefix, mask, value_dim: int) -> np.ndarray:
    """The split-KV kernel, 16-slot tiles, 3 splits: a kernel whose reduction follows the node count and slots."""
    config = MLAConfig(block_r=16, block_k=16, num_splits=3, num_warps=4, num_stages=2)
    args = (jnp.asarray(prefix, jnp.int32), jnp.asarray(mask), SCALE, value_dim)
    return np.asarray(mla_attention_split(q, cache, *args, config=config, interpret=INTERPRET))


@pytest.mark.parametrize(("dk", "dv"), [(160, 128), (576, 512)])
@pytest.mark.parametrize(("length", "prefix"), [(192, [70, 130]), (640, [70, 2 * SEGMENT + 20])])
def test_matches_the_reference(dk, dv, length, prefix):
    """One segment, and three (the second row's nodes in the third, partial one): the attention in f32, then the
    product with W_UV."""
    rng = np.random.default_rng(0)
    b, n = 2, 9
    mask = np.stack([random_tree_mask(rng, n) for _ in range(b)])
    q = jnp.asarray(rng.standard_normal((b, n, HEADS, dk)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((b, length, dk)), jnp.bfloat16)
    out = exact(q, cache, prefix, mask, dv).astype(np.float64)
    ref = mla_attention_reference(
        q.astype(jnp.float32), cache.astype(jnp.float32), jnp.asarray(prefix), jnp.asarray(mask), SCALE, dv
    )
    ref = np.einsum("bnhc,hvc->bnhv", np.asarray(ref, np.float64), np.asarray(w_uv(jnp.float32, dv), np.float64))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_out_dtype_rounds_the_f32_product():
    """out_dtype=bf16 (what the model's o_proj takes): the f32 result rounded once, inside the product's kernel."""
    rng = np.random.default_rng(1)
    b, n, dk, dv = 2, 5, 160, 128
    mask = np.stack([random_tree_mask(rng, n) for _ in range(b)])
    q = jnp.asarray(rng.standard_normal((b, n, HEADS, dk)), jnp.bfloat16)
    cache = jnp.asarray(rng.standard_normal((b, 192, dk)), jnp.bfloat16)
    args = (jnp.asarray([30, 100], jnp.int32), jnp.asarray(mask), w_uv(q.dtype, dv), SCALE, dv)
    rounded = mla_output_exact(q, cache, *args, out_dtype=jnp.bfloat16, interpret=INTERPRET)
    assert rounded.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(rounded), np.asarray(exact(q, cache, [30, 100], mask, dv).astype(jnp.bfloat16)))


def chain_setup(rng: np.random.Generator, dtype, dk: int, prefix: int, k: int, heads: int = HEADS):
    """A context cache of `prefix` positions, k chain tokens' latents `[k, Dk]` and queries `[k, Hq, Dk]`."""
    context = rng.standard_normal((prefix, dk))
    latents = rng.standard_normal((k, dk))
    queries = rng.standard_normal((k, heads, dk))
    return (jnp.asarray(a, dtype) for a in (context, latents, queries))


def decode_steps(kernel, context, latents, queries, length: int, dv: int) -> list[np.ndarray]:
    """Token t's output as a one-token decode step at position prefix + t: `[Hq, V]` each (`[Hq, dv]` for an
    attention-only kernel)."""
    prefix = context.shape[0]
    outs = []
    for t in range(latents.shape[0]):
        cache = jnp.zeros((1, length, context.shape[1]), context.dtype)
        cache = cache.at[0, :prefix].set(context).at[0, prefix : prefix + t + 1].set(latents[: t + 1])
        outs.append(kernel(queries[None, t : t + 1], cache, [prefix + t], np.ones((1, 1, 1), bool), dv)[0, 0])
    return outs


def tree_case(
    kernel,
    n: int,
    dtype,
    dk: int = 160,
    dv: int = 128,
    prefix: int = 100,
    length: int | None = None,
    heads: int = HEADS,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The deepest node's ancestor chain of a random n-node tree at `prefix`, verified in one call with other rows
    beside it: (the chain token's output in the tree, its decode step's output) per chain token. length: the
    allocated cache (default 192, or 256 past 17 nodes)."""
    rng = np.random.default_rng(n)
    length = length or 192 + 64 * (n > 17)
    mask = random_tree_mask(rng, n)
    depth = mask.sum(-1) - 1
    chain = np.flatnonzero(mask[int(np.argmax(depth))])  # block indices of depths 0..d, ascending
    context, latents, queries = chain_setup(rng, dtype, dk, prefix, len(chain), heads)
    want = decode_steps(kernel, context, latents, queries, length, dv)

    b, row = 3, 1
    cache = jnp.asarray(rng.standard_normal((b, length, dk)), dtype)  # other rows and other nodes: noise
    q = jnp.asarray(rng.standard_normal((b, n, heads, dk)), dtype)
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


@pytest.mark.parametrize(
    ("heads", "n", "prefix", "causal", "dtype"),
    [
        (4, 5, [62, 255], True, jnp.bfloat16),  # 4 nodes a program: a second group of 1 and 3 padding nodes
        (8, 3, [63, 126], True, jnp.float32),  # 2 a program, one padding node
        (2, 17, [62, 255], False, jnp.bfloat16),  # 8 a program
        (4, 9, [63, 126], False, jnp.float32),
    ],
)
def test_packing_nodes_changes_no_bit(monkeypatch, heads, n, prefix, causal, dtype):
    """The whole output, every row, node and head, with nodes packed in a program's rows equals bit for bit the
    output with one node a program, causal blocks with padding nodes and trees alike, their groups reaching across
    chunk (64) and segment (256) boundaries."""
    rng = np.random.default_rng(heads * n)
    b, dk, dv, length = 2, 160, 128, 384
    q = jnp.asarray(rng.standard_normal((b, n, heads, dk)), dtype)
    cache = jnp.asarray(rng.standard_normal((b, length, dk)), dtype)
    mask = None if causal else jnp.asarray(np.stack([random_tree_mask(rng, n) for _ in range(b)]))
    args = (q, cache, jnp.asarray(prefix, jnp.int32), mask, w_uv(dtype, dv, heads), SCALE, dv)
    assert mla_exact.nodes_per_program(heads, n, b, length) > 1
    packed = np.asarray(mla_output_exact(*args, causal=causal, interpret=INTERPRET))
    monkeypatch.setattr(mla_exact, "PACK_MIN_PROGRAMS", b * n * 2 + 1)  # 2 segments
    assert mla_exact.nodes_per_program(heads, n, b, length) == 1
    jax.clear_caches()  # trace again, one node a program
    single = np.asarray(mla_output_exact(*args, causal=causal, interpret=INTERPRET))
    jax.clear_caches()  # no unpacked trace outlives the test's threshold
    assert same_bits(packed, single)


def test_nodes_are_packed_only_in_calls_with_a_long_prefix_that_fill_the_gpu(monkeypatch):
    """A verify of 17 nodes of 4 heads over 1088 slots, 5 segments (context 1024), packs 4 nodes a program at 8 rows,
    none at 1; over one segment (context 60), none at 32 rows."""
    for name, value in SHIPPED_PACKING.items():
        monkeypatch.setattr(mla_exact, name, value)
    assert [mla_exact.nodes_per_program(4, 17, b, 1088) for b in (1, 8)] == [1, 4]
    assert mla_exact.nodes_per_program(4, 17, 32, 256) == 1
    assert mla_exact.nodes_per_program(3, 17, 8, 1088) == 1  # 3 heads do not divide the rows


@pytest.mark.parametrize("heads", [2, 3, 8, 16])
@pytest.mark.parametrize("n", [3, 17])
def test_nodes_packed_in_a_programs_rows_equal_their_decode_steps_bitwise(heads, n):
    """Other head counts: 8 nodes share a program's 16 rows (2 heads; 2 nodes at n = 3), 2 nodes (8 heads), one
    node (3 heads, which do not divide the rows; 16 heads, which fill them)."""
    assert all(same_bits(got, want) for got, want in tree_case(exact, n, jnp.bfloat16, heads=heads))


def test_a_tree_ending_at_the_caches_last_slot_equals_its_decode_steps_bitwise():
    """The block in the cache's last slots: its tile of 16 nodes reaches past the allocation, whose rows load as
    zeros, never read."""
    assert all(same_bits(got, want) for got, want in tree_case(exact, 9, jnp.bfloat16, prefix=192 - 9, length=192))


def test_kimi_width_latents_bitwise():
    """576-channel latents (Kimi K2), which run in shorter chunks."""
    assert all(same_bits(got, want) for got, want in tree_case(exact, 17, jnp.bfloat16, 576, 512))


def test_the_check_catches_the_split_kernel():
    """Control: the split-KV kernel (attention alone), whose splits follow the block's size rather than the node's
    position, fails the comparison (in f32: the bf16 rounding of the output would hide most differences)."""
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
    """The same rows in caches of different allocated lengths (1 to 4 segments in the grid): every node's output is
    the same bits (in f32, where no rounding of the attention to bf16 hides a difference)."""
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


def partials(rng: np.random.Generator, segments: int, tokens: int, rows: int, c: int) -> tuple[np.ndarray, ...]:
    """Random partials: acc `[S, T, R, C]`, maxes and sums `[S, T, R]` f32 (sums >= 1, as a live segment's)."""
    acc = rng.standard_normal((segments, tokens, rows, c)).astype(np.float32)
    m = (rng.standard_normal((segments, tokens, rows)) * 4).astype(np.float32)
    s = rng.uniform(1, 9, (segments, tokens, rows)).astype(np.float32)
    return acc, m, s


def past_live(arrays: tuple[np.ndarray, ...], live: np.ndarray) -> tuple[np.ndarray, ...]:
    """`arrays` (partials `[S, T, ...]`) with NaN in every segment at or past its token's live count."""
    past = np.arange(arrays[0].shape[0])[:, None] >= live[None, :]
    return tuple(np.where(past.reshape(past.shape + (1,) * (a.ndim - 2)), np.nan, a) for a in arrays)


def merged(acc, m, s, live, w) -> np.ndarray:
    return np.asarray(merged_value_matmul(acc, m, s, np.asarray(live, np.int32), w, interpret=INTERPRET))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_merged_product_reads_only_the_segments_a_token_reaches(dtype):
    """Partials past a token's last segment (the grid's extra segments under a longer allocation, never written)
    are not read: NaN there changes no bit, each token's result is that of the token alone with the partials cut
    to its own segments, and the results match the merge followed by the product in NumPy."""
    rng = np.random.default_rng(2)
    segments, tokens, rows, c, heads = 4, 20, 16, 256, 3
    acc, m, s = partials(rng, segments, tokens, rows, c)
    live = np.concatenate([[1, 4], rng.integers(1, segments + 1, tokens - 2)]).astype(np.int32)
    w = jnp.asarray(rng.standard_normal((heads, V, c)) / 16, dtype)
    out = merged(acc, m, s, live, w)
    assert out.shape == (tokens, heads, V) and np.isfinite(out).all()
    assert same_bits(merged(*past_live((acc, m, s), live), live, w), out)
    for t, k in enumerate(live):
        assert same_bits(merged(acc[:k, t : t + 1], m[:k, t : t + 1], s[:k, t : t + 1], [k], w)[0], out[t])
    past = np.arange(segments)[:, None, None] >= live[None, :, None]
    weights = np.exp2(m - np.max(np.where(past, -np.inf, m), axis=0)) * ~past
    o_lat = np.sum(weights[..., None] * acc, axis=0) / np.sum(weights * s, axis=0)[..., None]  # [T, R, C]
    o_lat = np.asarray(jnp.asarray(o_lat[:, :heads]).astype(dtype).astype(jnp.float32))  # rounded as the kernel
    want = np.einsum("thc,hvc->thv", o_lat.astype(np.float64), np.asarray(w.astype(jnp.float32), np.float64))
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-5


def test_a_tokens_merged_product_does_not_depend_on_its_call():
    """A token's merge and product are the same bits in calls of 1, 9, 17 and 65 tokens, at different rows of its
    tile, beside tokens that reach more segments than it does (their walk passes its last segment)."""
    rng = np.random.default_rng(3)
    segments, rows, c, heads = 4, 16, 512, 2
    token = partials(rng, segments, 1, rows, c)
    w = jnp.asarray(rng.standard_normal((heads, V, c)) / 16, jnp.bfloat16)
    outs = []
    for tokens in (1, 9, 17, 65):
        row = tokens // 2
        live = rng.integers(1, segments + 1, tokens).astype(np.int32)
        live[max(row - 1, 0)] = segments  # a neighbour in the tile walks every segment (9 tokens and more)
        live[row] = 2
        noise = partials(rng, segments, tokens, rows, c)
        pairs = zip(noise, token, strict=True)
        arrays = tuple(np.concatenate([a[:, :row], b, a[:, row + 1 :]], axis=1) for a, b in pairs)
        outs.append(merged(*past_live(arrays, live), live, w)[row])
    assert all(same_bits(out, outs[0]) for out in outs[1:])


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
    args = (jnp.asarray(prefix, jnp.int32), None, w_uv(q.dtype, value_dim), SCALE, value_dim)
    return np.asarray(mla_output_exact(q, cache, *args, causal=True, interpret=INTERPRET))


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
