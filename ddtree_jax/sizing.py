"""Parameter counts and byte sizes of a Kimi K2 target, from its config alone (kimi_k2.md §4, §5, §8).

Storage: routed experts INT4 (half a byte per weight) plus one bf16 scale per `group_size` inputs when the
config is quantized, bf16 otherwise; every other weight bf16; the router bias f32. The compressed-tensors
`weight_shape` tensors (8 bytes per expert projection) are metadata and not counted.
"""

from __future__ import annotations

from ddtree_jax.config import DFlashConfig, KimiConfig

BF16_BYTES, F32_BYTES = 2, 4
CACHE_ALIGN = 64  # cache slots come in whole 64-slot KV tiles: the MLA kernels then never pad (copy) the cache


def cache_slots(needed: int) -> int:
    """Allocated length of a KV / latent cache holding `needed` slots: rounded up to a multiple of CACHE_ALIGN.
    The Mosaic MLA kernel pads (copies) a cache whose length is not a multiple of 8, every call."""
    return -(-needed // CACHE_ALIGN) * CACHE_ALIGN


def attention_params(c: KimiConfig) -> int:
    """One MLA block: q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o (kimi_k2.md §3.1)."""
    heads = c.num_attention_heads
    return (
        c.hidden_size * c.q_lora_rank
        + c.q_lora_rank
        + c.q_lora_rank * heads * c.qk_head_dim
        + c.hidden_size * c.latent_dim
        + c.kv_lora_rank
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        + heads * c.v_head_dim * c.hidden_size
    )


def expert_params(c: KimiConfig) -> int:
    """One routed expert: gate, up [I, H] and down [H, I]."""
    return 3 * c.hidden_size * c.moe_intermediate_size


def expert_bytes(c: KimiConfig) -> int:
    """One routed expert as stored: INT4 weights + bf16 group scales (24.77 MB for K2), or bf16."""
    n = expert_params(c)
    if c.quant is None:
        return n * BF16_BYTES
    return n // 2 + n // c.quant.group_size * BF16_BYTES


def model_sizes(c: KimiConfig) -> dict[str, int]:
    """Sizes of the whole model and of one batch-1 decode step.

    total_params: every weight. active_params_per_token: all but the embedding table and the unrouted
    experts (lm_head included). weight_bytes: as stored. kv_cache_bytes_per_token: the bf16 latent cache
    (kv_lora_rank + rope dims per layer). decode_bytes_per_token: weights one decode step reads: attention,
    norms, dense FFNs, shared experts, routers (weight + bias), lm_head and num_experts_per_tok routed experts
    per MoE layer; the one embedding row it gathers (hidden_size bf16 values) is negligible and not counted.
    decode_fixed_bytes: the part of it that does not depend on routing (all but the routed experts).
    """
    h, n_moe = c.hidden_size, len(c.moe_layers)
    n_dense = c.num_hidden_layers - n_moe
    embed = lm_head = c.vocab_size * h
    norms = 2 * h * c.num_hidden_layers + h
    attn = attention_params(c) * c.num_hidden_layers
    dense_ffn = 3 * h * c.intermediate_size * n_dense
    shared = 3 * h * c.moe_intermediate_size * c.n_shared_experts * n_moe
    router_w, router_b = c.n_routed_experts * h * n_moe, c.n_routed_experts * n_moe
    routed_all = expert_params(c) * c.n_routed_experts * n_moe
    routed_active = expert_params(c) * c.num_experts_per_tok * n_moe
    bf16_params = norms + attn + dense_ffn + shared + router_w + lm_head
    fixed_bytes = bf16_params * BF16_BYTES + router_b * F32_BYTES
    return {
        "total_params": embed + bf16_params + router_b + routed_all,
        "active_params_per_token": bf16_params + router_b + routed_active,
        "weight_bytes": fixed_bytes + embed * BF16_BYTES + expert_bytes(c) * c.n_routed_experts * n_moe,
        "kv_cache_bytes_per_token": c.latent_dim * BF16_BYTES * c.num_hidden_layers,
        "decode_bytes_per_token": fixed_bytes + expert_bytes(c) * c.num_experts_per_tok * n_moe,
        "decode_fixed_bytes": fixed_bytes,
        "expert_bytes": expert_bytes(c),
    }


def tensor_split_params(c: KimiConfig) -> int:
    """Params that `sharding.py` splits over `tensor`: MLA head projections (q_b, kv_b, o) of every layer, the
    dense and shared-expert FFNs and the lm_head."""
    heads, h, n_moe = c.num_attention_heads, c.hidden_size, len(c.moe_layers)
    per_layer = heads * (
        c.q_lora_rank * c.qk_head_dim + c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim) + c.v_head_dim * h
    )
    return (
        per_layer * c.num_hidden_layers
        + 3 * h * c.intermediate_size * (c.num_hidden_layers - n_moe)
        + 3 * h * c.moe_intermediate_size * c.n_shared_experts * n_moe
        + c.vocab_size * h
    )


def drafter_params(d: DFlashConfig) -> int:
    """The DFlash drafter's own weights (fc, norms, layers); it uses the target's embedding and lm_head."""
    h, hd = d.hidden_size, d.head_dim
    q, kv = d.num_attention_heads * hd, d.num_key_value_heads * hd
    layer = 2 * h + 2 * q * h + 2 * kv * h + 2 * hd + 3 * d.intermediate_size * h
    return len(d.target_layer_ids) * h * h + 2 * h + layer * d.num_hidden_layers
