"""Exact top-k over the last axis in rounds of per-chunk top-k, for rows too few and too long for the GPU.

The DDTree's draft distribution `[B, D, V]` at batch 1 is D long rows, for which XLA's own top-k can fall back to a
sort of every row. Splitting each row into chunks, taking the top-k of every chunk (D * V / chunk short rows), and
repeating on the concatenated winners until one chunk is left gives the same values and indices bit for bit.
The chunk length is part of the kernel selection (`pallas_kernels.dispatch.Kernels.topk_chunk`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k(x: jax.Array, k: int, chunk: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` bit for bit (x `[..., n]` float -> values `[..., k]` descending, int32 indices `[..., k]`,
    equal values in ascending index order), computed chunk-wise when n > max(chunk, 4k) (the chunk length used;
    0 takes `lax.top_k` itself).

    Exact because every entry of the top-k (under value desc, index asc) is in its own chunk's top-k, and the
    winners are concatenated chunk by chunk, each chunk's in that same order, so among equal values a candidate's
    position still ascends with its index. A short last chunk is padded with -inf, which ranks after every real
    entry of the same value (its index is higher), so padding is never returned when n >= k.
    """
    n = x.shape[-1]
    if k > n:
        raise ValueError(f"top_k: k = {k} exceeds the row length {n}")
    chunk = max(chunk, 4 * k) if chunk else n  # each round shrinks the rows at least 4x; 0: no rounds
    lead = x.shape[:-1]
    ids = None  # [..., m] original index of each candidate; None: the candidates are x itself
    while x.shape[-1] > chunk:
        m = x.shape[-1]
        pad = -m % chunk
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf)
        vals, pos = jax.lax.top_k(x.reshape(*lead, (m + pad) // chunk, chunk), k)
        pos = (pos + chunk * jnp.arange((m + pad) // chunk, dtype=pos.dtype)[:, None]).reshape(*lead, -1)
        x = vals.reshape(*lead, -1)
        ids = pos if ids is None else jnp.take_along_axis(jnp.pad(ids, [(0, 0)] * len(lead) + [(0, pad)]), pos, -1)
    vals, pos = jax.lax.top_k(x, k)
    return vals, (pos if ids is None else jnp.take_along_axis(ids, pos, -1)).astype(jnp.int32)
