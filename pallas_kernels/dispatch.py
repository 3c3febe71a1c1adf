"""The one dispatch point between models and kernels.

`moe_swiglu`, `mla_attention` and `build_tree` pick the Pallas GPU kernel when running on a GPU and the plain-JAX
reference elsewhere, or whatever `use_kernels(...)` / the DDTREE_KERNELS environment variable asks for
("auto" | "reference" | "pallas" | "interpret": the Pallas kernels in interpret mode, to run the kernel path on a
CPU). Every choice is logged once per (op, implementation).

MLA attention has two Pallas kernels: the Pallas-Triton one (`mla_attention.py`, any head dim) and the Mosaic GPU
one (`mla_mosaic.py`, Hopper; bf16 cache, 64 | Dk, 128 | value_dim). `set_mla_backend` / DDTREE_MLA_KERNEL picks:
"triton", "mosaic", or "auto" (default): Mosaic on a Hopper GPU for calls with at least MOSAIC_MIN_ROWS query rows
(nodes x heads), Triton for fewer (decode with few heads). In a cache-carrying while loop, as the engine calls it,
bench_mla measured Mosaic faster than Triton in every cell of 64 rows or more (1.3-2.0x; context 60, where both lose
to the reference, aside) and slower in the 8-row (8-head decode) cells (`bench_mla_carry`); with the shipped pair
the engine ran 0.6-2.1 % faster with Mosaic on every call (`ab_flags_mla_mosaic`). Caches must come in whole
64-slot tiles (`sizing.cache_slots`): the Mosaic kernel pads, that is copies, any other length on every call, and
that copy is what made it lose inside loops before. A shape the Mosaic kernel does not take runs on Triton. Every
choice is logged once. `set_mla_tiling` / DDTREE_MLA_TILING ("field=value,...", e.g. "schedule=persistent";
`MosaicMLAConfig.from_text`) sets the Mosaic kernel's tiling (default: `MosaicMLAConfig()`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from absl import logging

from pallas_kernels import reference

_MODES = ("auto", "reference", "pallas", "interpret")
_OPS = ("moe_swiglu", "mla_attention", "build_tree")
_MLA_BACKENDS = ("auto", "triton", "mosaic")
MOSAIC_MIN_ROWS = 64
_mode = "auto"
_op_modes: dict[str, str] = {}  # per-op overrides of _mode (`use_kernels(mode, op=...)`)
_mla_backend = "auto"
_mla_tiling = None  # a MosaicMLAConfig other than the default, or None
_logged: set[tuple[str, str]] = set()


def set_kernel_mode(mode: str) -> None:
    global _mode
    if mode not in _MODES:
        raise ValueError(f"kernel mode {mode!r} not one of {_MODES}")
    _mode = mode


@contextlib.contextmanager
def use_kernels(mode: str, op: str | None = None) -> Iterator[None]:
    """Temporarily select the implementation (one of `_MODES`) of every op, or of `op` alone (one of `_OPS`).
    The choice is made when a program is traced: programs compiled before (e.g. cached by a Generator) keep theirs."""
    global _mode
    old, old_ops = _mode, dict(_op_modes)
    if mode not in _MODES:
        raise ValueError(f"kernel mode {mode!r} not one of {_MODES}")
    if op is None:
        set_kernel_mode(mode)
    elif op not in _OPS:
        raise ValueError(f"kernel op {op!r} not one of {_OPS}")
    else:
        _op_modes[op] = mode
    try:
        yield
    finally:
        _mode = old
        _op_modes.clear()
        _op_modes.update(old_ops)


def state() -> tuple:
    """Everything that decides which kernels a program traced now would use (a compile-cache key)."""
    return _mode, tuple(sorted(_op_modes.items())), _mla_backend


def kernel_mode() -> str:
    return _mode


def set_mla_backend(name: str) -> None:
    """Which Pallas MLA kernel `mla_attention` runs in Pallas mode: "auto", "triton" or "mosaic"."""
    global _mla_backend
    if name not in _MLA_BACKENDS:
        raise ValueError(f"MLA kernel {name!r} not one of {_MLA_BACKENDS}")
    _mla_backend = name


def set_mla_tiling(text: str):
    """The Mosaic MLA kernel's tiling from 'field=value,...' ('' -> the default); a ValueError names a bad one."""
    from pallas_kernels.mla_mosaic import MosaicMLAConfig

    global _mla_tiling
    config = MosaicMLAConfig.from_text(text)
    _mla_tiling = None if config == MosaicMLAConfig() else config
    return config


