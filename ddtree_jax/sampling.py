"""Token choice from target logits: greedy (temperature 0) or one sample per row from that row's own key.

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


def sample(logits: jax.Array, keys: jax.Array, temperature: float) -> jax.Array:
    """logits `[B, ..., V]` f32, keys `[B]` -> tokens `[B, ...]` int32, row b drawn with keys[b] alone.
    temperature is static: 0 means argmax (keys unused)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    draw = jax.vmap(lambda k, lg: jax.random.categorical(k, lg / temperature, axis=-1))
    return draw(keys, logits).astype(jnp.int32)
