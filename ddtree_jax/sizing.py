"""Parameter counts and byte sizes of a Kimi K2 target and its DFlash drafter, from their weight declarations
(`models/params.py`) for a config alone; no array is allocated (kimi_k2.md §4, §5, §8).

Storage as declared with bf16 floats: routed experts INT4 (half a byte per weight) plus one bf16 scale per
`group_size` inputs when the config is quantized, bf16 otherwise; the router bias f32. The compressed-tensors
`weight_shape` tensors (8 bytes per expert projection) are metadata and not counted.
"""

from __future__ import annotations

import jax.numpy as jnp

from ddtree_jax.config import DFlashConfig, KimiConfig
from ddtree_jax.models import dflash, kimi
from ddtree_jax.models.params import WeightSpec
from ddtree_jax.sharding import LOGICAL_AXES

BF16_BYTES, F32_BYTES = 2, 4
CACHE_ALIGN = 64  # cache slots come in whole 64-slot KV tiles: the MLA kernels then never pad (copy) the cache


def cache_slots(needed: int) -> int:
    """Allocated length of a KV / latent cache holding `needed` slots: rounded up to a multiple of CACHE_ALIGN.
    The Mosaic MLA kernel pads (copies) a cache whose length is not a multiple of 8, every call."""
    return -(-needed // CACHE_ALIGN) * CACHE_ALIGN


EMBEDDING = ("embed_tokens",)  # a decode step reads one row of it per token


def _routed(spec: WeightSpec) -> bool:
    return spec.logical_axes[:1] == ("experts",)


def _per_expert(c: KimiConfig, total: int) -> int:
    """`total` over all routed experts of all MoE layers -> per expert."""
    return total // (c.n_routed_experts * len(c.moe_layers)) if c.moe_layers else 0


def expert_params(c: KimiConfig) -> int:
    """One routed expert's parameters: gate, up [I, H] and down [H, I]."""
    specs = kimi.weight_table(c, jnp.bfloat16).values()
    return _per_expert(c, sum(s.num_params for s in specs if _routed(s)))


def model_sizes(c: KimiConfig) -> dict[str, int]:
    """Sizes of the whole model and of one batch-1 decode step.

    total_params: every weight. active_params_per_token: all but the embedding table and the unrouted
    experts (lm_head included). weight_bytes: as stored. kv_cache_bytes_per_token: the bf16 latent cache
    (kv_lora_rank + rope dims per layer). decode_bytes_per_token: weights one decode step reads: attention,
    norms, dense FFNs, shared experts, routers (weight + bias), lm_head and num_experts_per_tok routed experts
    per MoE layer; the one embedding row it gathers (hidden_size bf16 values) is negligible and not counted.
    decode_fixed_bytes: the part of it that does not depend on routing (all but the routed experts).
    expert_bytes: one routed expert as stored (24.77 MB for K2: INT4 weights + bf16 group scales).
    """
    specs = kimi.weight_table(c, jnp.bfloat16)
    embed = specs[EMBEDDING]
    routed = [s for s in specs.values() if _routed(s)]
    fixed = [s for p, s in specs.items() if p != EMBEDDING and not _routed(s)]
    routed_params, routed_bytes = sum(s.num_params for s in routed), sum(s.nbytes for s in routed)
    fixed_params, fixed_bytes = sum(s.num_params for s in fixed), sum(s.nbytes for s in fixed)
    k, e = c.num_experts_per_tok, c.n_routed_experts
    return {
        "total_params": embed.num_params + fixed_params + routed_params,
        "active_params_per_token": fixed_params + routed_params * k // e,
        "weight_bytes": embed.nbytes + fixed_bytes + routed_bytes,
        "kv_cache_bytes_per_token": c.latent_dim * BF16_BYTES * c.num_hidden_layers,
        "decode_bytes_per_token": fixed_bytes + routed_bytes * k // e,
        "decode_fixed_bytes": fixed_bytes,
        "expert_bytes": _per_expert(c, routed_bytes),
    }


def tensor_split_params(c: KimiConfig) -> int:
    """Params that `sharding.py` splits over `tensor`, routed experts aside: those declared with a logical axis
    that `LOGICAL_AXES` maps onto `tensor` (MLA head projections, dense and shared-expert FFNs, the lm_head)."""
    return sum(
        s.num_params
        for s in kimi.weight_table(c, jnp.bfloat16).values()
        if not _routed(s) and any(a is not None and "tensor" in LOGICAL_AXES[a] for a in s.logical_axes)
    )


def drafter_params(d: DFlashConfig) -> int:
    """The DFlash drafter's own weights (fc, norms, layers); it uses the target's embedding and lm_head."""
    return sum(s.num_params for s in dflash.weight_table(d).values())
