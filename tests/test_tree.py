"""DDTree construction, ancestor mask and verification walk vs pure-Python references (spec §3.2-3.6)."""

from __future__ import annotations

import heapq
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax.tree import (
    Tree,
    ancestor_mask,
    build_tree,
    build_tree_from_topk,
    chain_tree,
    follow_verified_tree,
    positions,
)

_build = jax.jit(jax.vmap(build_tree, in_axes=(0, 0, None)), static_argnums=2)
_build_topk = jax.jit(jax.vmap(build_tree_from_topk, in_axes=(0, 0, 0, None)), static_argnums=3)
_chain = jax.jit(chain_tree, static_argnames="budget")
_walk_one = jax.jit(follow_verified_tree, static_argnums=2)


def _round(logits: jax.Array, root: jax.Array, post: jax.Array, budget: int, max_depth: int):
    """build -> mask -> walk for one sequence, chained as in the engine (one compile per shape in tests)."""
    tree = build_tree(logits, root, budget)
    return tree, ancestor_mask(tree, max_depth), follow_verified_tree(tree, post, max_depth)


_round_one = jax.jit(_round, static_argnums=(3, 4))
_round_batch = jax.jit(jax.vmap(_round, in_axes=(0, 0, 0, None, None)), static_argnums=(3, 4))


class RefNode(NamedTuple):
    path: tuple[int, ...]  # token path from the root (excluded) to this node
    score: float
    parent: int  # index in pop order, 0 = root, nodes from 1


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def heap_reference(lp: np.ndarray, budget: int) -> list[RefNode]:
    """Spec §3.2 best-first heap on log-probs lp [D, V] (float64 here); ties pop in lexicographic rank-tuple
    order, and tied log-probs rank lower token ids first (like lax.top_k).

    Returns the popped nodes in pop order (node n = list index n - 1). Nodes of -inf score are never popped.
    """
    k = min(budget, lp.shape[1])
    ranked = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return heap_from_topk(np.take_along_axis(lp, ranked, axis=-1), ranked, budget)


def heap_from_topk(lp_k: np.ndarray, ids_k: np.ndarray, budget: int) -> list[RefNode]:
    """The heap of `heap_reference` on per-depth sorted top-K log-probs lp_k [D, K] with token ids ids_k."""
    n_depth, k = lp_k.shape
    nodes: list[RefNode] = []
    scores = [0.0]  # by node index, root first
    heap = [(-lp_k[0, 0], (0,), 0)]  # (-score, rank tuple, parent node index)
    while heap and len(nodes) < budget:
        neg, ranks, parent = heapq.heappop(heap)
        if neg == np.inf:
            break
        d, r = len(ranks), ranks[-1]
        parent_path = nodes[parent - 1].path if parent else ()
        nodes.append(RefNode(parent_path + (int(ids_k[d - 1, r]),), -neg, parent))
        scores.append(-neg)
        if r + 1 < k:
            heapq.heappush(heap, (-(scores[parent] + lp_k[d - 1, r + 1]), ranks[:-1] + (r + 1,), parent))
        if d < n_depth:
            heapq.heappush(heap, (-(-neg + lp_k[d, 0]), ranks + (0,), len(nodes)))
    return nodes


def token_paths(tree: Tree) -> list[tuple[int, ...]]:
    """Token path of every valid non-root node, in flat order."""
    tokens, parents, valid = (np.asarray(a) for a in (tree.tokens, tree.parents, tree.valid))
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (int(tokens[i]),) if valid[i] else None)
    return [p for p in paths[1:] if p is not None]


def unbatch(tree: Tree, b: int) -> Tree:
    return Tree(*(np.asarray(a)[b] for a in tree))