def _log_once(key: tuple[str, str], msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logging.info(msg, *args)


def _choose(op: str, available: bool, unsupported: str = "") -> str:
    """The implementation of `op` under the current mode: "pallas", "interpret" (the Pallas kernel in interpret
    mode) or "reference". `unsupported` names why the kernel cannot take these inputs: "auto" then runs the
    reference (logged as the slow path it is); an explicit "pallas"/"interpret" leaves the kernel to reject them."""
    mode = _op_modes.get(op, _mode)
    backend = jax.default_backend()
    if mode == "reference":
        impl = "reference"
    elif mode in ("pallas", "interpret"):
        if not available:
            raise RuntimeError(f"{op}: the Pallas kernel was requested but is not available on this build/device")
        impl = mode
    elif available and backend == "gpu" and unsupported:
        _log_once((op, unsupported), "%s: SLOW PATH, the reference runs because %s", op, unsupported)
        return "reference"
    else:
        impl = "pallas" if available and backend == "gpu" else "reference"
    _log_once((op, impl), "%s: using the %s implementation (mode=%s, backend=%s)", op, impl, mode, backend)
    return impl


def moe_swiglu(x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s):
    """Routed-expert SwiGLU; see `reference.moe_swiglu_reference` for shapes and semantics."""
    unsupported = "" if x.dtype == jnp.bfloat16 else f"the Pallas MoE kernel takes bf16 activations, not {x.dtype}"
    if (impl := _choose("moe_swiglu", _moe_kernel() is not None, unsupported)) != "reference":
        return _moe_kernel()(
            x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s, interpret=impl == "interpret"
        )
    return reference.moe_swiglu_reference(x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s)


def mla_attention(q, latent_cache, prefix_len, tree_mask, scale, value_dim=512):
    """Absorbed MLA attention; see `reference.mla_attention_reference` for shapes and semantics."""
    if (impl := _choose("mla_attention", _mla_kernel() is not None)) != "reference":
        kernel = mla_kernel_for(q, latent_cache, value_dim)
        return kernel(q, latent_cache, prefix_len, tree_mask, scale, value_dim, interpret=impl == "interpret")
    return reference.mla_attention_reference(q, latent_cache, prefix_len, tree_mask, scale, value_dim)


def build_tree(lp_k, ids_k, root, budget: int, reference):
    """DDTree + ancestor mask from per-depth top-K (lp_k, ids_k `[B, D, K]`, root `[B]`): the one-launch Pallas kernel
    (`tree_build.build_tree_pallas`, same returns) or `reference(lp_k, ids_k, root, budget)`, the plain-JAX build."""
    if (impl := _choose("build_tree", True)) != "reference":
        from pallas_kernels.tree_build import build_tree_pallas

        return build_tree_pallas(lp_k, ids_k, root, budget, interpret=impl == "interpret")
    return reference(lp_k, ids_k, root, budget)


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


def _is_hopper() -> bool:
    """The default device is a compute-capability 9.x GPU (wgmma; what the Mosaic kernel is written for)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def mla_kernel_for(q: jax.Array, latent_cache: jax.Array, value_dim: int):
    """The Pallas MLA kernel for these shapes under the selected backend (q `[B, N, Hq, Dk]`, cache `[B, L, Dk]`)."""
    _, n, heads, dk = q.shape
    if _mla_backend == "auto" and not (n * heads >= MOSAIC_MIN_ROWS and _is_hopper()):
        _log_once(
            ("mla_attention", f"auto-triton-{n}x{heads}"), "mla_attention: Triton kernel for %d x %d rows", n, heads
        )
        return _mla_kernel()
    if _mla_backend != "triton":
        if latent_cache.dtype == jax.numpy.bfloat16 and dk % 64 == 0 and value_dim % 128 == 0:
            from pallas_kernels.mla_mosaic import mla_attention_mosaic

            _log_once(
                ("mla_attention", f"mosaic-{n}x{heads}-{_mla_tiling}"),
                "mla_attention: Mosaic kernel for %d x %d rows, tiling %s",
                n,
                heads,
                _mla_tiling or "default",
            )
            return functools.partial(mla_attention_mosaic, tiling=_mla_tiling) if _mla_tiling else mla_attention_mosaic
        _log_once(
            ("mla_attention", f"mosaic-unsupported-{dk}-{value_dim}-{latent_cache.dtype}"),
            "mla_attention: the Mosaic kernel takes a bf16 cache, 64 | Dk and 128 | value_dim, not %s %d/%d; "
            "running the Triton kernel",
            latent_cache.dtype,
            dk,
            value_dim,
        )
    return _mla_kernel()


set_kernel_mode(os.environ.get("DDTREE_KERNELS", "auto"))  # an unknown value fails at import, naming it
set_mla_backend(os.environ.get("DDTREE_MLA_KERNEL", "auto"))
if os.environ.get("DDTREE_MLA_TILING"):
    set_mla_tiling(os.environ["DDTREE_MLA_TILING"])
