"""The one-launch Pallas DDTree kernel (interpret mode on CPU) against the spec §3.2 heap and the plain-JAX build."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import make_pair, random_prompts, run
from test_tree import assert_matches_heap, heap_from_topk, logits_batch

from ddtree_jax import engine
from ddtree_jax.tree import Tree, ancestor_mask, build_tree_from_topk
from pallas_kernels import tree_build

_reference = jax.jit(
    jax.vmap(
        lambda lp, ids, r, budget: (t := build_tree_from_topk(lp, ids, r, budget), ancestor_mask(t)),
        in_axes=(0, 0, 0, None),
    ),
    static_argnums=3,
)


def brute_force_mask(parents: np.ndarray) -> np.ndarray:
    """[T, T]: j is i or one of its ancestors, by following parent pointers one at a time."""
    t = len(parents)
    mask = np.eye(t, dtype=bool)
    for i in range(t):
        j = parents[i]
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


@pytest.mark.parametrize(("n_depth", "budget", "vocab"), [(7, 16, 50), (7, 8, 5), (3, 32, 3), (15, 16, 30), (2, 8, 2)])
def test_kernel_matches_heap_and_reference(n_depth: int, budget: int, vocab: int) -> None:
    rng = np.random.default_rng(1)
    logits = logits_batch(rng, n_depth, vocab)  # ties, -inf entries, uniform rows, fewer prefixes than budget
    k = min(budget, vocab)
    lp_k, ids_k = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(logits), axis=-1), k)
    roots = jnp.asarray(rng.integers(0, vocab, len(logits)), jnp.int32)
    *fields, mask = tree_build.build_tree_pallas(lp_k, ids_k, roots, budget, interpret=True)
    tree = Tree(*(np.asarray(f) for f in fields))
    assert tree.tokens.shape == mask.shape[:2] == (len(logits), budget + 1) and mask.dtype == bool
    ref_tree, ref_mask = _reference(lp_k, ids_k, roots, budget)
    for got, want in zip((*tree, mask), (*ref_tree, ref_mask), strict=True):  # bit for bit, padding included
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for b in range(len(logits)):
        one = Tree(*(f[b] for f in tree))
        heap = heap_from_topk(np.asarray(lp_k[b], np.float64), np.asarray(ids_k[b]), budget)
        assert_matches_heap(one, heap, int(roots[b]), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(mask[b]), brute_force_mask(one.parents))


@pytest.mark.parametrize(("n_depth", "budget", "k"), [(4, 16, 3), (7, 32, 4), (3, 8, 2)])
def test_kernel_breaks_score_ties_by_rank_tuple(n_depth: int, budget: int, k: int) -> None:
    """Log-probs from {0, -1, -2} (and -inf): many prefixes tie exactly, across depths too, so the order among them
    is decided by the lexicographic rank-tuple rule alone."""
    rng = np.random.default_rng(2)
    lp = -np.sort(rng.integers(0, 3, (8, n_depth, k)), axis=-1).astype(np.float32)
    lp[rng.random(lp.shape) < 0.1] = -np.inf
    lp = -np.sort(-lp, axis=-1)
    lp[:, :, 0] = np.maximum(lp[:, :, 0], -2.0)
    ids = rng.permuted(np.tile(np.arange(k, dtype=np.int32), (8, n_depth, 1)), axis=-1)
    roots = jnp.zeros(8, jnp.int32)
    *fields, mask = tree_build.build_tree_pallas(jnp.asarray(lp), jnp.asarray(ids), roots, budget, interpret=True)
    for b in range(8):
        one = Tree(*(np.asarray(f)[b] for f in fields))
        assert_matches_heap(one, heap_from_topk(lp[b].astype(np.float64), ids[b], budget), 0, atol=0)
        np.testing.assert_array_equal(np.asarray(mask[b]), brute_force_mask(one.parents))


def test_engine_on_the_kernel_equals_autoregressive(monkeypatch):
    """The engine's ddtree rounds with the kernel building every tree: greedy output equals AR, and the acceptance
    histogram equals the plain-JAX build's (same trees, same walks)."""
    rng = np.random.default_rng(3)
    target, drafter = make_pair(int(rng.integers(1 << 20)), vocab=13)
    prompts, plen = random_prompts(rng, 3, 6, 13)
    spec = engine.GenSpec("ddtree", 3, 6, 20, budget=8)
    ar, _ = run(target, None, engine.GenSpec("ar", 3, 6, 20), prompts, plen)
    plain, plain_out = run(target, drafter, spec, prompts, plen)
    calls, kernel = [], tree_build.build_tree_pallas

    def counted(*args, **kwargs):
        calls.append((args[-1], kwargs))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tree_build, "build_tree_pallas", counted)
    kernels = dataclasses.replace(spec.kernels, build_tree="interpret")
    got, out = run(target, drafter, dataclasses.replace(spec, kernels=kernels), prompts, plen)
    assert calls == [(8, {"interpret": True})] and got == ar == plain
    np.testing.assert_array_equal(out.accept_hist, plain_out.accept_hist)