def logits_batch(rng: np.random.Generator, n_depth: int, vocab: int) -> np.ndarray:
    """[8, D, V] f32 logits: flat, moderate, sharp, peaked, uniform, exact ties, masked, very sharp."""
    normal = lambda scale: rng.normal(size=(n_depth, vocab)) * scale
    peaked = normal(1.0)
    peaked[np.arange(n_depth), rng.integers(0, vocab, n_depth)] += 25.0  # lp of the argmax rounds to 0 in f32
    ties = rng.uniform(0.5, 2.0, size=(n_depth, 1)) * rng.integers(0, 3, size=(n_depth, vocab))
    masked = normal(1.0)
    masked[rng.random((n_depth, vocab)) < 0.4] = -np.inf
    masked[:, 0] = 0.0  # at least one finite token per depth
    uniform = np.zeros((n_depth, vocab))
    batch = [normal(0.3), normal(1.0), normal(3.0), peaked, uniform, ties, masked, normal(10.0)]
    return np.stack(batch).astype(np.float32)


def assert_matches_heap(tree: Tree, ref: list[RefNode], root: int, atol: float) -> None:
    """Same nodes in the same (heap) order, parents, depths and scores; canonical padding after them."""
    n, budget = len(ref), len(tree.tokens) - 1
    assert tree.tokens[0] == root and tree.parents[0] == -1 and tree.depth[0] == 0 and tree.score[0] == 0
    assert token_paths(tree) == [node.path for node in ref]
    assert tree.valid.tolist() == [True] * (n + 1) + [False] * (budget - n)
    np.testing.assert_array_equal(tree.parents[1 : n + 1], [node.parent for node in ref])
    np.testing.assert_array_equal(tree.depth[1 : n + 1], [len(node.path) for node in ref])
    np.testing.assert_allclose(tree.score[1 : n + 1], [node.score for node in ref], rtol=atol, atol=atol)
    pad = slice(n + 1, None)
    assert np.all(tree.parents[pad] == -1) and np.all(tree.depth[pad] == 0) and np.all(tree.tokens[pad] == 0)
    assert np.all(tree.score[pad] == -np.inf)


CASES = [  # (D, budget, V): every budget 1..64, mostly budget > V; (2, 8, 2) has only 6 prefixes -> padding
    *[(7, b, v) for b, v in ((2, 40), (8, 5), (32, 50), (64, 4))],
    *[(3, b, v) for b, v in ((4, 4), (16, 3), (64, 4))],
    *[(2, b, v) for b, v in ((1, 3), (8, 2), (32, 50))],
    *[(1, b, v) for b, v in ((2, 40), (64, 4))],
]


@pytest.mark.parametrize(("n_depth", "budget", "vocab"), CASES)
def test_build_tree_matches_heap(n_depth: int, budget: int, vocab: int) -> None:
    rng = np.random.default_rng(1000 * n_depth + budget)
    logits = logits_batch(rng, n_depth, vocab)
    roots = rng.integers(0, vocab, len(logits)).astype(np.int32)
    trees = _build(jnp.asarray(logits), jnp.asarray(roots), budget)
    for b, lg in enumerate(logits):
        assert trees.tokens.shape == (len(logits), budget + 1)
        ref = heap_reference(_log_softmax64(lg), budget)
        assert_matches_heap(unbatch(trees, b), ref, roots[b], atol=1e-5)


