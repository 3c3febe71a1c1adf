"""Reading HF `config.json` files: the JSON, typed fields with defaults, positivity checks, and the YaRN RoPE scaling
both the target and the drafter declare."""

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


def yarn_mscale(factor: float, mscale: float) -> float:
    """g(f, x) = 0.1 x ln f + 1 for f > 1, else 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def read_json(path: str | Path) -> tuple[dict[str, Any], str]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: config.json not found")
    try:
        return json.loads(p.read_text()), str(p)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: malformed JSON ({e})") from None


def get_field(cfg: dict[str, Any], key: str, where: str, default: Any = ..., kind: type | tuple = (int,)) -> Any:
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


def check_positive(where: str, **fields: int | float) -> None:
    for k, v in fields.items():
        if v <= 0:
            raise ConfigError(f"{where}: field '{k}' must be positive, got {v}")


def parse_yarn(cfg: dict[str, Any], where: str) -> YarnConfig | None:
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
        factor=get_field(rs, "factor", w, kind=float),
        original_max_position_embeddings=get_field(rs, "original_max_position_embeddings", w),
        beta_fast=get_field(rs, "beta_fast", w, 32.0, float),
        beta_slow=get_field(rs, "beta_slow", w, 1.0, float),
        mscale=get_field(rs, "mscale", w, 1.0, float),
        mscale_all_dim=get_field(rs, "mscale_all_dim", w, 0.0, float),
    )
    check_positive(w, factor=y.factor, original_max_position_embeddings=y.original_max_position_embeddings)
    return y
