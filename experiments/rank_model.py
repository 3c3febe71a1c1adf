"""One rank's share of an R-GPU Kimi K2.6 deployment as configs, and random-weight models of it, drawn on device.
Flag-free (bench_rank and layer_profile import it; absl flags are defined once per process).

The rank (layout of ddtree_jax/sharding.py on `expert=R/t,tensor=t`): E/R routed INT4 experts per MoE layer,
MLA with heads/t, dense and shared-expert FFN inner dims /t, lm_head vocab/t, the drafter's heads, KV heads and FFN
/t. Random weights: INT4 uniform in [-8, 8), expert scales 0.02 / 4.3, norm gains 1, router bias 0, embedding
N(0, 1), other matrices N(0, 0.02^2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.config import DFlashConfig, KimiConfig, QuantConfig, load_dflash_config, load_kimi_config
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import DenseMLP, KimiForCausalLM, MoE


@dataclasses.dataclass(frozen=True)
class Rank:
    """The full configs and the rank's share of them."""

    full: KimiConfig
    drafter_full: DFlashConfig
    target: KimiConfig
    drafter: DFlashConfig
    shared_inner: int  # shared-expert FFN inner dim on the rank


def tiny_configs(target_config: str, drafter_config: str) -> tuple[KimiConfig, DFlashConfig]:
    """The configs in these directories, K2.6-shaped but tiny: 3 layers, 16 experts, vocab 256 (every split dim
    divides by 8)."""
    full, drafter = load_kimi_config(target_config), load_dflash_config(drafter_config)
    full = dataclasses.replace(
        full,
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=16,
        quant=QuantConfig(group_size=32),
    )
    drafter = dataclasses.replace(
        drafter,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=16,
        vocab_size=256,
        num_target_layers=3,
        target_layer_ids=(0, 2),
        mask_token_id=255,
    )
    return full, drafter


def rank_share(full: KimiConfig, drafter: DFlashConfig, ranks: int, tensor: int, local_topk: int) -> Rank:
    """One rank's configs of `ranks` GPUs with tensor parallelism `tensor`: experts / ranks (top-`local_topk` of
    them per token, one routing group), heads, dense FFN, vocab and the drafter's heads and FFN / tensor. ranks =
    tensor = 1 with local_topk = the config's top-k is the whole model on one GPU (for a config of one group)."""
    t = tensor
    target = dataclasses.replace(
        full,
        n_routed_experts=full.n_routed_experts // ranks,
        num_experts_per_tok=local_topk,
        n_group=1,
        topk_group=1,
        num_attention_heads=full.num_attention_heads // t,
        intermediate_size=full.intermediate_size // t,
        vocab_size=full.vocab_size // t,
    )
    rank_drafter = dataclasses.replace(
        drafter,
        num_attention_heads=drafter.num_attention_heads // t,
        num_key_value_heads=max(drafter.num_key_value_heads // t, 1),
        intermediate_size=drafter.intermediate_size // t,
        vocab_size=target.vocab_size,
        mask_token_id=target.vocab_size - 1,
    )
    return Rank(full, drafter, target, rank_drafter, full.moe_intermediate_size * full.n_shared_experts // t)


def build_models(rank: Rank, layers: int) -> tuple[KimiForCausalLM, DFlashDrafter]:
    """Abstract rank models (no memory), `layers` target layers, shared experts cut to the rank's share."""
    c = dataclasses.replace(rank.target, num_hidden_layers=layers)
    ids = tuple(min(i, layers - 1) for i in rank.drafter.target_layer_ids)
    d = dataclasses.replace(rank.drafter, num_target_layers=layers, target_layer_ids=ids)

    def make():
        target = KimiForCausalLM(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        for layer in target.layers:
            if isinstance(layer.mlp, MoE) and layer.mlp.shared_experts is not None:
                layer.mlp.shared_experts = DenseMLP(c.hidden_size, rank.shared_inner, rngs=nnx.Rngs(0))
        return target, DFlashDrafter(d, rngs=nnx.Rngs(1), dtype=jnp.bfloat16)

    return nnx.eval_shape(make)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "kind"))
def _fill(key, shape, dtype, kind):
    if kind == "int4":
        return jax.random.randint(key, shape, -8, 8, jnp.int8).astype(jnp.int4)
    if kind == "scale":
        return jnp.full(shape, 0.02 / 4.3, dtype)
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    std = 1.0 if kind == "embed" else 0.02
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _kind(name: str, dtype) -> str:
    if dtype == jnp.int4:
        return "int4"
    if name.endswith("_s"):
        return "scale"
    if "norm" in name:
        return "ones"
    if name == "e_score_correction_bias":
        return "zeros"
    return "embed" if name == "embed_tokens" else "normal"


def materialize(model: nnx.Module, seed: int) -> nnx.Module:
    """Random weights for an abstract model, one leaf at a time on the device."""
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        like = var.get_value()
        var.set_value(
            _fill(jax.random.fold_in(key, i), tuple(like.shape), like.dtype, _kind(str(path[-1]), like.dtype))
        )
    return nnx.merge(graphdef, state)