def dyadic_topk(rng: np.random.Generator, batch: int, n_depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """lp_k [batch, D, K] in {0, -0.5, -1, -1.5, -inf} (rows sorted descending), distinct ids_k [batch, D, K].

    Dyadic log-probs sum exactly in f32 and f64, so ties across different rank tuples are exact.
    """
    lp_k = -rng.integers(0, 4, (batch, n_depth, k)) / 2.0
    lp_k[rng.random(lp_k.shape) < 0.1] = -np.inf
    lp_k[:, :, 0] = np.maximum(lp_k[:, :, 0], -1.5)  # at least one finite entry per depth
    ids_k = np.argsort(rng.random((batch, n_depth, 3 * k)), axis=-1)[..., :k].astype(np.int32)
    return -np.sort(-lp_k, axis=-1), ids_k


def assert_topk_build_matches_heap(lp_k: np.ndarray, ids_k: np.ndarray, budget: int) -> None:
    roots = jnp.zeros(len(lp_k), jnp.int32)
    trees = _build_topk(jnp.asarray(lp_k, jnp.float32), jnp.asarray(ids_k), roots, budget)
    for b in range(len(lp_k)):
        assert_matches_heap(unbatch(trees, b), heap_from_topk(lp_k[b], ids_k[b], budget), 0, atol=0.0)


@pytest.mark.parametrize(("n_depth", "k", "budget"), [(3, 8, 15), (4, 2, 16), (7, 3, 64)])
def test_exact_ties_match_heap_order(n_depth: int, k: int, budget: int) -> None:
    """With exact ties everywhere the builder must reproduce the heap's lexicographic tie order."""
    lp_k, ids_k = dyadic_topk(np.random.default_rng(n_depth * 100 + k), 8, n_depth, k)
    assert_topk_build_matches_heap(lp_k, ids_k, budget)


def test_tie_order_needs_lex_beam_layout() -> None:
    """Parent (1,0) outscores its lex predecessor (0,1), and (0,1,0) ties with the seven (1,0,r>0): the heap
    keeps (0,1,0) (lex first), which a beam laid out in score order instead of lex order would cut."""
    lp_k, ids_k = dyadic_topk(np.random.default_rng(5), 8, 3, 8)  # shares the (3, 8, 15) compile
    lp_k[0] = [[0, -0.5] + [-2] * 6, [0, -1] + [-2] * 6, [0] + [-0.5] * 7]
    ids_k[0] = np.arange(8)
    assert heap_from_topk(lp_k[0], ids_k[0], 15)[-1].path == (0, 1, 0)
    assert_topk_build_matches_heap(lp_k, ids_k, 15)


def test_padding_when_budget_exceeds_all_prefixes() -> None:
    logits = np.random.default_rng(0).normal(size=(1, 2, 2)).astype(np.float32)  # 2 + 4 = 6 prefixes
    tree = unbatch(_build(jnp.asarray(logits), jnp.zeros(1, jnp.int32), 9), 0)
    assert tree.valid.tolist() == [True] * 7 + [False] * 3
    assert sorted(token_paths(tree)) == [(0,), (0, 0), (0, 1), (1,), (1, 0), (1, 1)]


def test_chain_tree_is_argmax_per_depth() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(7, 33)).astype(np.float32) * 2
    argmax = np.argmax(logits, axis=-1)
    cum = np.cumsum(np.max(_log_softmax64(logits), axis=-1))
    tree = _chain(jnp.asarray(logits), jnp.int32(5))
    np.testing.assert_array_equal(tree.tokens, np.r_[5, argmax])
    np.testing.assert_array_equal(tree.parents, np.arange(8) - 1)
    np.testing.assert_array_equal(tree.depth, np.arange(8))
    assert np.all(tree.valid)
    np.testing.assert_allclose(tree.score, np.r_[0.0, cum], rtol=1e-5)
    longer, shorter = (_chain(jnp.asarray(logits), 5, budget=b) for b in (10, 3))
    np.testing.assert_array_equal(longer.tokens, np.r_[5, argmax, 0, 0, 0])
    np.testing.assert_array_equal(longer.parents, np.r_[np.arange(8) - 1, -1, -1, -1])
    assert longer.valid.tolist() == [True] * 8 + [False] * 3
    np.testing.assert_array_equal(shorter.tokens, np.r_[5, argmax[:3]])


def test_positions() -> None:
    tree = _chain(jnp.zeros((3, 4)), 0, budget=5)
    np.testing.assert_array_equal(jax.jit(positions)(tree, 100), [100, 101, 102, 103, 100, 100])


def reference_mask(tree: Tree) -> np.ndarray:
    t = len(tree.parents)
    vis = np.eye(t, dtype=bool)
    for i in range(t):
        j = tree.parents[i] if tree.valid[i] else -1
        while j >= 0:
            vis[i, j], j = True, tree.parents[j]
    return vis


def reference_walk(tree: Tree, post: np.ndarray) -> list[int]:
    """Spec §3.6 walk by explicit child search; returns the visited node indices."""
    path = [0]
    while True:
        kids = [c for c in range(len(tree.tokens)) if tree.valid[c] and tree.parents[c] == path[-1]]
        match = [c for c in kids if tree.tokens[c] == post[path[-1]]]
        if not match:
            return path
        path.append(match[0])


