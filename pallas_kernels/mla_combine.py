"""Merge of split-KV attention partials by log-sum-exp, shared by the Triton and Mosaic GPU MLA kernels.

Each split s of a row wrote a normalised partial output o_s and its log-sum-exp lse_s; the row's output is
sum_s w_s o_s with w_s = exp(lse_s - max_s lse) / sum_s exp(lse_s - max_s lse). Splits that saw no slot have
lse = -inf and weigh 0; a row no split saw is 0 / 0 = NaN, as in the reference. Plain JAX: XLA runs it as a few
small kernels after the attention kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_splits(o_part: jax.Array, lse: jax.Array, rows: int, dtype: jnp.dtype) -> jax.Array:
    """o_part `[B, S, R_pad, dv]`, lse `[B, S, R_pad]` f32 -> `[B, rows, dv]` in `dtype`. One split: its partial."""
    if o_part.shape[1] == 1:
        return o_part[:, 0, :rows].astype(dtype)
    m = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))  # [B, S, R]; empty splits weigh 0
    w = w / jnp.sum(w, axis=1, keepdims=True)  # 0 / 0 only for a row that sees no slot (NaN, as the reference)
    return jnp.sum(w[..., None] * o_part.astype(jnp.float32), axis=1)[:, :rows].astype(dtype)
