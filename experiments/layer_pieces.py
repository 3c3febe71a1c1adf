"""How experiments/layer_profile.py names the pieces of a layer and counts experts (no absl flags, so tests import
it beside other experiment modules)."""

from __future__ import annotations

import re

from ddtree_jax.config import KimiConfig

LAYER_PIECES = ("prologue", "cache_write", "attention", "o_proj", "router", "experts", "shared_expert", "ffn")
REST = "norms_residual"  # what a layer runs outside its named pieces
ROUND_SCOPES = ("step", "draft", "tree", "verify", "accept")  # engine.py's scopes


def layer_kind(cfg: KimiConfig, layer: int) -> str:
    return "moe" if cfg.is_moe_layer(layer) else "dense"


def piece_label(parts: list[str], cfg: KimiConfig) -> str:
    """An instruction's op_name path -> 'dense/<piece>' or 'moe/<piece>' inside a layer, else 'round/<scope>'
    ('round/outside_loop' for what runs once per program, before or after the loop)."""
    layer = next((int(p[6:]) for p in parts if re.fullmatch(r"layer_\d+", p)), None)
    if layer is not None:
        return f"{layer_kind(cfg, layer)}/" + next((p for p in parts if p in LAYER_PIECES), REST)
    if "body" not in parts:
        return "round/outside_loop"
    scope = next((p for p in parts if p in ROUND_SCOPES), "loop")
    return f"round/{scope}" + ("_lm_head" if "lm_head" in parts else "")


def expected_distinct(experts: int, picks: int) -> float:
    """Distinct experts touched by `picks` uniform draws from `experts`: E (1 - (1 - 1/E)^picks)."""
    return experts * (1.0 - (1.0 - 1.0 / experts) ** picks)
