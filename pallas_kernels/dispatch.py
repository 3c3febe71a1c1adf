"""The one dispatch point between models and kernels.

`moe_swiglu` and `mla_attention` pick the Pallas GPU kernel when running on a GPU and the plain-JAX reference
elsewhere, or whatever `use_kernels(...)` / the DDTREE_KERNELS environment variable asks for
("auto" | "reference" | "pallas"). Every choice is logged once per (op, implementation).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from absl import logging

from pallas_kernels import reference

_MODES = ("auto", "reference", "pallas")
_mode = os.environ.get("DDTREE_KERNELS", "auto")
_logged: set[tuple[str, str]] = set()


def set_kernel_mode(mode: str) -> None:
    global _mode
    if mode not in _MODES:
        raise ValueError(f"kernel mode {mode!r} not one of {_MODES}")
    _mode = mode


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """Temporarily select the kernel implementation ("auto", "reference" or "pallas")."""
    global _mode
    old = _mode
    set_kernel_mode(mode)
    try:
        yield
    finally:
        _mode = old


def kernel_mode() -> str:
    return _mode


def _choose(op: str, available: bool) -> str:
    if _mode == "reference":
        impl = "reference"
    elif _mode == "pallas":
        if not available:
            raise RuntimeError(f"{op}: the Pallas kernel was requested but is not available on this build/device")
        impl = "pallas"
    else:
        impl = "pallas" if available and jax.default_backend() == "gpu" else "reference"
    if (op, impl) not in _logged:
        _logged.add((op, impl))
        logging.info("%s: using the %s implementation (mode=%s, backend=%s)", op, impl, _mode, jax.default_backend())
    return impl


def moe_swiglu(x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s):
    """Routed-expert SwiGLU; see `reference.moe_swiglu_reference` for shapes and semantics."""
    if _choose("moe_swiglu", _moe_kernel() is not None) == "pallas":
        return _moe_kernel()(x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s)
    return reference.moe_swiglu_reference(x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s)


def mla_attention(q, latent_cache, prefix_len, tree_mask, scale, value_dim=512):
    """Absorbed MLA attention; see `reference.mla_attention_reference` for shapes and semantics."""
    if _choose("mla_attention", _mla_kernel() is not None) == "pallas":
        return _mla_kernel()(q, latent_cache, prefix_len, tree_mask, scale, value_dim)
    return reference.mla_attention_reference(q, latent_cache, prefix_len, tree_mask, scale, value_dim)


def _moe_kernel():
    try:
        from pallas_kernels.int4_moe import moe_swiglu_pallas
    except ImportError:
        return None
    return moe_swiglu_pallas


def _mla_kernel():
    try:
        from pallas_kernels.mla_attention import mla_attention_pallas
    except ImportError:
        return None
    return mla_attention_pallas
