"""Kimi K2 / DeepSeek-V3 target model in Flax NNX: MLA (absorbed for decode/verify, naive for prefill), a dense
first layer, sigmoid `noaux_tc` MoE layers with a shared expert, untied lm_head.

One forward serves prefill, decode and DDTree verify: tokens `[B, N]` at explicit positions `[B, N]`, written into
the latent cache at slots `cache_len[b] + j`, attending to the prefix (slots < cache_len) and, inside the new block,
to what `block_mask[b, i, j]` allows (causal for prefill/decode, ancestors-or-self for a tree).

Parameters are stored `[in, out]` (the transpose of HF's `[out, in]`); the checkpoint table lives in checkpoint.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax import sharding
from ddtree_jax.config import KimiConfig
from ddtree_jax.models.layers import causal_mask, rms_norm, rope_interleaved, swiglu, yarn_inv_freq
from pallas_kernels.dispatch import Kernels

LatentCache = list[jax.Array]  # one `[B, L, latent_dim]` array per layer: [normed c_kv (512) | roped k_pe (64)]


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


def _ones(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


def write_block(cache: jax.Array, new: jax.Array, cache_len: jax.Array) -> jax.Array:
    """Scatter `new [B, N, D]` into `cache [B, L, D]` at slots `cache_len[b] + j` (in place when donated)."""
    b, n, _ = new.shape
    slots = cache_len[:, None] + jnp.arange(n)[None, :]
    return cache.at[jnp.arange(b)[:, None], slots].set(new.astype(cache.dtype), mode="drop")


class MLA(nnx.Module):
    """Multi-head latent attention (kimi_k2.md §3)."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = _normal(rngs, (h, cfg.q_lora_rank), dtype)
        self.q_a_layernorm = _ones((cfg.q_lora_rank,), dtype)
        self.q_b_proj = _normal(rngs, (cfg.q_lora_rank, nh * cfg.qk_head_dim), dtype)
        self.kv_a_proj_with_mqa = _normal(rngs, (h, cfg.latent_dim), dtype)
        self.kv_a_layernorm = _ones((cfg.kv_lora_rank,), dtype)
        self.w_uk = _normal(rngs, (nh, cfg.qk_nope_head_dim, cfg.kv_lora_rank), dtype)
        self.w_uv = _normal(rngs, (nh, cfg.v_head_dim, cfg.kv_lora_rank), dtype)
        self.o_proj = _normal(rngs, (nh * cfg.v_head_dim, h), dtype)

    def _inv_freq(self):
        return yarn_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def queries(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x `[B, N, H]` -> q_nope `[B, N, Hq, P]`, roped q_pe `[B, N, Hq, R]`."""
        c = self.cfg
        cq = rms_norm(jnp.dot(x, self.q_a_proj[...]), self.q_a_layernorm[...], c.latent_norm_eps)
        q = jnp.dot(cq, self.q_b_proj[...]).reshape(*x.shape[:2], c.num_attention_heads, c.qk_head_dim)
        q_pe = rope_interleaved(q[..., c.qk_nope_head_dim :], positions, self._inv_freq())
        return q[..., : c.qk_nope_head_dim], q_pe

    def latents(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x `[B, N, H]` -> cache entries `[B, N, 576]` = [RMSNorm(c_kv) | RoPE(k_pe)]."""
        c = self.cfg
        kv = jnp.dot(x, self.kv_a_proj_with_mqa[...])
        c_kv = rms_norm(kv[..., : c.kv_lora_rank], self.kv_a_layernorm[...], c.latent_norm_eps)
        k_pe = rope_interleaved(kv[..., c.kv_lora_rank :], positions, self._inv_freq())
        return jnp.concatenate([c_kv, k_pe], axis=-1)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: jax.Array,
        cache_len: jax.Array,
        block_mask: jax.Array,
        kernels: Kernels,
        *,
        naive: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        """x `[B, N, H]`, cache `[B, L, 576]` -> (y `[B, N, H]`, cache with the N new entries written).

        naive=True computes attention in the per-head (prefill) form over the new block only; it requires an
        empty prefix (cache_len == 0), which the caller guarantees. `kernels` selects the attention kernel.
        """
        c = self.cfg
        q_nope, q_pe = self.queries(x, positions)
        lat = self.latents(x, positions)
        cache = write_block(cache, lat, cache_len)
        if naive:
            o = self._naive_attention(q_nope, q_pe, lat, block_mask)
        else:
            ql = jnp.einsum("bnhp,hpc->bnhc", q_nope, self.w_uk[...])
            q_abs = jnp.concatenate([ql, q_pe], axis=-1)
            o_lat = sharding.mla_attention(
                kernels, q_abs, cache, cache_len, block_mask, c.softmax_scale, c.kv_lora_rank
            )
            o = jnp.einsum("bnhc,hvc->bnhv", o_lat, self.w_uv[...], preferred_element_type=jnp.float32)
        o = o.astype(x.dtype).reshape(*x.shape[:2], -1)
        return jnp.dot(o, self.o_proj[...], preferred_element_type=jnp.float32).astype(x.dtype), cache

    def _naive_attention(self, q_nope, q_pe, lat, block_mask) -> jax.Array:
        """Per-head MLA over the block itself (kimi_k2.md §3.2) -> `[B, N, Hq, V]` f32."""
        c = self.cfg
        c_kv, k_pe = lat[..., : c.kv_lora_rank], lat[..., c.kv_lora_rank :]
        k_nope = jnp.einsum("bmc,hpc->bmhp", c_kv, self.w_uk[...])
        v = jnp.einsum("bmc,hvc->bmhv", c_kv, self.w_uv[...])
        s = jnp.einsum("bnhp,bmhp->bhnm", q_nope, k_nope, preferred_element_type=jnp.float32)
        s += jnp.einsum("bnhr,bmr->bhnm", q_pe, k_pe, preferred_element_type=jnp.float32)
        s = jnp.where(block_mask[:, None], s * c.softmax_scale, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhnm,bmhv->bnhv", p, v, preferred_element_type=jnp.float32)


class DenseMLP(nnx.Module):
    """SwiGLU feed-forward (dense layer 0 and the shared expert)."""

    def __init__(self, hidden: int, inner: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.gate_proj = _normal(rngs, (hidden, inner), dtype)
        self.up_proj = _normal(rngs, (hidden, inner), dtype)
        self.down_proj = _normal(rngs, (inner, hidden), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return swiglu(x, self.gate_proj[...], self.up_proj[...], self.down_proj[...])


class Int4Experts(nnx.Module):
    """Routed experts as INT4 with one bf16 scale per `group` inputs, in the MoE kernel's layout: weights
    checkpoint-native `[E, N, K]` (gate_up_q `[E, 2I, H]`, down_q `[E, H, I]`), scales group-major `[E, K/G, N]`
    (gate_up_s `[E, H/G, 2I]`, down_s `[E, I/G, H]`) so one group's scales for a block of rows are contiguous."""

    def __init__(self, n: int, hidden: int, inner: int, group: int, *, rngs: nnx.Rngs):
        def q(shape):
            return nnx.Param(jax.random.randint(rngs.params(), shape, -7, 8, jnp.int32).astype(jnp.int4))

        def s(shape, fan_in):
            return nnx.Param(jnp.full(shape, 0.02 / 4.3 if fan_in else 0.0, jnp.bfloat16))

        self.gate_up_q = q((n, 2 * inner, hidden))
        self.gate_up_s = s((n, hidden // group, 2 * inner), hidden)
        self.down_q = q((n, hidden, inner))
        self.down_s = s((n, inner // group, hidden), inner)

    def __call__(self, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, kernels: Kernels) -> jax.Array:
        return sharding.moe_swiglu(  # expert-parallel under an active mesh, else dispatch.moe_swiglu
            kernels,
            x,
            topk_ids,
            topk_weights,
            self.gate_up_q[...],
            self.gate_up_s[...],
            self.down_q[...],
            self.down_s[...],
        )


class DenseExperts(nnx.Module):
    """Routed experts in floating point (training, unquantized checkpoints): gate_up `[E, H, 2I]`, down `[E, I, H]`.

    Computes every expert on every token and combines with the (sparse) routing weights: simple and
    differentiable, meant for small models.
    """

    def __init__(self, n: int, hidden: int, inner: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.gate_up = _normal(rngs, (n, hidden, 2 * inner), dtype)
        self.down = _normal(rngs, (n, inner, hidden), dtype)

    def __call__(self, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, kernels: Kernels) -> jax.Array:
        """As `Int4Experts`; plain JAX whatever `kernels` selects."""
        n, _, two_i = self.gate_up.shape
        combine = jnp.zeros((x.shape[0], n), jnp.float32)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], topk_ids].add(topk_weights.astype(jnp.float32))
        gu = jnp.einsum("th,ehn->etn", x, self.gate_up[...], preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gu[..., : two_i // 2]) * gu[..., two_i // 2 :]).astype(x.dtype)
        y = jnp.einsum("eti,eih->eth", h, self.down[...], preferred_element_type=jnp.float32)
        return jnp.einsum("eth,te->th", y, combine).astype(x.dtype)


class MoE(nnx.Module):
    """Sigmoid `noaux_tc` routing + routed experts + shared expert (kimi_k2.md §4)."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, quantized: bool = True):
        self.cfg = cfg
        self.record_load = False  # training sets this to sow per-expert token counts ("expert_load", [E])
        h, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.gate = _normal(rngs, (h, e), dtype)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        if quantized:
            group = cfg.quant.group_size if cfg.quant else 32
            self.experts = Int4Experts(e, h, i, group, rngs=rngs)
        else:
            self.experts = DenseExperts(e, h, i, rngs=rngs, dtype=dtype)
        self.shared_experts = (
            DenseMLP(h, i * cfg.n_shared_experts, rngs=rngs, dtype=dtype) if cfg.n_shared_experts else None
        )

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x `[T, H]` -> (topk_ids `[T, k]` int32, topk_weights `[T, k]` f32)."""
        c = self.cfg
        logits = jnp.dot(x.astype(jnp.float32), self.gate[...].astype(jnp.float32))
        scores = jax.nn.sigmoid(logits)
        select = scores + self.e_score_correction_bias[...]
        if c.n_group > 1:
            grouped = select.reshape(x.shape[0], c.n_group, -1)
            group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
            _, keep = jax.lax.top_k(group_score, c.topk_group)
            gmask = jnp.zeros_like(group_score, bool).at[jnp.arange(x.shape[0])[:, None], keep].set(True)
            select = jnp.where(gmask[..., None], grouped, -jnp.inf).reshape(select.shape)
        _, ids = jax.lax.top_k(select, c.num_experts_per_tok)
        w = jnp.take_along_axis(scores, ids, axis=-1)
        if c.norm_topk_prob:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return ids.astype(jnp.int32), w * c.routed_scaling_factor

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        shape = x.shape
        xt = x.reshape(-1, shape[-1])
        ids, w = self.route(xt)
        if self.record_load:
            self.sow(
                nnx.Intermediate,
                "expert_load",
                jnp.sum(jax.nn.one_hot(ids, self.cfg.n_routed_experts), (0, 1)),
            )
        y = self.experts(xt, ids, w, kernels)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xt)
        return y.reshape(shape)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: KimiConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, quantized: bool = True):
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _ones((cfg.hidden_size,), dtype)
        self.post_attention_layernorm = _ones((cfg.hidden_size,), dtype)
        self.self_attn = MLA(cfg, rngs=rngs, dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, quantized=quantized)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    def __call__(self, h, positions, cache, cache_len, block_mask, kernels: Kernels | None = None, *, naive=False):
        """One layer; kernels None: `Kernels.from_env()`."""
        kernels = Kernels.from_env() if kernels is None else kernels
        a, cache = self.self_attn(
            rms_norm(h, self.input_layernorm[...], self.eps),
            positions,
            cache,
            cache_len,
            block_mask,
            kernels,
            naive=naive,
        )
        h = h + a
        x = rms_norm(h, self.post_attention_layernorm[...], self.eps)
        h = h + (self.mlp(x, kernels) if isinstance(self.mlp, MoE) else self.mlp(x))
        return h, cache


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, N, H] final-normed hidden states (feed to `logits`)
    features: jax.Array | None  # [B, N, K*H] residual outputs of the requested layers, concatenated
    cache: LatentCache


class KimiForCausalLM(nnx.Module):
    """The target model. `quantized` (default: the config has a quant section) selects INT4 routed experts."""

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, quantized: bool | None = None):
        self.config = cfg
        quantized = cfg.quant is not None if quantized is None else quantized
        self.embed_tokens = _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, std=1.0)
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, quantized=quantized) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = _ones((cfg.hidden_size,), dtype)
        self.lm_head = _normal(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    @property
    def dtype(self):
        return self.embed_tokens[...].dtype

    def init_cache(self, batch: int, max_len: int) -> LatentCache:
        """Empty latent cache: one `[batch, max_len, 576]` array per layer (batch split on `data` under a mesh)."""
        shape = (batch, max_len, self.config.latent_dim)
        return [
            sharding.constrain(jnp.zeros(shape, self.dtype), sharding.LATENT_CACHE_AXES)
            for _ in range(self.config.num_hidden_layers)
        ]

    def embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden `[..., H]` -> f32 logits `[..., V]`."""
        return jnp.dot(hidden, self.lm_head[...], preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: LatentCache,
        cache_len: jax.Array,
        block_mask: jax.Array | None = None,
        *,
        feature_layers: tuple[int, ...] = (),
        naive: bool = False,
        kernels: Kernels | None = None,
    ) -> ForwardOut:
        """tokens/positions `[B, N]`, cache_len `[B]` (slot of the first new token), block_mask `[B, N, N]` bool
        (None: causal). naive=True: per-head prefill attention, only valid when cache_len == 0. kernels: the
        kernel selection (None: `Kernels.from_env()`; the engine passes its `GenSpec.kernels`)."""
        kernels = Kernels.from_env() if kernels is None else kernels
        b, n = tokens.shape
        if block_mask is None:
            block_mask = causal_mask(b, n)
        h = self.embed(tokens)
        by_layer, new_cache = {}, []
        for i, layer in enumerate(self.layers):
            h, c = layer(h, positions, cache[i], cache_len, block_mask, kernels, naive=naive)
            new_cache.append(c)
            if i in feature_layers:
                by_layer[i] = h
        features = jnp.concatenate([by_layer[i] for i in feature_layers], axis=-1) if feature_layers else None
        return ForwardOut(rms_norm(h, self.norm[...], self.config.rms_norm_eps), features, new_cache)
