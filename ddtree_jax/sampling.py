"""Token choice from target logits: greedy (temperature 0) or one independent sample per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
    """logits `[..., V]` f32 -> tokens `[...]` int32. temperature is static: 0 means argmax."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
