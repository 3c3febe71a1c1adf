"""The target's forward of the same tokens computed in different calls (flag-free: experiments.exact_probe and the
tests use it): one-token decode steps, a block under a mask, the ancestor chain of a tree."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ddtree_jax import engine
from ddtree_jax.sizing import cache_slots


def _forward(target, kernels, cache, start, tokens: np.ndarray, mask: np.ndarray | None, jit: bool = False):
    """One forward of `tokens [B, N]` at `start` (an int, or `[B]` per row; positions start + depth from `mask
    [B, N, N]`; None: the model's causal block, as the engine's prefill runs it) -> (residuals `[B, N, layers, H]`,
    logits `[B, N, V]`) as f32 numpy, and the cache with the block written. jit: as one compiled program with the
    engine's compiler options (XLA fuses across ops), else op by op."""
    b, n = tokens.shape
    starts = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
    depth = np.arange(n) if mask is None else mask.sum(-1) - 1
    positions = starts[:, None] + jnp.asarray(depth, jnp.int32)
    run = _compiled(target, kernels) if jit else functools.partial(_run, target, kernels)
    mask = None if mask is None else jnp.asarray(mask)
    feats, logits, cache = run(jnp.asarray(tokens, jnp.int32), positions, cache, starts, mask)
    feats = np.asarray(feats.astype(jnp.float32)).reshape(*tokens.shape, target.config.num_hidden_layers, -1)
    return feats, np.asarray(logits), cache


def _run(target, kernels, tokens, positions, cache, starts, mask):
    out = target(
        tokens,
        positions,
        cache,
        starts,
        mask,
        feature_layers=tuple(range(target.config.num_hidden_layers)),
        kernels=kernels,
    )
    return out.features, target.logits(out.hidden, kernels=kernels), out.cache


@functools.cache
def _compiled(target, kernels):
    graph, state = nnx.split(target)
    run = jax.jit(
        lambda st, *a: _run(nnx.merge(graph, st), kernels, *a), compiler_options=engine.compiler_options(kernels)
    )
    return functools.partial(run, state)


def run_block(target, kernels, cache, start: int, tokens: np.ndarray, mask: np.ndarray | None, jit: bool = False):
    """One forward of `tokens [B, N]` at `start` (positions start + depth from `mask [B, N, N]`; None: the model's
    causal block) -> (residuals `[B, N, layers, H]`, logits `[B, N, V]`) as f32 numpy."""
    feats, logits, _ = _forward(target, kernels, cache, start, tokens, mask, jit)
    return feats, logits


def prefilled(target, kernels, prompts: np.ndarray, jit: bool = False):
    """The latent caches after prefilling `prompts [B, P]` in one causal block, as the engine's prefill (capacity
    P + 128 in whole chunks)."""
    b, p = prompts.shape
    return _forward(target, kernels, target.init_cache(b, cache_slots(p + 128)), 0, prompts, None, jit)[2]


def decode_steps(target, kernels, cache, start, tokens: np.ndarray, jit: bool = False):
    """tokens `[B, k]` one per call from `start` (an int, or `[B]` per row) -> residuals `[B, k, layers, H]`,
    logits `[B, k, V]`."""
    feats, logits = [], []
    one = np.ones((tokens.shape[0], 1, 1), bool)
    for t in range(tokens.shape[1]):
        f, lg, cache = _forward(target, kernels, cache, np.asarray(start) + t, tokens[:, t : t + 1], one, jit)
        feats.append(f)
        logits.append(lg)
    return np.concatenate(feats, 1), np.concatenate(logits, 1)


def chain_tree(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """An n-node ancestors-or-self mask whose nodes chain[0..k-1] form a path from the root, other nodes branching
    off at random: (mask `[n, n]`, chain indices `[k]`)."""
    parent = [-1]
    chain = [0]
    for i in range(1, n):
        if len(chain) < k and (rng.random() < 0.5 or n - i <= k - len(chain)):
            parent.append(chain[-1])
            chain.append(i)
        else:
            parent.append(int(rng.integers(0, i)))
    mask = np.zeros((n, n), bool)
    for i in range(n):
        if parent[i] >= 0:
            mask[i] = mask[parent[i]]
        mask[i, i] = True
    return mask, np.asarray(chain)
