"""Token choice from target logits: greedy (temperature 0) or one sample per row from that row's own key, from the
distribution `transform_logits` makes (temperature, then top-k, then top-p: the order of vLLM and HF transformers).
Prefill, `ar` steps and the verify step of `dflash`/`ddtree` all draw through `sample`, so a speculative method
samples each position from the same transformed distribution as `ar` (a drafted token is accepted only when it
equals the target's own draw at its parent node), which keeps it lossless.

Randomness is per request: row b's keys descend from `request_keys(seed, indices)[b]` alone, so a request's
samples depend on (seed, its request index) and on nothing else in the batch (its row, the batch size, padding rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def request_keys(seed: int, indices: Sequence[int] | np.ndarray) -> jax.Array:
    """`[B]` typed keys, row b's = fold_in(key(seed), indices[b]); indices are request indices in [0, 2**32)."""
    idx = np.asarray(indices, np.int64)
    if idx.ndim != 1 or idx.size == 0 or idx.min() < 0 or idx.max() >= 2**32:
        raise ValueError(f"request indices must be a non-empty list of integers in [0, 2**32), got {indices}")
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), jnp.asarray(idx, jnp.uint32))


def split_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`[B]` keys -> (next keys `[B]`, subkeys `[B]` for this step), each row's from its own key."""
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


def transform_logits(logits: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """logits `[..., V]` -> logits / temperature `[..., V]`, -inf outside the kept set; all parameters static.

    top_k > 0 keeps the tokens whose scaled logit is >= the k-th largest (a tie with the k-th keeps every tied token,
    as vLLM and HF do); 0 keeps all. top_p < 1 then keeps the nucleus of the renormalised top-k distribution: the
    fewest highest-probability tokens whose mass is >= top_p, plus every token tied with the least probable of them
    (so the most probable token is always kept); 1 keeps all. temperature must be > 0.
    """
    x = logits / temperature
    if top_k == 0 and top_p == 1.0:
        return x
    v = x.shape[-1]
    # Candidates in descending order: the k largest, or the whole sorted row. Tokens tied with the k-th beyond
    # these k share its value, so they enter or leave the nucleus with it.
    ranked = jax.lax.top_k(x, min(top_k, v))[0] if top_k else -jnp.sort(-x, axis=-1)
    keep = x >= ranked[..., -1:]
    if top_p < 1.0:
        log_z = jax.nn.logsumexp(jnp.where(keep, x, -jnp.inf), axis=-1, keepdims=True)
        probs = jnp.exp(ranked - log_z)
        n_keep = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)  # >= 1
        keep &= x >= jnp.take_along_axis(ranked, n_keep - 1, axis=-1)
    return jnp.where(keep, x, -jnp.inf)


def sample(logits: jax.Array, keys: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """logits `[B, ..., V]` f32, keys `[B]` -> tokens `[B, ...]` int32, row b drawn with keys[b] alone from
    `transform_logits(logits, temperature, top_k, top_p)`. All parameters are static; temperature 0 means argmax
    (keys unused; `engine.GenSpec` refuses top_k / top_p with it)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    draw = jax.vmap(lambda k, lg: jax.random.categorical(k, transform_logits(lg, temperature, top_k, top_p), axis=-1))
    return draw(keys, logits).astype(jnp.int32)
