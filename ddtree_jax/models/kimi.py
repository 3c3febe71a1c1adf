"""Kimi K2 / DeepSeek-V3 target model in Flax NNX: MLA (absorbed for decode/verify, naive for prefill), a dense
first layer, sigmoid `noaux_tc` MoE layers with a shared expert, untied lm_head.

One forward serves prefill, decode and DDTree verify: tokens `[B, N]` at explicit positions `[B, N]`, written into
the latent cache at slots `cache_len[b] + j`, attending to the prefix (slots < cache_len) and, inside the new block,
to what `block_mask[b, i, j]` allows (causal for prefill/decode, ancestors-or-self for a tree).

Parameters are stored `[in, out]` (the transpose of HF's `[out, in]`). Each module declares its weights once, in
`param_specs()` (shape, dtype, logical axes, HF name; see params.py); `weight_table` collects them for a config.

Every dense product of the target goes through `dispatch.matmul` / `dispatch.head_matmul` with the program's
`Kernels`: plain `jnp.dot` / `jnp.einsum`, or under `Kernels.exact` the row-invariant kernels (docs/exactness.md).
W_UV goes with the absorbed attention through `dispatch.mla_output`, whose exact kernel merges the attention's
segments inside the product; o_proj adds the residual stream through `dispatch.residual_matmul` (inside its exact
kernel).
The RMS norms whose output only products read (a layer's input norm before q_a and kv_a, q_a's norm before q_b,
the final norm before lm_head) go through `dispatch.normed_matmul` with their products, which under `Kernels.exact`
computes the norm inside each product's kernel (q_a and kv_a each norm the layer input themselves).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax import sharding
from ddtree_jax.config import KimiConfig
from ddtree_jax.models.layers import causal_mask, rope_interleaved, swiglu, yarn_inv_freq
from ddtree_jax.models.params import (
    COPY,
    JOIN,
    Full,
    Normal,
    ParamPath,
    UniformInt4,
    WeightSpec,
    init_params,
    param_table,
)
from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels
from pallas_kernels.reference import combine_in_rank_order

LatentCache = list[jax.Array]  # one `[B, L, latent_dim]` array per layer: [normed c_kv (512) | roped k_pe (64)]
Norm = tuple[jax.Array, float]  # an RMS norm: gain `[H]`, eps


def norm_spec(dim: int, dtype, hf_name: str) -> WeightSpec:
    """An RMSNorm gain `[dim]`, replicated, initialised to 1."""
    return WeightSpec((dim,), dtype, (None,), hf_name, COPY, init=Full(1.0))


def write_block(cache: jax.Array, new: jax.Array, cache_len: jax.Array) -> jax.Array:
    """Scatter `new [B, N, D]` into `cache [B, L, D]` at slots `cache_len[b] + j` (in place when donated)."""
    b, n, _ = new.shape
    slots = cache_len[:, None] + jnp.arange(n)[None, :]
    return cache.at[jnp.arange(b)[:, None], slots].set(new.astype(cache.dtype), mode="drop")


class MLA(nnx.Module):
    """Multi-head latent attention (kimi_k2.md §3)."""

    def param_specs(self) -> dict[str, WeightSpec]:
        """Heads are split over `heads`; the latent projections and their norms are replicated. HF's kv_b_proj
        `[heads * (nope + v), kv_lora]` is stored as w_uk `[heads, nope, kv_lora]` and w_uv `[heads, v, kv_lora]`."""
        c, dt = self.cfg, self.param_dtype
        h, nh = c.hidden_size, c.num_attention_heads
        return {
            "q_a_proj": WeightSpec((h, c.q_lora_rank), dt, (None, None), "q_a_proj.weight"),
            "q_a_layernorm": norm_spec(c.q_lora_rank, dt, "q_a_layernorm.weight"),
            "q_b_proj": WeightSpec((c.q_lora_rank, nh * c.qk_head_dim), dt, (None, "heads"), "q_b_proj.weight"),
            "kv_a_proj_with_mqa": WeightSpec((h, c.latent_dim), dt, (None, None), "kv_a_proj_with_mqa.weight"),
            "kv_a_layernorm": norm_spec(c.kv_lora_rank, dt, "kv_a_layernorm.weight"),
            "w_uk": WeightSpec(
                (nh, c.qk_nope_head_dim, c.kv_lora_rank), dt, ("heads", None, None), "kv_b_proj.weight", JOIN
            ),
            "w_uv": WeightSpec((nh, c.v_head_dim, c.kv_lora_rank), dt, ("heads", None, None), "kv_b_proj.weight", JOIN),
            "o_proj": WeightSpec((nh * c.v_head_dim, h), dt, ("heads", None), "o_proj.weight"),
        }

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.cfg = cfg
        self.param_dtype = dtype
        init_params(self, rngs)

    def _inv_freq(self):
        return yarn_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def queries(self, cq: jax.Array, positions: jax.Array, kernels: Kernels) -> tuple[jax.Array, jax.Array]:
        """cq `[B, N, q_lora]` (q_a's product) -> q `[B, N, Hq, P + R]` (q_nope: its first P columns), roped q_pe
        `[B, N, Hq, R]`."""
        c = self.cfg
        (q,) = dispatch.normed_matmul(kernels, cq, self.q_a_layernorm[...], c.latent_norm_eps, self.q_b_proj[...])
        q = q.reshape(*cq.shape[:2], c.num_attention_heads, c.qk_head_dim)
        q_pe = rope_interleaved(q[..., c.qk_nope_head_dim :], positions, self._inv_freq())
        return q, q_pe

    def latents(self, kv: jax.Array, positions: jax.Array, kernels: Kernels) -> jax.Array:
        """kv `[B, N, 576]` (kv_a's product) -> cache entries `[B, N, 576]` = [RMSNorm(c_kv) | RoPE(k_pe)]."""
        c = self.cfg
        c_kv = dispatch.rms_norm(kernels, kv, self.kv_a_layernorm[...], c.latent_norm_eps)  # kv's first C columns
        k_pe = rope_interleaved(kv[..., c.kv_lora_rank :], positions, self._inv_freq())
        return jnp.concatenate([c_kv, k_pe], axis=-1)

    def __call__(
        self,
        x: jax.Array,
        input_norm: Norm,
        positions: jax.Array,
        cache: jax.Array,
        cache_len: jax.Array,
        block_mask: jax.Array,
        kernels: Kernels,
        *,
        naive: bool = False,
        causal: bool = False,
    ) -> tuple[jax.Array, jax.Array]:
        """x `[B, N, H]` (the layer's residual stream), cache `[B, L, 576]` -> (x + the attention's output
        `[B, N, H]`, cache with the N new entries written). input_norm: the layer's input RMS norm, applied inside q_a's
        and kv_a's products.

        naive=True computes attention in the per-head (prefill) form over the new block only; it requires an
        empty prefix (cache_len == 0), which the caller guarantees. causal: block_mask is the causal mask (the
        exact kernel then reads the block's keys from the cache). `kernels` selects the attention kernel and the
        products' (`dispatch.matmul`).
        """
        c = self.cfg
        with jax.named_scope("prologue"):  # named scopes: experiments/layer_profile.py attributes kernels by them
            w_a = self.q_a_proj[...], self.kv_a_proj_with_mqa[...]
            cq, kv = dispatch.normed_matmul(kernels, x, *input_norm, *w_a)
            q, q_pe = self.queries(cq, positions, kernels)
            lat = self.latents(kv, positions, kernels)
        with jax.named_scope("cache_write"):
            cache = write_block(cache, lat, cache_len)
        if naive:
            with jax.named_scope("attention"):
                o = self._naive_attention(q[..., : c.qk_nope_head_dim], q_pe, lat, block_mask)
        else:
            with jax.named_scope("prologue"):
                ql = dispatch.head_matmul(kernels, q, self.w_uk[...])  # q's first P columns: [B, N, Hq, C]
                q_abs = jnp.concatenate([ql, q_pe], axis=-1)
            with jax.named_scope("attention"):  # the attention and its W_UV product: [B, N, Hq, V] in x's dtype
                args = (q_abs, cache, cache_len, block_mask, self.w_uv[...], c.softmax_scale, c.kv_lora_rank, causal)
                o = sharding.mla_output(kernels, *args, out_dtype=x.dtype)
        with jax.named_scope("o_proj"):  # x + o @ W_o: the residual stream's update
            return dispatch.residual_matmul(kernels, x, o.reshape(*x.shape[:2], -1), self.o_proj[...]), cache

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

    def param_specs(self) -> dict[str, WeightSpec]:
        """gate/up `[H, I]`, down `[I, H]`; the inner dim split over `ffn`."""
        h, i, dt = self.hidden, self.inner, self.param_dtype
        return {
            "gate_proj": WeightSpec((h, i), dt, (None, "ffn"), "gate_proj.weight"),
            "up_proj": WeightSpec((h, i), dt, (None, "ffn"), "up_proj.weight"),
            "down_proj": WeightSpec((i, h), dt, ("ffn", None), "down_proj.weight"),
        }

    def __init__(self, hidden: int, inner: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.hidden, self.inner, self.param_dtype = hidden, inner, dtype
        init_params(self, rngs)

    def __call__(self, x: jax.Array, kernels: Kernels) -> jax.Array:
        """x `[..., H]` -> `[..., H]`, the products through `dispatch.matmul` under the target's selection `kernels`
        (the drafter's FFN runs `dispatch.drafter_swiglu` and `drafter_residual` instead)."""
        matmul = functools.partial(dispatch.matmul, kernels)
        with jax.named_scope("ffn"):
            return swiglu(x, self.gate_proj[...], self.up_proj[...], self.down_proj[...], matmul)


class Int4Experts(nnx.Module):
    """Routed experts as INT4 with one bf16 scale per `group` inputs, in the MoE kernel's layout: weights
    checkpoint-native `[E, N, K]` (gate_up_q `[E, 2I, H]`, down_q `[E, H, I]`), scales group-major `[E, K/G, N]`
    (gate_up_s `[E, H/G, 2I]`, down_s `[E, I/G, H]`) so one group's scales for a block of rows are contiguous."""

    def param_specs(self) -> dict[str, WeightSpec]:
        """Experts split over `experts`. No single HF name: the checkpoint holds one packed INT4 linear per expert
        and projection (`checkpoint.expert_names`), which the loader stacks."""
        n, h, i, g = self.n, self.hidden, self.inner, self.group
        experts = ("experts", None, None)
        scale = Full(0.02 / 4.3)  # |q| ~ 4.3 on average: initial weights of std ~ 0.02
        return {
            "gate_up_q": WeightSpec((n, 2 * i, h), jnp.int4, experts, init=UniformInt4()),
            "gate_up_s": WeightSpec((n, h // g, 2 * i), jnp.bfloat16, experts, init=scale, scale_of="gate_up_q"),
            "down_q": WeightSpec((n, h, i), jnp.int4, experts, init=UniformInt4()),
            "down_s": WeightSpec((n, i // g, h), jnp.bfloat16, experts, init=scale, scale_of="down_q"),
        }

    def __init__(self, n: int, hidden: int, inner: int, group: int, *, rngs: nnx.Rngs):
        self.n, self.hidden, self.inner, self.group = n, hidden, inner, group
        init_params(self, rngs)

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

    def param_specs(self) -> dict[str, WeightSpec]:
        """Experts split over `experts`; the checkpoint holds one linear per expert and projection, stacked by the
        loader."""
        n, h, i, dt = self.n, self.hidden, self.inner, self.param_dtype
        return {
            "gate_up": WeightSpec((n, h, 2 * i), dt, ("experts", None, None)),
            "down": WeightSpec((n, i, h), dt, ("experts", None, None)),
        }

    def __init__(self, n: int, hidden: int, inner: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.n, self.hidden, self.inner, self.param_dtype = n, hidden, inner, dtype
        init_params(self, rngs)

    def __call__(self, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, kernels: Kernels) -> jax.Array:
        """As `Int4Experts`; plain JAX, or under `kernels.exact` every expert's products through
        `dispatch.head_matmul` (experts as heads) and a token's k outputs summed in rank order."""
        n = self.gate_up.shape[0]

        def gated(gu: jax.Array) -> jax.Array:  # [..., 2I] f32 -> silu(gate) * up `[..., I]` in x.dtype
            gate, up = jnp.split(gu, 2, axis=-1)
            return (jax.nn.silu(gate) * up).astype(x.dtype)

        if kernels.exact:
            xe = jnp.broadcast_to(x[:, None, :], (x.shape[0], n, x.shape[1]))  # [T, E, H]
            gu = dispatch.head_matmul(kernels, xe, self.gate_up[...], preferred_element_type=jnp.float32)
            y = dispatch.head_matmul(kernels, gated(gu), self.down[...], preferred_element_type=jnp.float32)
            y_pairs = jnp.take_along_axis(y, topk_ids[:, :, None], axis=1)  # [T, k, H]
            return combine_in_rank_order(y_pairs, topk_weights).astype(x.dtype)
        combine = jnp.zeros((x.shape[0], n), jnp.float32)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], topk_ids].add(topk_weights.astype(jnp.float32))
        gu = jnp.einsum("th,ehn->etn", x, self.gate_up[...], preferred_element_type=jnp.float32)
        y = jnp.einsum("eti,eih->eth", gated(gu), self.down[...], preferred_element_type=jnp.float32)
        return jnp.einsum("eth,te->th", y, combine).astype(x.dtype)


class MoE(nnx.Module):
    """Sigmoid `noaux_tc` routing + routed experts + shared expert (kimi_k2.md §4)."""

    def param_specs(self) -> dict[str, WeightSpec]:
        """The router `[H, E]` and its f32 correction bias `[E]`, replicated (experts and shared expert are
        submodules)."""
        e = self.cfg.n_routed_experts
        return {
            "gate": WeightSpec((self.cfg.hidden_size, e), self.param_dtype, (None, None), "gate.weight"),
            "e_score_correction_bias": WeightSpec(
                (e,), jnp.float32, (None,), "gate.e_score_correction_bias", COPY, init=Full(0.0)
            ),
        }

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, quantized: bool = True):
        self.cfg = cfg
        self.record_load = False  # training sets this to sow per-expert token counts ("expert_load", [E])
        self.param_dtype = dtype
        h, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        init_params(self, rngs)
        if quantized:
            group = cfg.quant.group_size if cfg.quant else 32
            self.experts = Int4Experts(e, h, i, group, rngs=rngs)
        else:
            self.experts = DenseExperts(e, h, i, rngs=rngs, dtype=dtype)
        self.shared_experts = (
            DenseMLP(h, i * cfg.n_shared_experts, rngs=rngs, dtype=dtype) if cfg.n_shared_experts else None
        )

    def route(self, x: jax.Array, kernels: Kernels | None = None) -> tuple[jax.Array, jax.Array]:
        """x `[T, H]` -> (topk_ids `[T, k]` int32, topk_weights `[T, k]` f32); kernels: the selection of the router's
        f32 product (None: `Kernels.from_env()`)."""
        c = self.cfg
        kernels = Kernels.or_env(kernels)
        logits = dispatch.matmul(kernels, x.astype(jnp.float32), self.gate[...].astype(jnp.float32))
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
        with jax.named_scope("router"):
            ids, w = self.route(xt, kernels)
        if self.record_load:
            self.sow(
                nnx.Intermediate,
                "expert_load",
                jnp.sum(jax.nn.one_hot(ids, self.cfg.n_routed_experts), (0, 1)),
            )
        with jax.named_scope("experts"):
            y = self.experts(xt, ids, w, kernels)
        if self.shared_experts is not None:
            with jax.named_scope("shared_expert"):
                y = y + self.shared_experts(xt, kernels)
        return y.reshape(shape)


class DecoderLayer(nnx.Module):
    def param_specs(self) -> dict[str, WeightSpec]:
        """The two pre-norm gains `[H]` (attention and FFN are submodules)."""
        return {
            "input_layernorm": norm_spec(self.hidden, self.param_dtype, "input_layernorm.weight"),
            "post_attention_layernorm": norm_spec(self.hidden, self.param_dtype, "post_attention_layernorm.weight"),
        }

    def __init__(self, cfg: KimiConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, quantized: bool = True):
        self.eps = cfg.rms_norm_eps
        self.hidden, self.param_dtype = cfg.hidden_size, dtype
        init_params(self, rngs)
        self.self_attn = MLA(cfg, rngs=rngs, dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, quantized=quantized)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    def __call__(
        self, h, positions, cache, cache_len, block_mask, kernels: Kernels | None = None, *, naive=False, causal=False
    ):
        """One layer; kernels None: `Kernels.from_env()`; causal: block_mask is the causal mask."""
        kernels = Kernels.or_env(kernels)
        h, cache = self.self_attn(
            h,
            (self.input_layernorm[...], self.eps),
            positions,
            cache,
            cache_len,
            block_mask,
            kernels,
            naive=naive,
            causal=causal,
        )
        x = dispatch.rms_norm(kernels, h, self.post_attention_layernorm[...], self.eps)
        h = h + self.mlp(x, kernels)
        return h, cache


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, N, H] the last layer's residual stream, before the final norm (feed to `logits`)
    features: jax.Array | None  # [B, N, K*H] residual outputs of the requested layers, concatenated
    cache: LatentCache


class KimiForCausalLM(nnx.Module):
    """The target model. `quantized` (default: the config has a quant section) selects INT4 routed experts."""

    def param_specs(self) -> dict[str, WeightSpec]:
        """Embedding `[V, H]` (replicated), final norm, lm_head `[H, V]` (split over `vocab`; in the checkpoint
        beside the model body, not in it)."""
        c, dt = self.config, self.param_dtype
        return {
            "embed_tokens": WeightSpec(
                (c.vocab_size, c.hidden_size), dt, (None, None), "embed_tokens.weight", COPY, init=Normal(1.0)
            ),
            "norm": norm_spec(c.hidden_size, dt, "norm.weight"),
            "lm_head": WeightSpec((c.hidden_size, c.vocab_size), dt, (None, "vocab"), "lm_head.weight", hf_root=True),
        }

    def __init__(self, cfg: KimiConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16, quantized: bool | None = None):
        self.config = cfg
        self.param_dtype = dtype
        quantized = cfg.quant is not None if quantized is None else quantized
        init_params(self, rngs, ("embed_tokens",))  # drawn before the layers' weights, the rest after
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, quantized=quantized) for i in range(cfg.num_hidden_layers)]
        )
        init_params(self, rngs, tuple(n for n in self.param_specs() if n != "embed_tokens"))

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

    def logits(self, hidden: jax.Array, kernels: Kernels | None = None) -> jax.Array:
        """`ForwardOut.hidden` `[..., H]` -> f32 logits `[..., V]`: the final norm, then lm_head; kernels: the
        selection of both (`dispatch.normed_matmul`; None: `Kernels.from_env()`)."""
        kernels = Kernels.or_env(kernels)
        with jax.named_scope("lm_head"):
            norm = self.norm[...], self.config.rms_norm_eps
            f32 = jnp.float32
            (logits,) = dispatch.normed_matmul(kernels, hidden, *norm, self.lm_head[...], preferred_element_type=f32)
            return logits

    def head_logits(self, normed: jax.Array, kernels: Kernels | None = None) -> jax.Array:
        """Already-normed hidden states `[..., H]` (the drafter's output) -> f32 logits `[..., V]` by lm_head alone;
        kernels: the selection of the product (None: `Kernels.from_env()`)."""
        kernels = Kernels.or_env(kernels)
        with jax.named_scope("lm_head"):
            return dispatch.matmul(kernels, normed, self.lm_head[...], preferred_element_type=jnp.float32)

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
        kernels = Kernels.or_env(kernels)
        b, n = tokens.shape
        # A causal block of several tokens (a prefill chunk) may read its keys from the cache; a one-token step runs
        # as a tree of one node, through the kernel a verify runs (under `exact`: the same code for both).
        causal = block_mask is None and n > 1
        if block_mask is None:
            block_mask = causal_mask(b, n)
        h = self.embed(tokens)
        by_layer, new_cache = {}, []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                h, c = layer(h, positions, cache[i], cache_len, block_mask, kernels, naive=naive, causal=causal)
            new_cache.append(c)
            if i in feature_layers:
                by_layer[i] = h
        features = jnp.concatenate([by_layer[i] for i in feature_layers], axis=-1) if feature_layers else None
        return ForwardOut(h, features, new_cache)


@functools.lru_cache(maxsize=16)
def weight_table(cfg: KimiConfig, dtype=jnp.bfloat16, quantized: bool | None = None) -> Mapping[ParamPath, WeightSpec]:
    """Every weight declaration of the target built from `cfg`, by param path (no array is allocated)."""
    model = nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, quantized=quantized))
    return types.MappingProxyType(param_table(model))