def check_structure(tree: Tree, n_depth: int) -> None:
    """Invariants of any built tree: root, parents precede children, depths, monotone scores, padding."""
    n_valid = int(tree.valid.sum())
    assert tree.valid[0] and np.all(tree.valid[:n_valid])  # padding only at the tail
    for i in range(1, n_valid):
        p = tree.parents[i]
        assert 0 <= p < i and tree.depth[i] == tree.depth[p] + 1 <= n_depth
        assert tree.score[i] <= tree.score[p] and tree.score[i] <= tree.score[i - 1]
    for i in range(n_valid):
        kids = tree.tokens[1:n_valid][tree.parents[1:n_valid] == i]
        assert len(set(kids.tolist())) == len(kids)  # siblings distinct


HYPO_SHAPES = [(1, 3, 4), (3, 2, 8), (4, 5, 12)]  # (D, V, budget): few shapes, one compile each


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from(HYPO_SHAPES),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.0, 0.1, 1.0, 5.0]),
    quantum=st.sampled_from([0.0, 0.5]),
)
def test_tree_mask_walk_properties(shape: tuple[int, int, int], seed: int, scale: float, quantum: float) -> None:
    n_depth, vocab, budget = shape
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(1, n_depth, vocab)) * scale
    if quantum:  # coarse grid -> many exact ties
        logits = np.round(logits / quantum) * quantum
    post = rng.integers(0, vocab, (1, budget + 1)).astype(np.int32)  # small V: walks often descend
    root = jnp.asarray([seed % vocab], jnp.int32)
    trees, vis, walk = _round_batch(jnp.asarray(logits, jnp.float32), root, jnp.asarray(post), budget, n_depth)
    tree, vis, post = unbatch(trees, 0), np.asarray(vis)[0], post[0]
    check_structure(tree, n_depth)
    assert tree.valid.sum() == 1 + min(budget, sum(min(budget, vocab) ** d for d in range(1, n_depth + 1)))

    np.testing.assert_array_equal(vis, reference_mask(tree))
    for i in range(1, len(vis)):  # row i = row parent(i) | {i}
        expect = np.eye(len(vis), dtype=bool)[i] | (vis[tree.parents[i]] if tree.valid[i] else False)
        np.testing.assert_array_equal(vis[i], expect)

    path, tau, bonus = (np.asarray(a)[0] for a in walk)
    ref = reference_walk(tree, post)
    assert tau == len(ref) <= n_depth + 1 and path[:tau].tolist() == ref and np.all(path[tau:] == 0)
    assert bonus == post[path[tau - 1]]
    for a, b in zip(path[: tau - 1], path[1:tau], strict=True):
        assert tree.valid[b] and tree.parents[b] == a and tree.tokens[b] == post[a]
    last = path[tau - 1]  # maximal: no child of the last node carries the target's token
    assert not np.any(tree.valid & (tree.parents == last) & (tree.tokens == post[last]))


def test_walk_stops_at_max_depth() -> None:
    tree = _chain(jnp.asarray(np.eye(6, dtype=np.float32)[:5] * 9), 0)  # tokens 0, 1, ..., 4
    post = jnp.asarray([0, 1, 2, 3, 4, 5], jnp.int32)  # every node's target token continues the chain
    path, tau, bonus = _walk_one(tree, post, 3)
    assert path.tolist() == [0, 1, 2, 3] and tau == 4 and bonus == 3
    path, tau, bonus = _walk_one(tree, post, 5)
    assert path.tolist() == [0, 1, 2, 3, 4, 5] and tau == 6 and bonus == 5


def test_vmap_matches_per_sequence() -> None:
    rng = np.random.default_rng(7)
    n_depth, vocab, budget = HYPO_SHAPES[-1]
    batch = 4
    logits = jnp.asarray(rng.normal(size=(batch, n_depth, vocab)), jnp.float32)
    roots = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    posts = jnp.asarray(rng.integers(0, vocab, (batch, budget + 1)), jnp.int32)
    batched = jax.tree.leaves(_round_batch(logits, roots, posts, budget, n_depth))
    for b in range(batch):
        single = jax.tree.leaves(_round_one(logits[b], roots[b], posts[b], budget, n_depth))
        assert len(single) == len(batched) == 9  # 5 tree fields, mask, path, tau, bonus
        for got, want in zip(batched, single, strict=True):
            np.testing.assert_array_equal(got[b], want)
