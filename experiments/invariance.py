"""The target's forward of the same tokens computed in different calls (flag-free: experiments.exact_probe and the
tests use it): one-token decode steps, a block under a mask, the ancestor chain of a tree."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ddtree_jax.sizing import cache_slots


def _forward(target, kernels, cache, start: int, tokens: np.ndarray, mask: np.ndarray):
    """One forward of `tokens [B, N]` at `start` (positions start + depth from `mask [B, N, N]`) -> (residuals
    `[B, N, layers, H]`, logits `[B, N, V]`) as f32 numpy, and the cache with the block written."""
    layers = tuple(range(target.config.num_hidden_layers))
    depth = mask.sum(-1) - 1
    b = tokens.shape[0]
    out = target(
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(start + depth, jnp.int32),
        cache,
        jnp.full((b,), start, jnp.int32),
        jnp.asarray(mask),
        feature_layers=layers,
        kernels=kernels,
    )
    feats = np.asarray(out.features.astype(jnp.float32)).reshape(*tokens.shape, len(layers), -1)
    return feats, np.asarray(target.logits(out.hidden, kernels=kernels)), out.cache


def run_block(target, kernels, cache, start: int, tokens: np.ndarray, mask: np.ndarray):
    """One forward of `tokens [B, N]` at `start` (positions start + depth from `mask [B, N, N]`) -> (residuals
    `[B, N, layers, H]`, logits `[B, N, V]`) as f32 numpy."""
    feats, logits, _ = _forward(target, kernels, cache, start, tokens, mask)
    return feats, logits


def prefilled(target, kernels, prompts: np.ndarray):
    """The latent caches after prefilling `prompts [B, P]` in one causal block (capacity P + 128 in whole chunks)."""
    b, p = prompts.shape
    causal = np.broadcast_to(np.tril(np.ones((p, p), bool)), (b, p, p))
    return _forward(target, kernels, target.init_cache(b, cache_slots(p + 128)), 0, prompts, causal)[2]


def decode_steps(target, kernels, cache, start: int, tokens: np.ndarray):
    """tokens `[B, k]` one per call -> residuals `[B, k, layers, H]`, logits `[B, k, V]`."""
    feats, logits = [], []
    one = np.ones((tokens.shape[0], 1, 1), bool)
    for t in range(tokens.shape[1]):
        f, lg, cache = _forward(target, kernels, cache, start + t, tokens[:, t : t + 1], one)
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
