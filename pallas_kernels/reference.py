"""Plain-JAX references for the Pallas kernels. They define the semantics; kernels must match them.

Kernels (and these references) know nothing of models: they take arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize_int4(q: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """int4 `[..., N, K]` with group-major scales `[..., K / G, N]` -> `[..., N, K]` in `dtype`:
    w[n, k] = q[n, k] * scale[k // G, n]."""
    group = q.shape[-1] // scale.shape[-2]
    s = jnp.repeat(jnp.swapaxes(scale, -1, -2).astype(jnp.float32), group, axis=-1)
    return (q.astype(jnp.float32) * s).astype(dtype)


def moe_swiglu_reference(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    gate_up_q: jax.Array,
    gate_up_s: jax.Array,
    down_q: jax.Array,
    down_s: jax.Array,
) -> jax.Array:
    """Routed-expert SwiGLU of one MoE layer with INT4 group-quantized experts.

    x: `[T, H]` bf16; topk_ids: `[T, k]` int32; topk_weights: `[T, k]` f32 (already renormalised and scaled).
    gate_up_q: int4 `[E, 2I, H]` (rows 0..I-1 gate, I..2I-1 up), gate_up_s: bf16 `[E, H/G, 2I]`;
    down_q: int4 `[E, H, I]`, down_s: bf16 `[E, I/G, H]` (scales group-major, see `dequantize_int4`).
    Returns `[T, H]` in x.dtype: sum_k w[t,k] * down_e(silu(gate_e x) * up_e x), accumulated in f32.

    Reads only the distinct experts that received tokens: a scan over min(T*k, E) expert slots, each slot
    dequantizing one expert and applying it to all tokens with that token's combine weight (0 if unrouted).
    """
    t, k = topk_ids.shape
    n_experts = gate_up_q.shape[0]
    inter = down_q.shape[-1]
    slots = min(t * k, n_experts)
    uniq = jnp.unique(topk_ids.reshape(-1), size=slots, fill_value=-1)
    # combine[s, t]: weight of the expert in slot s for token t (0 when not routed / padding slot).
    combine = jnp.sum(
        jnp.where(topk_ids[None, :, :] == uniq[:, None, None], topk_weights[None].astype(jnp.float32), 0.0),
        axis=-1,
    )

    def one_expert(acc, slot):
        e, c = slot
        e_safe = jnp.maximum(e, 0)
        wgu = dequantize_int4(gate_up_q[e_safe], gate_up_s[e_safe], x.dtype)  # [2I, H]
        wd = dequantize_int4(down_q[e_safe], down_s[e_safe], x.dtype)  # [H, I]
        gu = jnp.einsum("th,nh->tn", x, wgu, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(x.dtype)
        y = jnp.einsum("ti,hi->th", h, wd, preferred_element_type=jnp.float32)
        return acc + y * c[:, None], None

    acc, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), (uniq, combine))
    return acc.astype(x.dtype)


def mla_attention_reference(
    q: jax.Array,
    latent_cache: jax.Array,
    prefix_len: jax.Array,
    tree_mask: jax.Array,
    scale: float,
    value_dim: int = 512,
) -> jax.Array:
    """Absorbed-MLA attention of a block of new nodes over one layer's latent cache.

    q: `[B, N, Hq, Dk]` (Dk = 576: 512 absorbed-nope + 64 rope); latent_cache: `[B, L, Dk]` holding the prefix at
    slots `< prefix_len[b]` and the N new nodes at slots `prefix_len[b] + j`; tree_mask: `[B, N, N]` bool, node i
    sees node j iff tree_mask[b, i, j] (ancestors-or-self for a tree, lower-triangular for a causal block).
    Returns `[B, N, Hq, value_dim]` in q.dtype: softmax(scale * q.K) @ V with V = K[..., :value_dim], f32 softmax.
    """
    b, n, _, _ = q.shape
    length = latent_cache.shape[1]
    slot = jnp.arange(length)[None, None, :]  # [1, 1, L]
    rel = slot - prefix_len[:, None, None]  # [B, 1, L] index into the new block
    in_block = (rel >= 0) & (rel < n)
    block_vis = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, n - 1), (b, n, length)), axis=2
    )  # [B, N, L]
    visible = (rel < 0) | (in_block & block_vis)
    s = jnp.einsum("bnhd,bld->bnhl", q, latent_cache, preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum(
        "bnhl,bld->bnhd",
        p.astype(latent_cache.dtype),
        latent_cache[..., :value_dim],
        preferred_element_type=jnp.float32,
    )
    return o.astype(q.dtype)
