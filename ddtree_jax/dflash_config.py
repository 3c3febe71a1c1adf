"""HF `config.json` of a z-lab DFlash drafter -> the validated, frozen `DFlashConfig`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ddtree_jax import config_json
from ddtree_jax.config_json import ConfigError, YarnConfig


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


def parse_dflash_config(raw: dict[str, Any], where: str = "config.json") -> DFlashConfig:
    """Validate a z-lab DFlash drafter config dict into a `DFlashConfig`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a JSON object")
    arch = raw.get("architectures") or []
    if "DFlashDraftModel" not in arch:
        raise ConfigError(f"{where}: architectures {arch!r} is not a DFlash drafter (expected DFlashDraftModel)")
    g = lambda k, *a, **kw: config_json.get_field(raw, k, where, *a, **kw)  # noqa: E731
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
    yarn = config_json.parse_yarn(raw, where)
    amp = 1.0 if yarn is None else config_json.yarn_mscale(yarn.factor, 1.0)
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
    config_json.check_positive(
        where, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim
    )
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ConfigError(f"{where}: head_dim must be even, got {head_dim}")
    if not 0 <= c.mask_token_id < c.vocab_size:
        raise ConfigError(f"{where}: mask_token_id {c.mask_token_id} outside the vocabulary")
    return c


def load_dflash_config(path: str | Path) -> DFlashConfig:
    raw, where = config_json.read_json(path)
    return parse_dflash_config(raw, where)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab default: [N/2] for one layer, else round(1 + i (N-4)/(L-1)) (dflash_ddtree.md §1.2)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return tuple(int(round(1 + i * step)) for i in range(num_draft_layers))
