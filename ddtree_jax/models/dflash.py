"""DFlash block-diffusion drafter in Flax NNX (dflash_ddtree.md §1).

Qwen3-style layers (GQA with q_norm/k_norm, rotate-half YaRN RoPE, SwiGLU) conditioned on target features:
features of `target_layer_ids` -> `fc` -> `hidden_norm` -> projected once per committed token into every layer's
context K/V (one fused GEMM for all layers: `kv_proj [layers, 2, H, kv_heads*head_dim]`). A block
`[anchor, mask x (B-1)]` is embedded with the target's embedding and attends bidirectionally to itself and to
the cached context; the target's lm_head turns its outputs 1..B-1 into draft logits. Weights are declared in
each module's `param_specs()` (params.py); `weight_table` collects them for a config.
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
from ddtree_jax.config import DFlashConfig
from ddtree_jax.models.kimi import DenseMLP, norm_spec
from ddtree_jax.models.layers import rms_norm, rope_cos_sin, rope_half, yarn_inv_freq
from ddtree_jax.models.params import ParamPath, WeightSpec, init_params, param_table
from pallas_kernels.dispatch import Kernels
from pallas_kernels.reference import DrafterAttentionWeights, DrafterSwigluWeights


class DrafterCache(NamedTuple):
    """Projected context K/V for every drafter layer: k, v `[layers, B, L, kv_heads, head_dim]` (k normed+roped)."""

    k: jax.Array
    v: jax.Array


class DFlashLayer(nnx.Module):
    def param_specs(self) -> dict[str, WeightSpec]:
        """Norms, the query and output projections (heads split over `heads`); the layer's K/V projection lives in
        the drafter's fused `kv_proj`, the FFN is a submodule."""
        c, dt = self.cfg, self.param_dtype
        h, q = c.hidden_size, c.num_attention_heads * c.head_dim
        return {
            "input_layernorm": norm_spec(h, dt, "input_layernorm.weight"),
            "post_attention_layernorm": norm_spec(h, dt, "post_attention_layernorm.weight"),
            "q_proj": WeightSpec((h, q), dt, (None, "heads"), "self_attn.q_proj.weight"),
            "o_proj": WeightSpec((q, h), dt, ("heads", None), "self_attn.o_proj.weight"),
            "q_norm": norm_spec(c.head_dim, dt, "self_attn.q_norm.weight"),
            "k_norm": norm_spec(c.head_dim, dt, "self_attn.k_norm.weight"),
        }

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.cfg, self.param_dtype = cfg, dtype
        init_params(self, rngs)
        self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)


