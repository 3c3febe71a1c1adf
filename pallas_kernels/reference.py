"""Plain-JAX references for the Pallas kernels. They define the semantics; kernels must match them.

Kernels (and these references) know nothing of models: they take arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

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
    *,
    exact: bool = False,
) -> jax.Array:
    """Routed-expert SwiGLU of one MoE layer with INT4 group-quantized experts.

    x: `[T, H]` bf16; topk_ids: `[T, k]` int32; topk_weights: `[T, k]` f32 (already renormalised and scaled).
    gate_up_q: int4 `[E, 2I, H]` (rows 0..I-1 gate, I..2I-1 up), gate_up_s: bf16 `[E, H/G, 2I]`;
    down_q: int4 `[E, H, I]`, down_s: bf16 `[E, I/G, H]` (scales group-major, see `dequantize_int4`).
    Returns `[T, H]` in x.dtype: sum_k w[t,k] * down_e(silu(gate_e x) * up_e x), accumulated in f32.

    Reads only the distinct experts that received tokens: a scan over min(T*k, E) expert slots, each slot
    dequantizing one expert and applying it to all tokens with that token's combine weight (0 if unrouted).
    exact: the scan keeps each pair's expert output `[T, k, H]` and `combine_in_rank_order` sums them.
    """
    t, k = topk_ids.shape
    n_experts = gate_up_q.shape[0]
    inter = down_q.shape[-1]
    slots = min(t * k, n_experts)
    uniq = jnp.unique(topk_ids.reshape(-1), size=slots, fill_value=-1)

    def expert_output(e: jax.Array) -> jax.Array:
        """Expert e (-1: a padding slot, computed as expert 0) on every token -> `[T, H]` f32."""
        e_safe = jnp.maximum(e, 0)
        wgu = dequantize_int4(gate_up_q[e_safe], gate_up_s[e_safe], x.dtype)  # [2I, H]
        wd = dequantize_int4(down_q[e_safe], down_s[e_safe], x.dtype)  # [H, I]
        gu = jnp.einsum("th,nh->tn", x, wgu, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(x.dtype)
        return jnp.einsum("ti,hi->th", h, wd, preferred_element_type=jnp.float32)

    if exact:

        def pair_outputs(y_pairs, e):
            routed = (topk_ids == e)[:, :, None]  # [T, k, 1]: the pairs routed to e (none for a padding slot)
            return jnp.where(routed, expert_output(e)[:, None, :], y_pairs), None

        y_pairs, _ = jax.lax.scan(pair_outputs, jnp.zeros((t, k, x.shape[1]), jnp.float32), uniq)
        return combine_in_rank_order(y_pairs, topk_weights).astype(x.dtype)

    # combine[s, t]: weight of the expert in slot s for token t (0 when not routed / padding slot).
    combine = jnp.sum(
        jnp.where(topk_ids[None, :, :] == uniq[:, None, None], topk_weights[None].astype(jnp.float32), 0.0),
        axis=-1,
    )

    def one_expert(acc, slot):
        e, c = slot
        return acc + expert_output(e) * c[:, None], None

    acc, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), (uniq, combine))
    return acc.astype(x.dtype)


def combine_in_rank_order(y_pairs: jax.Array, topk_weights: jax.Array) -> jax.Array:
    """The MoE combine in a fixed order: y_pairs `[T, k, H]` f32 (the expert output of pair (t, j)), topk_weights
    `[T, k]` -> `[T, H]` f32, sum_j w[t, j] * y[t, j] as k elementwise multiply-adds in f32, j = 0..k-1 (the
    router's rank order). No reduction op: a token's sum is computed the same way whatever T is."""
    w = topk_weights.astype(jnp.float32)
    out = w[:, 0, None] * y_pairs[:, 0]
    for j in range(1, y_pairs.shape[1]):
        out = out + w[:, j, None] * y_pairs[:, j]
    return out


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


def attention_part(
    q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array | None, scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One part of a GQA attention, unnormalised: q `[B, S, kvh, G, hd]`, k/v `[B, L, kvh, hd]`, visible `[B, L]`
    bool (None: every slot) -> (P V `[B, S, kvh, G, hd]` f32, row max m `[B, S, kvh, G]` f32, exp-sum l of the same
    shape), with P = exp(scale * q.k - m) cast to v.dtype. A row that sees no slot has m = -inf, l = 0, P V = 0."""
    s = jnp.einsum("bskgd,blkd->bskgl", q, k, preferred_element_type=jnp.float32) * scale
    if visible is not None:
        s = jnp.where(visible[:, None, None, None, :], s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # a shift the output does not depend on
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])  # masked slots: exp(-inf) = 0
    pv = jnp.einsum("bskgl,blkd->bskgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return pv, m, jnp.sum(p, axis=-1)


def merge_parts(parts: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """The attention output of unnormalised parts (P V, m, l) of `attention_part` over disjoint slot sets, merged by
    log-sum-exp as flash attention merges partials: sum_i e^(m_i - M) P_i V_i / sum_i e^(m_i - M) l_i, M = max_i m_i
    (f32). Parts a row never saw (m = -inf) weigh 0; a row no part saw is 0 / 0 = NaN, as a softmax over nothing."""
    top = functools.reduce(jnp.maximum, [m for _, m, _ in parts])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = [jnp.exp(m - top) for _, m, _ in parts]
    num = sum(w[..., None] * pv for w, (pv, _, _) in zip(weights, parts, strict=True))
    den = sum(w * total for w, (_, _, total) in zip(weights, parts, strict=True))
    return num / den[..., None]


def block_attention(
    q: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_len: jax.Array,
    block_k: jax.Array,
    block_v: jax.Array,
    scale: float,
) -> jax.Array:
    """GQA attention of a drafted block over its context cache and itself, without concatenating the two.

    q: `[B, S, nh, hd]`; ctx_k, ctx_v: `[B, L, kvh, hd]`, slots `< ctx_len[b]` visible (ctx_len `[B]` int32, may be
    0); block_k, block_v: `[B, S, kvh, hd]`, all visible (bidirectional). Query head h reads KV head h // (nh / kvh).
    Returns `[B, S, nh, hd]` in q.dtype: softmax(scale * q.K) @ V over the visible context and the block, computed
    as two parts (`attention_part`) merged by log-sum-exp (`merge_parts`), f32 softmax.
    """
    b, s, nh, hd = q.shape
    kvh = ctx_k.shape[2]
    qg = q.reshape(b, s, kvh, nh // kvh, hd)
    ctx_visible = jnp.arange(ctx_k.shape[1])[None, :] < ctx_len[:, None]
    parts = [attention_part(qg, ctx_k, ctx_v, ctx_visible, scale), attention_part(qg, block_k, block_v, None, scale)]
    return merge_parts(parts).reshape(b, s, nh, hd).astype(q.dtype)


class DrafterAttentionWeights(NamedTuple):
    """One drafter layer's attention weights: input_norm `[H]`, q_proj `[H, nh*hd]` (query head j in columns
    j*hd..), q_norm and k_norm `[hd]`, and every layer's K/V projection stacked, kv_proj `[layers, 2, H, kvh*hd]`
    (K then V; KV head h in columns h*hd..), of which the op reads one layer."""

    input_norm: jax.Array
    q_proj: jax.Array
    q_norm: jax.Array
    k_norm: jax.Array
    kv_proj: jax.Array


def residual_update(residual: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    """residual `[..., N]` + (x `[..., K]` @ w `[K, N]` accumulated in f32, rounded to residual's dtype), the add in
    f32 and rounded again: a layer's update of its residual stream."""
    return residual + jnp.dot(x, w, preferred_element_type=jnp.float32).astype(residual.dtype)


class DrafterSwigluWeights(NamedTuple):
    """The first half of one drafter layer's feed-forward weights: norm `[H]` (the post-attention RMS norm), gate
    and up `[H, I]`."""

    norm: jax.Array
    gate: jax.Array
    up: jax.Array


def swiglu_hidden(
    x: jax.Array, gate: jax.Array, up: jax.Array, matmul: Callable[..., jax.Array] = jnp.dot
) -> jax.Array:
    """silu(x @ gate) * (x @ up) for x `[..., H]`, gate and up `[H, I]` -> `[..., I]` in x.dtype: the products
    accumulated in f32 by `matmul(a, b, preferred_element_type=)` (default `jnp.dot`), the SwiGLU rounded to x.dtype
    (the input of a feed-forward block's down product; also the models' `layers.swiglu`)."""
    g = matmul(x, gate, preferred_element_type=jnp.float32)
    u = matmul(x, up, preferred_element_type=jnp.float32)
    return (jax.nn.silu(g) * u).astype(x.dtype)


def drafter_swiglu_reference(x: jax.Array, w: DrafterSwigluWeights, eps: float) -> jax.Array:
    """`swiglu_hidden` of rms_norm(x, w.norm) for x `[..., H]` -> `[..., I]` in x.dtype."""
    return swiglu_hidden(rms_norm(x, w.norm, eps), w.gate, w.up)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """g * cast_back(x_f32 / sqrt(mean(x_f32^2) + eps)), over the last axis (also the models' norm:
    `ddtree_jax.models.layers` takes it from here)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x `[..., d]` by the tables cos, sin (f32, broadcasting against `[..., d/2]`): pairs
    (i, i + d/2), computed in f32, returned in x.dtype (also the models' `layers.rope_half`)."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x0, x1 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1).astype(x.dtype)


def drafter_projections(
    x: jax.Array, w: DrafterAttentionWeights, layer: int, eps: float
) -> tuple[jax.Array, jax.Array]:
    """The block's projections before their norms: x `[B, S, H]` -> (q `[B, S, nh*hd]`, kv `[2, B, S, kvh*hd]`),
    both of a = rms_norm(x, input_norm) in x.dtype (K and V by one product with kv_proj[layer])."""
    a = rms_norm(x, w.input_norm, eps)
    return jnp.dot(a, w.q_proj), jnp.einsum("bsh,thd->tbsd", a, w.kv_proj[layer])


def drafter_attention_reference(
    x: jax.Array,
    w: DrafterAttentionWeights,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_len: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    layer: int,
    eps: float,
    scale: float,
) -> jax.Array:
    """One drafter layer's attention block, from the layer input to the attention output (o_proj not applied).

    x: `[B, S, H]`, the block's residual stream; w: the layer's weights (`DrafterAttentionWeights`, kv_proj's layer
    `layer` read); ctx_k, ctx_v: every layer's context cache `[layers, B, L, kvh, hd]` (k normed and roped), layer
    `layer` read at slots `< ctx_len[b]` (ctx_len `[B]` int32); cos, sin: `[B, S, hd/2]` f32, the RoPE tables of the
    block's positions. Computes a = rms_norm(x); q = a Wq and (k, v) = a kv_proj[layer] in x.dtype; per-head
    rms_norm (q_norm, k_norm) and rotate-half RoPE of q and k; then `block_attention`. Returns `[B, S, nh, hd]` in
    x.dtype.
    """
    hd = w.q_norm.shape[0]
    q, kv = drafter_projections(x, w, layer, eps)
    heads = lambda t: t.reshape(*t.shape[:-1], -1, hd)  # noqa: E731
    cos, sin = cos[..., None, :], sin[..., None, :]  # over the heads
    q = rotate_half(rms_norm(heads(q), w.q_norm, eps), cos, sin)
    k = rotate_half(rms_norm(heads(kv[0]), w.k_norm, eps), cos, sin)
    return block_attention(q, ctx_k[layer], ctx_v[layer], ctx_len, k, heads(kv[1]), scale)
