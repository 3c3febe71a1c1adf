"""HF `config.json` -> validated, frozen configs for the Kimi K2 target and the DFlash drafter.

`KimiConfig` (here) is the one source of truth for the target's dimensions; `DFlashConfig` (`dflash_config.py`,
re-exported here with the shared `ConfigError` and `YarnConfig` of `config_json.py`) for the drafter's.
Both layouts of the target are read: flat DeepSeek-V3 / Kimi K2-Thinking (`model_type` deepseek_v3 or
kimi_k2) and nested Kimi K2.5 / K2.6 (`model_type` kimi_k25, language model under `text_config`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ddtree_jax.config_json import (
    ConfigError,
    YarnConfig,
    check_positive,
    get_field,
    parse_yarn,
    read_json,
    yarn_mscale,
)
from ddtree_jax.dflash_config import DFlashConfig, load_dflash_config

__all__ = [
    "ConfigError",
    "DFlashConfig",
    "KimiConfig",
    "QuantConfig",
    "YarnConfig",
    "check_pair",
    "load_dflash_config",
    "load_kimi_config",
    "parse_kimi_config",
    "to_hf_dict",
]


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors `pack-quantized` INT4 for the routed experts (kimi_k2.md §5)."""

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True


_K2_STOP_IDS = (163585, 163586)  # [EOS] and <|im_end|>: stop on both whatever eos_token_id says.


@dataclasses.dataclass(frozen=True)
class KimiConfig:
    """The Kimi K2 / DeepSeek-V3 language model. Field names follow HF's config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    rope_theta: float
    rope_scaling: YarnConfig | None
    max_position_embeddings: int
    rms_norm_eps: float
    latent_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm: HF class default.
    quant: QuantConfig | None = None
    layout: str = "flat"  # "flat" (model.*) or "nested" (language_model.model.*)
    model_type: str = "kimi_k2"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the latent cache: normed c_kv (512) + roped k_pe (64)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(P + R)^-0.5 * m^2 with m = yarn_get_mscale(factor, mscale_all_dim) (kimi_k2.md §3.4)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: the config's eos ids, plus Kimi's two when the vocab has them."""
        ids = set(self.eos_token_ids)
        if self.vocab_size == 163840:
            ids.update(_K2_STOP_IDS)
        return tuple(sorted(ids))


# ---- parsing -----------------------------------------------------------------------------------

_TARGET_TYPES = ("deepseek_v3", "kimi_k2")
_NESTED_TYPES = ("kimi_k25",)


def _parse_quant(qc: dict[str, Any] | None, where: str) -> QuantConfig | None:
    if not qc:
        return None
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != "pack-quantized":
        raise ConfigError(
            f"{where}: quantization_config {method!r}/{fmt!r} is not supported "
            "(only compressed-tensors pack-quantized INT4)"
        )
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{where}: quantization_config must have exactly one config group, got {len(groups)}")
    (group,) = groups.values()
    w = group.get("weights") or {}
    bits, gtype, sym = w.get("num_bits"), w.get("type"), w.get("symmetric")
    strategy, gs = w.get("strategy"), w.get("group_size")
    if (bits, gtype, sym, strategy) != (4, "int", True, "group") or not isinstance(gs, int) or gs <= 0:
        raise ConfigError(
            f"{where}: quantization scheme num_bits={bits} type={gtype} symmetric={sym} strategy={strategy} "
            f"group_size={gs} is not supported (only symmetric int4, group strategy)"
        )
    if group.get("input_activations") or w.get("actorder"):
        raise ConfigError(f"{where}: activation quantization / actorder is not supported")
    return QuantConfig(num_bits=4, group_size=gs, symmetric=True)


def _as_id_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, list) else (int(v),)


