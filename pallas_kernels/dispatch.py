"""The one dispatch point between models and kernels, and the kernel selection as one value.

`Kernels` says which implementation each op runs: `moe_swiglu`, `mla_attention`, `build_tree`, `drafter_attention`,
`drafter_swiglu`, `drafter_residual`, `matmul` and `rms_norm` take "auto" (the Pallas GPU kernel on a GPU, the
plain-JAX reference elsewhere), "reference", "pallas" or "interpret" (the Pallas kernel in interpret mode, to run the
kernel path on a CPU). For MLA attention in Pallas mode `mla_kernel` picks the Pallas-Triton kernel
(`mla_attention.py`, any head dim) or the Mosaic GPU one (`mla_mosaic.py`, Hopper; bf16 cache, 64 | Dk, 128 |
value_dim): "triton", "mosaic", or "auto" (Mosaic on a Hopper GPU for calls with at least MOSAIC_MIN_ROWS query rows,
nodes x heads; Triton for fewer). `mla_tiling` is the Mosaic kernel's tiling (None: the default `MosaicMLAConfig()`),
and `topk_chunk` the row length of the chunk-wise exact top-k of the tree build (`ddtree_jax.topk`; 0: plain
`lax.top_k`).

`exact` selects the batch-invariant numerics of the target: its dense products (`matmul`, `residual_matmul`,
`head_matmul`) run the
row-invariant kernels of `exact_matmul.py` under the `matmul` mode, its RMS norms the row-invariant kernel of
`exact_norm.py` under the `rms_norm` mode (a norm whose only consumers are products, `normed_matmul`, runs inside the
product's kernel when the `matmul` mode selects it), MLA attention and its W_UV product (`mla_output`) the per-node
kernels of `mla_exact.py` under the `mla_attention` mode, and the MoE a fixed tile and a fixed-order combine. Without
`exact` the `matmul` and `rms_norm` modes are unused: those are the plain `jnp.dot` / `jnp.einsum` and
`reference.rms_norm`.

A `Kernels` value is frozen and hashable: the engine carries it in its `GenSpec`, so it is part of every compiled
program's key, and passes it down to these functions; nothing here reads a global at trace time. The environment
only chooses the default (`Kernels.from_env`): DDTREE_KERNELS (every op, or 'op=mode,...'), DDTREE_MLA_KERNEL,
DDTREE_MLA_TILING ("field=value,...", `MosaicMLAConfig.from_text`) and DDTREE_TOPK_CHUNK. Every choice is logged
once per (op, implementation).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from absl import logging
from jax.typing import DTypeLike

from pallas_kernels import reference

if TYPE_CHECKING:
    from pallas_kernels.mla_mosaic import MosaicMLAConfig

MODES = ("auto", "reference", "pallas", "interpret")
OPS = (
    "moe_swiglu",
    "mla_attention",
    "build_tree",
    "drafter_attention",
    "drafter_swiglu",
    "drafter_residual",
    "matmul",
    "rms_norm",
)
MLA_KERNELS = ("auto", "triton", "mosaic")
MOSAIC_MIN_ROWS = 64
TOPK_CHUNK = 512
RESIDUAL_MAX_BYTES = 1 << 20  # drafter_residual's kernel re-reads w per 16-row tile: small drafters only
_logged: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernel selection of a program: an implementation per op (one of MODES), the Pallas MLA kernel (one of
    MLA_KERNELS), the Mosaic MLA tiling (None: the default), the top-k chunk length (0: `lax.top_k`) and `exact`:
    the target's batch- and tree-invariant numerics (docs/exactness.md), a token's logits independent of how many
    rows or tree nodes share the call."""

    moe_swiglu: str = "auto"
    mla_attention: str = "auto"
    build_tree: str = "auto"
    drafter_attention: str = "auto"
    drafter_swiglu: str = "auto"
    drafter_residual: str = "auto"
    matmul: str = "auto"
    rms_norm: str = "auto"
    mla_kernel: str = "auto"
    mla_tiling: MosaicMLAConfig | None = None
    topk_chunk: int = TOPK_CHUNK
    exact: bool = False

    def __post_init__(self):
        for op in OPS:
            if getattr(self, op) not in MODES:
                raise ValueError(f"kernel mode {getattr(self, op)!r} for {op} not one of {MODES}")
        if self.mla_kernel not in MLA_KERNELS:
            raise ValueError(f"MLA kernel {self.mla_kernel!r} not one of {MLA_KERNELS}")
        if self.topk_chunk < 0:
            raise ValueError(f"top-k chunk length must be >= 0, got {self.topk_chunk}")
        if self.mla_tiling is not None:
            from pallas_kernels.mla_mosaic import MosaicMLAConfig

            if self.mla_tiling == MosaicMLAConfig():  # one value per tiling: the default is None
                object.__setattr__(self, "mla_tiling", None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Kernels:
        """The default selection: DDTREE_KERNELS, DDTREE_MLA_KERNEL, DDTREE_MLA_TILING and DDTREE_TOPK_CHUNK of
        `environ` (default `os.environ`); a ValueError names an unknown value."""
        env = os.environ if environ is None else environ
        modes = ops_from_text(env.get("DDTREE_KERNELS", "auto"))
        chunk = env.get("DDTREE_TOPK_CHUNK", str(TOPK_CHUNK))
        if not chunk.isdigit():
            raise ValueError(f"DDTREE_TOPK_CHUNK {chunk!r} is not a non-negative integer")
        return cls(
            **modes,
            mla_kernel=env.get("DDTREE_MLA_KERNEL", "auto"),
            mla_tiling=tiling_from_text(env.get("DDTREE_MLA_TILING", "")),
            topk_chunk=int(chunk),
        )

    @classmethod
    def or_env(cls, kernels: Kernels | None) -> Kernels:
        """`kernels`, or the environment's default selection (`from_env`, read now) when None."""
        return cls.from_env() if kernels is None else kernels

    def with_mode(self, mode: str, op: str | None = None) -> Kernels:
        """This selection with every op, or `op` alone (one of OPS), running `mode`."""
        if op is not None and op not in OPS:
            raise ValueError(f"kernel op {op!r} not one of {OPS}")
        return dataclasses.replace(self, **dict.fromkeys(OPS if op is None else (op,), mode))


def ops_from_text(text: str) -> dict[str, str]:
    """The mode of every op from 'MODE', 'op=MODE,...' or 'MODE,op=MODE,...' (ops not named run the leading MODE,
    default auto); a ValueError names a bad entry."""
    modes = dict.fromkeys(OPS, "auto")
    for i, entry in enumerate(e.strip() for e in text.split(",")):
        op, eq, mode = entry.rpartition("=")
        if not eq and i == 0:
            modes = dict.fromkeys(OPS, mode)
        elif op in OPS:
            modes[op] = mode
        else:
            raise ValueError(f"DDTREE_KERNELS entry {entry!r} is not MODE (first) or op=MODE with op one of {OPS}")
    return modes


def tiling_from_text(text: str) -> MosaicMLAConfig | None:
    """The Mosaic MLA tiling from 'field=value,...' (None for '' or the default); a ValueError names a bad one."""
    if not text:
        return None
    from pallas_kernels.mla_mosaic import MosaicMLAConfig

    return MosaicMLAConfig.from_text(text)


def _log_once(key: tuple[str, str], msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logging.info(msg, *args)


def _choose(op: str, mode: str, available: bool, unsupported: str = "") -> str:
    """The implementation of `op` under `mode`: "pallas", "interpret" (the Pallas kernel in interpret mode) or
    "reference". `unsupported` names why the kernel cannot take these inputs: "auto" then runs the reference
    (logged as the slow path it is); an explicit "pallas"/"interpret" leaves the kernel to reject them."""
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


def moe_swiglu(kernels: Kernels, x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s):
    """Routed-expert SwiGLU; see `reference.moe_swiglu_reference` for shapes and semantics. Under `kernels.exact`
    the kernel runs one fixed tile (`int4_moe.EXACT_BT`) and both sum a token's k expert outputs in rank order."""
    unsupported = "" if x.dtype == jnp.bfloat16 else f"the Pallas MoE kernel takes bf16 activations, not {x.dtype}"
    impl = _choose("moe_swiglu", kernels.moe_swiglu, _moe_kernel() is not None, unsupported)
    args = (x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s)
    if impl != "reference":
        return _moe_kernel()(*args, interpret=impl == "interpret", exact=kernels.exact)
    return reference.moe_swiglu_reference(*args, exact=kernels.exact)


def matmul(kernels: Kernels, x: jax.Array, w: jax.Array, preferred_element_type: DTypeLike | None = None) -> jax.Array:
    """x `[..., K]` @ w `[K, N]` -> `[..., N]`: `jnp.dot(x, w, preferred_element_type=...)`; under `kernels.exact`
    the row-invariant kernel (`exact_matmul.matmul_pallas`, f32 accumulation) as the `matmul` mode selects, its
    reference being that same `jnp.dot`."""
    if impl := _invariant_products(kernels):
        return _invariant_matmul(impl, x, w, preferred_element_type)
    return jnp.dot(x, w, preferred_element_type=preferred_element_type)


def residual_matmul(kernels: Kernels, residual: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    """residual `[..., N]` + (x `[..., K]` @ w `[K, N]`, accumulated in f32, rounded to residual's dtype): a residual
    stream's update. Under `kernels.exact` with the `matmul` kernel selected, one row-invariant kernel that adds the
    residual as its epilogue (`exact_matmul.matmul_pallas(..., residual=)`); else `reference.residual_update`."""
    if impl := _invariant_products(kernels):
        return _invariant_matmul(impl, x, w, residual.dtype, residual=residual)
    return reference.residual_update(residual, x, w)


def _invariant_products(kernels: Kernels) -> str | None:
    """The `matmul` mode's implementation ("pallas" or "interpret") when the products run the row-invariant
    kernels of `exact_matmul.py` (`kernels.exact`, the mode not "reference"), else None."""
    if kernels.exact and (impl := _choose("matmul", kernels.matmul, True)) != "reference":
        return impl
    return None


def _invariant_matmul(
    impl: str,
    x: jax.Array,
    w: jax.Array,
    preferred_element_type: DTypeLike | None,
    norm: tuple[jax.Array, float] | None = None,
    residual: jax.Array | None = None,
) -> jax.Array:
    """`exact_matmul.matmul_pallas` of x `[..., K]` and w `[K, N]` (x RMS-normed first with norm = (gain, eps);
    residual `[..., N]` added last), in preferred_element_type or the operands' dtype."""
    from pallas_kernels.exact_matmul import matmul_pallas

    out_dtype = preferred_element_type or jnp.result_type(x, w)
    return matmul_pallas(x, w, out_dtype, norm=norm, residual=residual, interpret=impl == "interpret")


def rms_norm(kernels: Kernels, x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMS norm of x `[..., W]`'s first H columns (W >= H) with gain `[H]` -> `[..., H]` (`reference.rms_norm`);
    under `kernels.exact` the row-invariant kernel (`exact_norm.rms_norm_pallas`, which reads those columns in
    place) as the `rms_norm` mode selects."""
    if kernels.exact and (impl := _choose("rms_norm", kernels.rms_norm, True)) != "reference":
        from pallas_kernels.exact_norm import rms_norm_pallas

        return rms_norm_pallas(x, weight, eps, interpret=impl == "interpret")
    return reference.rms_norm(x[..., : weight.shape[0]], weight, eps)


def normed_matmul(
    kernels: Kernels,
    x: jax.Array,
    gain: jax.Array,
    eps: float,
    *ws: jax.Array,
    preferred_element_type: DTypeLike | None = None,
) -> tuple[jax.Array, ...]:
    """RMS norm of x `[..., K]` with gain `[K]`, then its product with each w `[K, N_i]` -> one `[..., N_i]` per w:
    `rms_norm` once, then `matmul` per w, as their modes select; except under `kernels.exact` with the `matmul`
    kernel selected, where each product is one row-invariant kernel that norms x itself
    (`exact_matmul.matmul_pallas(..., norm=(gain, eps))`; the normed x is never stored)."""
    if impl := _invariant_products(kernels):
        return tuple(_invariant_matmul(impl, x, w, preferred_element_type, (gain, eps)) for w in ws)
    normed = rms_norm(kernels, x, gain, eps)
    return tuple(matmul(kernels, normed, w, preferred_element_type) for w in ws)


def head_matmul(
    kernels: Kernels,
    x: jax.Array,
    w: jax.Array,
    *,
    transposed: bool = False,
    preferred_element_type: DTypeLike | None = None,
) -> jax.Array:
    """One product per head: x `[..., heads, K']`'s first K columns (K' >= K) with w `[heads, K, N]` (transposed:
    `[heads, N, K]`) -> `[..., heads, N]`, `jnp.einsum` of the two; under `kernels.exact` the row-invariant kernel
    (`exact_matmul.head_matmul_pallas`, which reads those columns in place) as the `matmul` mode selects, its
    reference being that same einsum."""
    if impl := _invariant_products(kernels):
        from pallas_kernels.exact_matmul import head_matmul_pallas

        out_dtype = preferred_element_type or jnp.result_type(x, w)
        return head_matmul_pallas(x, w, out_dtype, transposed=transposed, interpret=impl == "interpret")
    spec = "...hk,hnk->...hn" if transposed else "...hk,hkn->...hn"
    k = w.shape[2] if transposed else w.shape[1]
    return jnp.einsum(spec, x[..., :k], w, preferred_element_type=preferred_element_type)


def mla_attention(kernels: Kernels, q, latent_cache, prefix_len, tree_mask, scale, value_dim=512, causal=False):
    """Absorbed MLA attention; see `reference.mla_attention_reference` for shapes and semantics (causal: tree_mask
    is the causal mask, which only the exact kernel uses). Under `kernels.exact` the attention's kernel runs only
    with its W_UV product (`mla_output`): a ValueError unless the mode selects the reference."""
    if (impl := _choose("mla_attention", kernels.mla_attention, _mla_kernel() is not None)) != "reference":
        if kernels.exact:
            raise ValueError("the exact MLA kernel runs only with its W_UV product: call dispatch.mla_output")
        kernel = mla_kernel_for(kernels, q, latent_cache, value_dim)
        return kernel(q, latent_cache, prefix_len, tree_mask, scale, value_dim, interpret=impl == "interpret")
    return reference.mla_attention_reference(q, latent_cache, prefix_len, tree_mask, scale, value_dim)


def mla_output(
    kernels: Kernels,
    q,
    latent_cache,
    prefix_len,
    tree_mask,
    w_uv,
    scale,
    value_dim=512,
    causal=False,
    out_dtype: DTypeLike = jnp.float32,
) -> jax.Array:
    """Absorbed MLA attention times each head's W_UV: q `[B, N, Hq, Dk]`, latent_cache `[B, L, Dk]`, prefix_len
    `[B]`, tree_mask `[B, N, N]`, w_uv `[Hq, V, value_dim]` -> `[B, N, Hq, V]`, the f32 product rounded to
    out_dtype. `mla_attention` then `head_matmul(..., transposed=True)` in f32, as their modes select; under
    `kernels.exact` with the `mla_attention` mode not "reference", `mla_exact.mla_output_exact` (a node's result
    independent of the call; the segments' merge inside the W_UV product's kernel), which reads a causal block
    (`causal`: tree_mask is the causal mask) straight from the cache."""
    if kernels.exact:
        impl = _choose("mla_attention", kernels.mla_attention, _mla_kernel() is not None)
        if impl != "reference":
            from pallas_kernels.mla_exact import mla_output_exact

            args = (q, latent_cache, prefix_len, tree_mask, w_uv, scale, value_dim)
            return mla_output_exact(*args, causal=causal, out_dtype=out_dtype, interpret=impl == "interpret")
    o_lat = mla_attention(kernels, q, latent_cache, prefix_len, tree_mask, scale, value_dim, causal)
    return head_matmul(kernels, o_lat, w_uv, transposed=True, preferred_element_type=jnp.float32).astype(out_dtype)


def build_tree(kernels: Kernels, lp_k, ids_k, root, budget: int, reference):
    """DDTree + ancestor mask from per-depth top-K (lp_k, ids_k `[B, D, K]`, root `[B]`): the one-launch Pallas kernel
    (`tree_build.build_tree_pallas`, same returns) or `reference(lp_k, ids_k, root, budget)`, the plain-JAX build."""
    if (impl := _choose("build_tree", kernels.build_tree, True)) != "reference":
        from pallas_kernels.tree_build import build_tree_pallas

        return build_tree_pallas(lp_k, ids_k, root, budget, interpret=impl == "interpret")
    return reference(lp_k, ids_k, root, budget)


def drafter_attention(
    kernels: Kernels,
    x: jax.Array,
    weights: reference.DrafterAttentionWeights,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_len: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    layer: int,
    eps: float,
    scale: float,
) -> jax.Array:
    """One drafter layer's attention block at layer `layer`, from the layer input x `[B, S, H]` (its input norm, the
    q / k / v projections, their norms and RoPE by the tables cos, sin `[B, S, hd/2]`, the attention over the
    stacked context cache `[layers, B, L, kvh, hd]` below ctx_len `[B]` and the block) -> `[B, S, nh, hd]`; see
    `reference.drafter_attention_reference`. The Pallas kernel (`drafter_attention.py`) is one launch and reads no
    cache slot past ctx_len; its gradient is the reference's, so the drafter trains through either."""
    from pallas_kernels.drafter_attention import drafter_attention_pallas, unsupported

    impl = _choose("drafter_attention", kernels.drafter_attention, True, unsupported(x, weights, ctx_k))
    statics = dict(layer=layer, eps=float(eps), scale=float(scale))
    plain = functools.partial(reference.drafter_attention_reference, **statics)
    if impl == "reference":
        return plain(x, weights, ctx_k, ctx_v, ctx_len, cos, sin)
    kernel = functools.partial(drafter_attention_pallas, **statics, interpret=impl == "interpret")
    return _with_reference_grad(kernel, plain, x, weights, ctx_k, ctx_v, ctx_len, cos, sin)


def drafter_swiglu(kernels: Kernels, x: jax.Array, weights: reference.DrafterSwigluWeights, eps: float) -> jax.Array:
    """A drafter layer's post-attention norm, gate and up and SwiGLU: x `[..., H]` -> `[..., I]` in x.dtype, see
    `reference.drafter_swiglu_reference`. The Pallas kernel (`drafter_swiglu.py`) is one launch; it takes small
    drafters only, `auto` runs the reference for others. Its gradient is the reference's, so the drafter trains
    through either."""
    from pallas_kernels.drafter_swiglu import drafter_swiglu_pallas, unsupported

    impl = _choose("drafter_swiglu", kernels.drafter_swiglu, True, unsupported(x, weights))
    plain = functools.partial(reference.drafter_swiglu_reference, eps=float(eps))
    if impl == "reference":
        return plain(x, weights)
    kernel = functools.partial(drafter_swiglu_pallas, eps=float(eps), interpret=impl == "interpret")
    return _with_reference_grad(kernel, plain, x, weights)


def drafter_residual(kernels: Kernels, residual: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    """A drafter layer's residual update (o_proj, down): `reference.residual_update`, residual `[..., N]` + x
    `[..., K]` @ w `[K, N]`. The Pallas kernel is `exact_matmul.matmul_pallas` with the add
    as its epilogue (one launch where XLA runs the product and an add); it reads w once per 16 rows, so it takes
    weights of at most RESIDUAL_MAX_BYTES and `auto` runs the plain expression (XLA's GEMM) for a larger drafter. Its
    gradient is the plain expression's."""
    weight_bytes = w.size * w.dtype.itemsize
    unsupported = ""
    if x.dtype != w.dtype:
        unsupported = f"the drafter's residual product takes x and w of one dtype, not {x.dtype}, {w.dtype}"
    elif weight_bytes > RESIDUAL_MAX_BYTES:
        unsupported = (
            f"the drafter's residual kernel takes weights of at most {RESIDUAL_MAX_BYTES} bytes, not {weight_bytes}"
        )
    impl = _choose("drafter_residual", kernels.drafter_residual, True, unsupported)
    if impl == "reference":
        return reference.residual_update(residual, x, w)

    def kernel(residual: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
        return _invariant_matmul(impl, x, w, residual.dtype, residual=residual)

    return _with_reference_grad(kernel, reference.residual_update, residual, x, w)


def _with_reference_grad(kernel: Callable[..., jax.Array], plain: Callable[..., jax.Array], *args) -> jax.Array:
    """kernel(*args), differentiated as plain(*args), the expression the kernel computes: a Pallas kernel has no
    gradient of its own, so the drafter trains through the reference's. args are arrays or pytrees of them (integer
    ones get float0 cotangents); kernel and plain close over Python constants only."""

    @jax.custom_vjp
    def run(*args):
        return kernel(*args)

    def run_fwd(*args):
        return kernel(*args), args

    def run_bwd(args: tuple, grad: jax.Array) -> tuple:
        return jax.vjp(plain, *args)[1](grad)

    run.defvjp(run_fwd, run_bwd)
    return run(*args)


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


def mla_kernel_for(kernels: Kernels, q: jax.Array, latent_cache: jax.Array, value_dim: int):
    """The Pallas MLA kernel for these shapes under `kernels.mla_kernel` (q `[B, N, Hq, Dk]`, cache `[B, L, Dk]`)."""
    _, n, heads, dk = q.shape
    if kernels.mla_kernel == "auto" and not (n * heads >= MOSAIC_MIN_ROWS and _is_hopper()):
        _log_once(
            ("mla_attention", f"auto-triton-{n}x{heads}"), "mla_attention: Triton kernel for %d x %d rows", n, heads
        )
        return _mla_kernel()
    if kernels.mla_kernel != "triton":
        if latent_cache.dtype == jnp.bfloat16 and dk % 64 == 0 and value_dim % 128 == 0:
            from pallas_kernels.mla_mosaic import mla_attention_mosaic

            tiling = kernels.mla_tiling
            _log_once(
                ("mla_attention", f"mosaic-{n}x{heads}-{tiling}"),
                "mla_attention: Mosaic kernel for %d x %d rows, tiling %s",
                n,
                heads,
                tiling or "default",
            )
            return functools.partial(mla_attention_mosaic, tiling=tiling) if tiling else mla_attention_mosaic
        _log_once(
            ("mla_attention", f"mosaic-unsupported-{dk}-{value_dim}-{latent_cache.dtype}"),
            "mla_attention: the Mosaic kernel takes a bf16 cache, 64 | Dk and 128 | value_dim, not %s %d/%d; "
            "running the Triton kernel",
            latent_cache.dtype,
            dk,
            value_dim,
        )
    return _mla_kernel()
