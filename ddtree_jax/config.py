"""HF `config.json` -> validated, frozen configs for the Kimi K2 target and the DFlash drafter.

`KimiConfig` is the one source of truth for the target's dimensions; `DFlashConfig` for the drafter's.
Both layouts of the target are read: flat DeepSeek-V3 / Kimi K2-Thinking (`model_type` deepseek_v3 or
kimi_k2) and nested Kimi K2.5 / K2.6 (`model_type` kimi_k25, language model under `text_config`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json we cannot use; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (kimi_k2.md §3.4)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


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


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """The DFlash block-diffusion drafter (z-lab format; dflash_ddtree.md §1.2)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_theta: float
    rope_scaling: YarnConfig | None
    max_position_embeddings: int
    rms_norm_eps: float
    # cos/sin amplitude of the drafter's YaRN RoPE (dflash_ddtree.md §1.3): 1 + 0.1 ln(factor) by default.
    yarn_attention_factor: float = 1.0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0

    @property
    def num_draft(self) -> int:
        """D = block_size - 1: draft positions (tree depth) per round."""
        return self.block_size - 1


# ---- YaRN helpers (kimi_k2.md §3.4) ------------------------------------------------------------


def yarn_mscale(factor: float, mscale: float) -> float:
    """g(f, x) = 0.1 x ln f + 1 for f > 1, else 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


# ---- parsing -----------------------------------------------------------------------------------

_TARGET_TYPES = ("deepseek_v3", "kimi_k2")
_NESTED_TYPES = ("kimi_k25",)


def _read_json(path: str | Path) -> tuple[dict[str, Any], str]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: config.json not found")
    try:
        return json.loads(p.read_text()), str(p)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: malformed JSON ({e})") from None


def _get(cfg: dict[str, Any], key: str, where: str, default: Any = ..., kind: type | tuple = (int,)) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: missing field '{key}'")
        return default
    v = cfg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if bool not in kinds and isinstance(v, bool) or not isinstance(v, kinds):
        raise ConfigError(f"{where}: field '{key}' must be {'/'.join(k.__name__ for k in kinds)}, got {v!r}")
    return v


def _positive(where: str, **fields: int | float) -> None:
    for k, v in fields.items():
        if v <= 0:
            raise ConfigError(f"{where}: field '{k}' must be positive, got {v}")


def _parse_yarn(cfg: dict[str, Any], where: str) -> YarnConfig | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")  # transformers 5 uses rope_parameters
    if not rs:
        return None
    kind = rs.get("type", rs.get("rope_type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"{where}: rope_scaling type {kind!r} is not supported (only 'yarn')")
    w = f"{where}: rope_scaling"
    y = YarnConfig(
        factor=_get(rs, "factor", w, kind=float),
        original_max_position_embeddings=_get(rs, "original_max_position_embeddings", w),
        beta_fast=_get(rs, "beta_fast", w, 32.0, float),
        beta_slow=_get(rs, "beta_slow", w, 1.0, float),
        mscale=_get(rs, "mscale", w, 1.0, float),
        mscale_all_dim=_get(rs, "mscale_all_dim", w, 0.0, float),
    )
    _positive(w, factor=y.factor, original_max_position_embeddings=y.original_max_position_embeddings)
    return y


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
    g = lambda k, *a, **kw: _get(cfg, k, where_t, *a, **kw)  # noqa: E731
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
        rope_scaling=_parse_yarn(cfg, where_t),
        max_position_embeddings=g("max_position_embeddings"),
        rms_norm_eps=g("rms_norm_eps", 1e-6, float),
        quant=_parse_quant(qc, where_t),
        layout=layout,
        model_type=mtype,
        bos_token_id=cfg.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=_as_id_tuple(eos),
        pad_token_id=cfg.get("pad_token_id", raw.get("pad_token_id")),
    )
    _positive(
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
        _positive(where_t, num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size)
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
    raw, where = _read_json(path)
    return parse_kimi_config(raw, where)


def parse_dflash_config(raw: dict[str, Any], where: str = "config.json") -> DFlashConfig:
    """Validate a z-lab DFlash drafter config dict into a `DFlashConfig`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a JSON object")
    arch = raw.get("architectures") or []
    if "DFlashDraftModel" not in arch:
        raise ConfigError(f"{where}: architectures {arch!r} is not a DFlash drafter (expected DFlashDraftModel)")
    g = lambda k, *a, **kw: _get(raw, k, where, *a, **kw)  # noqa: E731
    dc = raw.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise ConfigError(f"{where}: dflash_config must be an object")
    layers = g("num_hidden_layers")
    n_target = g("num_target_layers")
    if "target_layer_ids" in dc:
        ids = dc["target_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise ConfigError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of ints")
        ids = tuple(ids)
    else:
        ids = default_target_layer_ids(n_target, layers)
    if any(not 0 <= i < n_target for i in ids):
        raise ConfigError(f"{where}: target_layer_ids {list(ids)} outside [0, {n_target})")
    block = dc.get("block_size", raw.get("block_size", 16))
    if not isinstance(block, int) or block < 2:
        raise ConfigError(f"{where}: block_size must be an int >= 2, got {block!r}")
    if "mask_token_id" not in dc:
        raise ConfigError(f"{where}: missing field 'dflash_config.mask_token_id'")
    heads, kv_heads = g("num_attention_heads"), g("num_key_value_heads")
    hidden = g("hidden_size")
    head_dim = g("head_dim", hidden // heads)
    yarn = _parse_yarn(raw, where)
    amp = 1.0 if yarn is None else yarn_mscale(yarn.factor, 1.0)
    if raw.get("layer_types") and any(t != "full_attention" for t in raw["layer_types"]):
        raise ConfigError(f"{where}: layer_types {raw['layer_types']} not supported (only full_attention)")
    c = DFlashConfig(
        hidden_size=hidden,
        intermediate_size=g("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=g("vocab_size"),
        num_target_layers=n_target,
        block_size=block,
        target_layer_ids=ids,
        mask_token_id=int(dc["mask_token_id"]),
        rope_theta=g("rope_theta", 10000.0, float),
        rope_scaling=yarn,
        max_position_embeddings=g("max_position_embeddings", 262144),
        rms_norm_eps=g("rms_norm_eps", 1e-6, float),
        yarn_attention_factor=float(raw.get("yarn_attention_factor", amp)),
        input_embedding_scale=float(raw.get("input_embedding_scale", 1.0)),
        output_multiplier=float(raw.get("output_multiplier", 1.0)),
    )
    _positive(where, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim must be even, got {head_dim}")
    if not 0 <= c.mask_token_id < c.vocab_size:
        raise ConfigError(f"{where}: mask_token_id {c.mask_token_id} outside the vocabulary")
    return c


def load_dflash_config(path: str | Path) -> DFlashConfig:
    raw, where = _read_json(path)
    return parse_dflash_config(raw, where)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab default: [N/2] for one layer, else round(1 + i (N-4)/(L-1)) (dflash_ddtree.md §1.2)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return tuple(int(round(1 + i * step)) for i in range(num_draft_layers))


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