def parse_kimi_config(raw: dict[str, Any], where: str = "config.json") -> KimiConfig:
    """Validate a target config dict (either layout) into a `KimiConfig`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a JSON object")
    outer_type = raw.get("model_type")
    if outer_type in _NESTED_TYPES or "text_config" in raw:
        layout = "nested"
        cfg = raw.get("text_config")
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where}: model_type {outer_type!r} needs a 'text_config' object")
        where_t = f"{where}: text_config"
    else:
        layout, cfg, where_t = "flat", raw, where
    mtype = cfg.get("model_type")
    if mtype not in _TARGET_TYPES:
        raise ConfigError(
            f"{where_t}: model_type {mtype!r} is not supported (expected one of {_TARGET_TYPES}, "
            f"or {_NESTED_TYPES} with text_config)"
        )
    g = lambda k, *a, **kw: get_field(cfg, k, where_t, *a, **kw)  # noqa: E731
    if g("scoring_func", "sigmoid", str) != "sigmoid":
        raise ConfigError(f"{where_t}: scoring_func {cfg['scoring_func']!r} is not supported (only sigmoid)")
    if g("topk_method", "noaux_tc", str) != "noaux_tc":
        raise ConfigError(f"{where_t}: topk_method {cfg['topk_method']!r} is not supported (only noaux_tc)")
    if g("hidden_act", "silu", str) != "silu":
        raise ConfigError(f"{where_t}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if g("attention_bias", False, bool):
        raise ConfigError(f"{where_t}: attention_bias=true is not supported")
    if g("tie_word_embeddings", False, bool):
        raise ConfigError(f"{where_t}: tie_word_embeddings=true is not supported (Kimi's lm_head is untied)")
    if g("q_lora_rank", 0) <= 0:
        raise ConfigError(f"{where_t}: q_lora_rank must be set (MLA without a query LoRA is not supported)")
    qc = cfg.get("quantization_config", raw.get("quantization_config"))
    eos = cfg.get("eos_token_id", raw.get("eos_token_id"))
    c = KimiConfig(
        vocab_size=g("vocab_size"),
        hidden_size=g("hidden_size"),
        num_hidden_layers=g("num_hidden_layers"),
        num_attention_heads=g("num_attention_heads"),
        q_lora_rank=g("q_lora_rank"),
        kv_lora_rank=g("kv_lora_rank"),
        qk_nope_head_dim=g("qk_nope_head_dim"),
        qk_rope_head_dim=g("qk_rope_head_dim"),
        v_head_dim=g("v_head_dim"),
        intermediate_size=g("intermediate_size"),
        moe_intermediate_size=g("moe_intermediate_size"),
        n_routed_experts=g("n_routed_experts"),
        num_experts_per_tok=g("num_experts_per_tok"),
        n_shared_experts=g("n_shared_experts", 1),
        first_k_dense_replace=g("first_k_dense_replace", 0),
        moe_layer_freq=g("moe_layer_freq", 1),
        routed_scaling_factor=g("routed_scaling_factor", 1.0, float),
        n_group=g("n_group", 1),
        topk_group=g("topk_group", 1),
        norm_topk_prob=g("norm_topk_prob", True, bool),
        rope_theta=g("rope_theta", 10000.0, float),
        rope_scaling=parse_yarn(cfg, where_t),
        max_position_embeddings=g("max_position_embeddings"),
        rms_norm_eps=g("rms_norm_eps", 1e-6, float),
        quant=_parse_quant(qc, where_t),
        layout=layout,
        model_type=mtype,
        bos_token_id=cfg.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=_as_id_tuple(eos),
        pad_token_id=cfg.get("pad_token_id", raw.get("pad_token_id")),
    )
    check_positive(
        where_t,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        moe_layer_freq=c.moe_layer_freq,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
    )
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"{where_t}: qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    if c.n_routed_experts:
        check_positive(
            where_t, num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size
        )
        if c.num_experts_per_tok > c.n_routed_experts:
            raise ConfigError(f"{where_t}: num_experts_per_tok {c.num_experts_per_tok} > n_routed_experts")
        if c.n_group < 1 or c.n_routed_experts % c.n_group or not 1 <= c.topk_group <= c.n_group:
            raise ConfigError(
                f"{where_t}: n_group={c.n_group}, topk_group={c.topk_group} invalid for {c.n_routed_experts} experts"
            )
        if c.num_experts_per_tok > c.topk_group * (c.n_routed_experts // c.n_group):
            raise ConfigError(f"{where_t}: topk_group groups hold fewer than num_experts_per_tok experts")
        if c.n_shared_experts < 0:
            raise ConfigError(f"{where_t}: n_shared_experts must be >= 0")
    if c.first_k_dense_replace > 0 and c.intermediate_size <= 0:
        raise ConfigError(f"{where_t}: intermediate_size must be positive for dense layers")
    if c.quant is not None:
        for name, dim in (("hidden_size", c.hidden_size), ("moe_intermediate_size", c.moe_intermediate_size)):
            if dim % c.quant.group_size or dim % 8:
                raise ConfigError(
                    f"{where_t}: {name}={dim} is not a multiple of the INT4 group size {c.quant.group_size} and 8"
                )
    return c


def load_kimi_config(path: str | Path) -> KimiConfig:
    """Read `path` (a checkpoint directory or its config.json) as a target config."""
    raw, where = read_json(path)
    return parse_kimi_config(raw, where)


def check_pair(target: KimiConfig, drafter: DFlashConfig) -> None:
    """Reject a drafter that cannot serve this target (hidden size, vocab, feature layers)."""
    if drafter.hidden_size != target.hidden_size:
        raise ConfigError(f"drafter hidden_size {drafter.hidden_size} does not match the target's {target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter vocab_size {drafter.vocab_size} does not match the target's {target.vocab_size}")
    if drafter.num_target_layers != target.num_hidden_layers:
        raise ConfigError(
            f"drafter num_target_layers {drafter.num_target_layers} does not match the target's "
            f"{target.num_hidden_layers} layers"
        )


def to_hf_dict(c: KimiConfig) -> dict[str, Any]:
    """Write a `KimiConfig` back as an HF config.json dict in its own layout (for synthetic checkpoints)."""
    text = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "n_routed_experts": c.n_routed_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "n_shared_experts": c.n_shared_experts,
        "first_k_dense_replace": c.first_k_dense_replace,
        "moe_layer_freq": c.moe_layer_freq,
        "routed_scaling_factor": c.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "norm_topk_prob": c.norm_topk_prob,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else {"type": "yarn", **dataclasses.asdict(c.rope_scaling)},
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids),
        "pad_token_id": c.pad_token_id,
    }
    if c.quant is not None:
        text["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": c.quant.group_size,
                        "dynamic": False,
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": [
                "lm_head",
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            ],
        }
    if c.layout == "flat":
        return text
    outer = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": c.pad_token_id,
    }
    if c.quant is not None:
        outer["quantization_config"] = text["quantization_config"]
    return outer