class DFlashDrafter(nnx.Module):
    """The drafter. Embedding and lm_head are the target's and are passed in, never stored here."""

    def param_specs(self) -> dict[str, WeightSpec]:
        """fc `[K*H, H]`, the norms, and every layer's K/V projection fused: kv_proj `[layers, 2, H, kv_heads*hd]`
        (KV heads split over `heads`; in the checkpoint one k_proj / v_proj per layer, see dflash_checkpoint)."""
        c, dt = self.config, self.param_dtype
        h, kvd = c.hidden_size, c.num_key_value_heads * c.head_dim
        return {
            "fc": WeightSpec((len(c.target_layer_ids) * h, h), dt, (None, None), "fc.weight"),
            "hidden_norm": norm_spec(h, dt, "hidden_norm.weight"),
            "kv_proj": WeightSpec((c.num_hidden_layers, 2, h, kvd), dt, (None, None, None, "heads")),
            "norm": norm_spec(h, dt, "norm.weight"),
        }

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.config = cfg
        self.param_dtype = dtype
        init_params(self, rngs)
        self.layers = nnx.List([DFlashLayer(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_hidden_layers)])

    @property
    def dtype(self):
        return self.fc[...].dtype

    def init_cache(self, batch: int, max_len: int) -> DrafterCache:
        c = self.config
        shape = (c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.head_dim)
        zeros = sharding.constrain(jnp.zeros(shape, self.dtype), sharding.DRAFTER_CACHE_AXES)
        return DrafterCache(zeros, zeros)

    def _inv_freq(self):
        c = self.config
        return yarn_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return rope_half(x, positions, self._inv_freq(), self.config.yarn_attention_factor)

    def _split_heads(self, x: jax.Array, heads: int) -> jax.Array:
        return x.reshape(*x.shape[:-1], heads, self.config.head_dim)

    def context_kv(self, features: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Target features `[B, C, K*H]` at `positions [B, C]` -> (k, v) `[layers, B, C, kv_heads, head_dim]`."""
        c = self.config
        hc = rms_norm(jnp.dot(features, self.fc[...]), self.hidden_norm[...], c.rms_norm_eps)
        kv = jnp.einsum("bch,lthd->ltbcd", hc, self.kv_proj[...], preferred_element_type=jnp.float32)
        kv = self._split_heads(kv.astype(hc.dtype), c.num_key_value_heads)  # [layers, 2, B, C, kvh, hd]
        k_norm = jnp.stack([layer.k_norm[...] for layer in self.layers])[:, None, None, None, :]
        k = self._rope(rms_norm(kv[:, 0], k_norm, c.rms_norm_eps), positions[None])
        return k, kv[:, 1]

    def append_context(
        self, cache: DrafterCache, features: jax.Array, positions: jax.Array, cache_len: jax.Array
    ) -> DrafterCache:
        """Project `features [B, C, K*H]` and write them at slots `cache_len[b] + j` (rows past a row's valid count
        land beyond its length and are overwritten later)."""
        k, v = self.context_kv(features, positions)
        b, n = features.shape[:2]
        rows = jnp.arange(b)[:, None]
        slots = cache_len[:, None] + jnp.arange(n)[None, :]
        return DrafterCache(
            cache.k.at[:, rows, slots].set(k.astype(cache.k.dtype), mode="drop"),
            cache.v.at[:, rows, slots].set(v.astype(cache.v.dtype), mode="drop"),
        )

    def __call__(
        self,
        block_embeds: jax.Array,
        positions: jax.Array,
        cache: DrafterCache,
        cache_len: jax.Array,
        kernels: Kernels | None = None,
    ) -> jax.Array:
        """block_embeds `[B, S, H]` (target embedding of [anchor, mask...]) at `positions [B, S]`, attending to the
        context slots `< cache_len[b]` and to the whole block -> final-normed hidden `[B, S, H]`. Each layer's
        attention block, from its input norm to the attention output, is one `sharding.drafter_attention` (one
        kernel launch on a GPU; the RoPE tables of the block's positions are computed once for all layers), then
        o_proj and the residual add (`sharding.drafter_residual`), then the FFN: its norm, gate and up and SwiGLU
        (`sharding.drafter_swiglu`), and down and the residual add (`drafter_residual`). On a GPU without a mesh each
        of those three is one launch for a small drafter (`drafter_swiglu.unsupported`,
        `dispatch.RESIDUAL_MAX_BYTES`), XLA's products for a large one. kernels: the kernel selection (None:
        `Kernels.from_env()`; the engine passes its `GenSpec.kernels`)."""
        kernels = Kernels.or_env(kernels)
        c = self.config
        x = block_embeds * c.input_embedding_scale
        b, s, _ = x.shape
        cos, sin = rope_cos_sin(positions, self._inv_freq(), c.yarn_attention_factor)  # [B, S, hd/2]
        for i, layer in enumerate(self.layers):
            weights = DrafterAttentionWeights(
                layer.input_layernorm[...], layer.q_proj[...], layer.q_norm[...], layer.k_norm[...], self.kv_proj[...]
            )
            kw = {"layer": i, "eps": c.rms_norm_eps, "scale": c.head_dim**-0.5}
            o = sharding.drafter_attention(kernels, x, weights, cache.k, cache.v, cache_len, cos, sin, **kw)
            o = o.reshape(b, s, c.num_attention_heads * c.head_dim)
            x = sharding.drafter_residual(kernels, x, o, layer.o_proj[...])
            mlp = layer.mlp
            ffn_in = DrafterSwigluWeights(layer.post_attention_layernorm[...], mlp.gate_proj[...], mlp.up_proj[...])
            h = sharding.drafter_swiglu(kernels, x, ffn_in, c.rms_norm_eps)
            x = sharding.drafter_residual(kernels, x, h, mlp.down_proj[...])
        return rms_norm(x, self.norm[...], c.rms_norm_eps)


@functools.lru_cache(maxsize=16)
def weight_table(cfg: DFlashConfig, dtype=jnp.bfloat16) -> Mapping[ParamPath, WeightSpec]:
    """Every weight declaration of the drafter built from `cfg`, by param path (no array is allocated)."""
    model = nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    return types.MappingProxyType(param_table(model))
