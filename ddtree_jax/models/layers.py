"""Shared building blocks: RMSNorm, YaRN RoPE tables, rotary embeddings (interleaved and rotate-half), SwiGLU. The
norm and the rotate-half rotation are `pallas_kernels.reference`'s, which the drafter's attention kernel matches."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.config import YarnConfig
from pallas_kernels.reference import rms_norm as rms_norm  # one definition, the kernels' reference's
from pallas_kernels.reference import rotate_half, swiglu_hidden


def yarn_inv_freq(dim: int, theta: float, yarn: YarnConfig | None) -> np.ndarray:
    """Inverse frequencies `[dim / 2]` (float64) with YaRN blending (kimi_k2.md §3.4), computed on the host."""
    i = np.arange(dim // 2, dtype=np.float64)
    f_extra = theta ** (-2.0 * i / dim)
    if yarn is None:
        return f_extra
    f_inter = f_extra / yarn.factor

    def corr(n_rot: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    return f_inter * ramp + f_extra * (1.0 - ramp)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, amplitude: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The RoPE tables of `positions [...]`: (cos, sin) `[..., len(inv_freq)]` f32, times `amplitude`."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angle) * amplitude, jnp.sin(angle) * amplitude


def rope_interleaved(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, amplitude: float = 1.0) -> jax.Array:
    """GPT-J style RoPE: channels (2i, 2i+1) rotate by positions * inv_freq[i].

    x: `[..., S, (heads,) R]`; positions broadcast against x's leading dims without the head/channel axes:
    `positions` has shape x.shape[:-1] or x.shape[:-2] (then broadcast over heads).
    """
    cos, sin = rope_cos_sin(positions, inv_freq, amplitude)
    if cos.ndim == x.ndim - 1:  # positions without a head axis
        cos, sin = cos[..., None, :], sin[..., None, :]
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def rope_half(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, amplitude: float = 1.0) -> jax.Array:
    """NeoX / Qwen3 rotate-half RoPE over the full last axis: pairs (i, i + d/2). Same shape rules as above."""
    cos, sin = rope_cos_sin(positions, inv_freq, amplitude)
    if cos.ndim == x.ndim - 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    return rotate_half(x, cos, sin)


def swiglu(
    x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, matmul: Callable[..., jax.Array] = jnp.dot
) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)); weights `[in, out]`, f32 accumulation, result in x.dtype. `matmul(a, b,
    preferred_element_type=)` computes the three products (default `jnp.dot`)."""
    h = swiglu_hidden(x, gate, up, matmul)
    return matmul(h, down, preferred_element_type=jnp.float32).astype(x.dtype)


def causal_mask(batch: int, n: int) -> jax.Array:
    """`[batch, n, n]` bool lower-triangular (a causal block is a tree whose node i has parent i - 1)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (batch, n, n))
