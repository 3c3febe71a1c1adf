"""Device mesh, the one table of sharding rules, and the parallel pieces the models call when a mesh is active.

Mesh axes: `data` (batch), `expert` and `tensor`. `make_mesh("expert=8,tensor=1")`; default: every local
device on `expert`. The same jitted engine runs on sharded arrays; only these places know about the mesh:

* `LOGICAL_AXES` (below): every weight (by the logical axes of its declaration, `models/params.py`) and cache
  gets its `PartitionSpec` from here.
* `moe_swiglu`: expert parallelism for the routed experts with `jax.shard_map` (each device runs the dispatch
  kernel on its own E/N experts, tokens routed elsewhere get weight 0, then one `psum`).
* `topk_logsoftmax`: per-depth top-K of the draft distribution from vocab-sharded logits (local top-K and
  local log-Z per shard, two all-gathers of `[B, D, tensor * K]` at most, a global merge).
* `mla_output`, `drafter_attention`: the attention kernels per device on their own heads (a custom call GSPMD
  cannot split; MLA's takes its W_UV product's weight too, the drafter's its layer's projection weights, split by
  heads).
Everything else (the head-parallel projections, dense / shared FFN, the vocab-parallel lm_head, the greedy
argmax) is left to XLA's GSPMD partitioner, which inserts the all-reduces the shardings imply.

Layout and why:
* Routed experts: dim 0 split over `expert` x `tensor`, so no expert is ever stored twice. With
  `expert=8,tensor=1` each GPU of an 8-GPU node holds 48 of K2's 384 experts (71 GB INT4).
* MLA heads (`q_b_proj` out, `w_uk`/`w_uv` heads, `o_proj` in), dense-layer and shared-expert inner dims and the
  lm_head vocabulary: split over `tensor`; replicated over `expert` (each expert-group runs them in full).
* Embedding: replicated (2.35 GB for K2). A lookup touches B*N rows; a vocab-sharded table would cost an
  all-reduce of `[B, N, H]` per forward for memory we can spare.
* Router, norms, `q_a_proj`, `kv_a_proj_with_mqa`: replicated (small, and every head needs their full output).
* Latent cache `[B, L, 576]`: split over `data` (batch), replicated over `expert` and `tensor`. MLA's latent is
  shared by all heads (one 576-wide entry per token), so a head-parallel rank needs all of it; splitting its
  channels would turn each attention into a reduction across ranks. Rows are independent, so `data` splits it.
* Drafter: tensor-parallel like the target's attention and FFN (query and KV heads, FFN inner dim; its context
  K/V cache split on KV heads). K2.6's drafter is 6 layers of hidden 7168 (~3.4B params, 6.9 GB bf16): read
  in full by every rank each round it would cost more than the rank's share of the target at decode sizes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from ddtree_jax import topk
from ddtree_jax.mesh_spec import MESH_AXES, MeshSpecError, parse_mesh_spec
from ddtree_jax.models.params import ParamPath, WeightSpec, param_table
from pallas_kernels import dispatch, reference
from pallas_kernels.reference import DrafterAttentionWeights, DrafterSwigluWeights

# Logical axis -> mesh axes. The one place that says which mesh axis splits what.
LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "batch": ("data",),
    "experts": ("expert", "tensor"),
    "heads": ("tensor",),
    "ffn": ("tensor",),
    "vocab": ("tensor",),
}

# Caches: logical axes of one target layer's latent cache `[B, L, 576]` and the drafter's K/V
# `[layers, B, L, kv_heads, head_dim]`.
LATENT_CACHE_AXES = ("batch", None, None)
DRAFTER_CACHE_AXES = (None, "batch", None, "heads", None)


def make_mesh(spec: str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, expert, tensor)` mesh over `devices` (default: all) from a spec; None: all on `expert`."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": 1, "expert": len(devices), "tensor": 1} if spec is None else parse_mesh_spec(spec)
    if math.prod(sizes.values()) != len(devices):
        raise MeshSpecError(
            f"--mesh {spec!r}: axis sizes multiply to {math.prod(sizes.values())}, but there are {len(devices)} devices"
        )
    grid = np.asarray(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def resolve_mesh(mesh: Mesh | str | None) -> Mesh | None:
    """A Mesh as is; a spec string -> `make_mesh`; None -> all devices on `expert` if there are several, else
    None (the single-device program, untouched)."""
    if isinstance(mesh, Mesh):
        return mesh
    if mesh is None and jax.device_count() == 1:
        return None
    return make_mesh(mesh)


# ---- rules -> PartitionSpec -------------------------------------------------------------------


def _axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def logical_spec(mesh: Mesh, logical: Sequence[str | None], shape: Sequence[int], what: str = "array") -> PartitionSpec:
    """Logical axes per dim -> PartitionSpec; a split dim must divide by its mesh axes' product."""
    spec = []
    for dim, (name, size) in enumerate(zip(logical, shape, strict=True)):
        axes = LOGICAL_AXES[name] if name is not None else ()
        if axes and size % _axis_size(mesh, axes):
            raise MeshSpecError(
                f"{what}: dim {dim} ({name}) has size {size}, not divisible by "
                f"{' x '.join(f'{a}={mesh.shape[a]}' for a in axes)}"
            )
        spec.append(axes or None)
    return PartitionSpec(*spec)


def param_sharding(mesh: Mesh, path: ParamPath, spec: WeightSpec) -> NamedSharding:
    """Where the weight declared by `spec` at `path` lives: its logical axes through `LOGICAL_AXES`."""
    dotted = ".".join(str(p) for p in path)
    return NamedSharding(mesh, logical_spec(mesh, spec.logical_axes, spec.shape, dotted))


def sharding_fn(mesh: Mesh):
    """`(path, spec) -> NamedSharding` for `checkpoint.load_target` / `restore_converted`."""
    return lambda path, spec: param_sharding(mesh, path, spec)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place every param of `model` (target or drafter) by its declaration, in place."""
    table = param_table(model)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jax.device_put(var.get_value(), param_sharding(mesh, path, table[path])))
    return model


# ---- the active mesh (set while tracing) ------------------------------------------------------

_active: Mesh | None = None


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Trace model code for `mesh` (None: the single-device code paths)."""
    global _active
    old, _active = _active, mesh
    try:
        yield
    finally:
        _active = old


def active_mesh() -> Mesh | None:
    return _active


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical axes under the active mesh; identity without one."""
    if _active is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(_active, logical_spec(_active, logical, x.shape)))


# ---- expert parallelism -----------------------------------------------------------------------


def moe_swiglu(kernels: dispatch.Kernels, x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s) -> jax.Array:
    """`dispatch.moe_swiglu` (same arguments and shapes: x `[T, H]`, ids/weights `[T, k]`, experts `[E, ...]`),
    expert-parallel under the active mesh.

    Each device of an `expert x tensor` group holds E/N consecutive experts and runs the dispatch kernel on them
    with ids made local; entries routed to other devices get id 0 and weight 0. Tokens are split over `data`
    (rows are independent) and replicated over the group; one `psum` of `[T, H]` over the group combines.
    """
    mesh = _active
    if mesh is None:
        return dispatch.moe_swiglu(kernels, x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s)
    group = LOGICAL_AXES["experts"]
    n_local = gate_up_q.shape[0] // _axis_size(mesh, group)
    tokens = PartitionSpec(LOGICAL_AXES["batch"], None)
    experts = PartitionSpec(group, None, None)

    def local(x, ids, w, *weights):
        first = jax.lax.axis_index(group) * n_local
        mine = (ids >= first) & (ids < first + n_local)
        y = dispatch.moe_swiglu(kernels, x, jnp.where(mine, ids - first, 0), jnp.where(mine, w, 0.0), *weights)
        return jax.lax.psum(y, group)

    # check_vma off: the Pallas kernel's outputs carry no varying-axes annotation.
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, experts, experts, experts, experts),
        out_specs=tokens,
        check_vma=False,
    )(x, topk_ids, topk_weights, gate_up_q, gate_up_s, down_q, down_s)


# ---- head-parallel attention ------------------------------------------------------------------


def mla_output(
    kernels: dispatch.Kernels,
    q,
    latent_cache,
    prefix_len,
    tree_mask,
    w_uv,
    scale: float,
    value_dim: int = 512,
    causal: bool = False,
    out_dtype: DTypeLike = jnp.float32,
) -> jax.Array:
    """`dispatch.mla_output` (q `[B, N, Hq, 576]`, cache `[B, L, 576]`, prefix_len `[B]`, mask `[B, N, N]`, w_uv
    `[Hq, V, 512]` -> `[B, N, Hq, V]` in out_dtype), run per device on its heads under the active mesh: heads (of q,
    w_uv and the output) split over `tensor`, rows over `data`, the latent cache whole on every head shard. No
    collective: the kernels (custom calls GSPMD cannot split) see only local heads, and the o_proj all-reduce after
    them is GSPMD's."""
    mesh = _active
    args = (q, latent_cache, prefix_len, tree_mask, w_uv)
    if mesh is None:
        return dispatch.mla_output(kernels, *args, scale, value_dim, causal, out_dtype)
    batch = LOGICAL_AXES["batch"]
    heads = PartitionSpec(batch, None, LOGICAL_AXES["heads"], None)
    rows = PartitionSpec(batch, None, None)
    return jax.shard_map(
        lambda *a: dispatch.mla_output(kernels, *a, scale, value_dim, causal, out_dtype),
        mesh=mesh,
        in_specs=(heads, rows, PartitionSpec(batch), rows, PartitionSpec(LOGICAL_AXES["heads"], None, None)),
        out_specs=heads,
        check_vma=False,  # as in moe_swiglu
    )(*args)


def drafter_attention(
    kernels: dispatch.Kernels,
    x: jax.Array,
    weights: DrafterAttentionWeights,
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
    """`dispatch.drafter_attention` (x `[B, S, H]`, the layer's weights, stacked cache `[layers, B, L, kvh, hd]`,
    ctx_len `[B]`, RoPE tables `[B, S, hd/2]` -> `[B, S, nh, hd]`), run per device on its heads under the active
    mesh: q_proj's columns, kv_proj's KV-head columns and the cache's KV heads split over `tensor` (each device's
    query heads read its own KV heads), rows over `data`, the norms replicated. No collective."""
    mesh = _active
    kw = {"layer": layer, "eps": eps, "scale": scale}
    if mesh is None:
        return dispatch.drafter_attention(kernels, x, weights, ctx_k, ctx_v, ctx_len, cos, sin, **kw)
    batch, heads = LOGICAL_AXES["batch"], LOGICAL_AXES["heads"]
    rows = PartitionSpec(batch, None, None)
    replicated = PartitionSpec(None)
    per_head = DrafterAttentionWeights(
        replicated, PartitionSpec(None, heads), replicated, replicated, PartitionSpec(None, None, None, heads)
    )
    cache = PartitionSpec(None, batch, None, heads, None)
    return jax.shard_map(
        lambda *a: dispatch.drafter_attention(kernels, *a, **kw),
        mesh=mesh,
        in_specs=(rows, per_head, cache, cache, PartitionSpec(batch), rows, rows),
        out_specs=PartitionSpec(batch, None, heads, None),
        check_vma=False,  # as in moe_swiglu
    )(x, weights, ctx_k, ctx_v, ctx_len, cos, sin)


def drafter_swiglu(kernels: dispatch.Kernels, x: jax.Array, weights: DrafterSwigluWeights, eps: float) -> jax.Array:
    """`dispatch.drafter_swiglu` (x `[B, S, H]` -> the SwiGLU `[B, S, I]` in x.dtype), run per device on its inner
    columns under the active mesh: gate's and up's columns split over `ffn`, rows over `data`, the norm replicated;
    the result stays split over `ffn`, as the down product's rows are. No collective."""
    mesh = _active
    if mesh is None:
        return dispatch.drafter_swiglu(kernels, x, weights, eps)
    batch, ffn = LOGICAL_AXES["batch"], LOGICAL_AXES["ffn"]
    split = DrafterSwigluWeights(PartitionSpec(None), PartitionSpec(None, ffn), PartitionSpec(None, ffn))
    return jax.shard_map(
        lambda x, w: dispatch.drafter_swiglu(kernels, x, w, eps),
        mesh=mesh,
        in_specs=(PartitionSpec(batch, None, None), split),
        out_specs=PartitionSpec(batch, None, ffn),
        check_vma=False,  # as in moe_swiglu
    )(x, weights)


def drafter_residual(kernels: dispatch.Kernels, residual: jax.Array, x: jax.Array, w: jax.Array) -> jax.Array:
    """`dispatch.drafter_residual` (residual + x @ w) without an active mesh. Under one, w's rows (o_proj's heads,
    down's inner columns) are split over devices and the product is a sum over them, so the plain expression runs:
    XLA's partial products and their all-reduce, then the add."""
    if _active is None:
        return dispatch.drafter_residual(kernels, residual, x, w)
    return reference.residual_update(residual, x, w)


# ---- vocab-parallel top-K for the DDTree build ------------------------------------------------


def topk_logsoftmax(logits: jax.Array, k: int, chunk: int) -> tuple[jax.Array, jax.Array]:
    """logits `[B, D, V]` -> (log-probs `[B, D, k]` f32 sorted descending, token ids `[B, D, k]` int32) of
    log_softmax(logits) at temperature 1; ties go to the lower token id, as `lax.top_k` does.

    Without an active mesh (or with tensor=1) this is `lax.top_k(log_softmax(logits))`, taken chunk-wise
    (`topk.top_k` with rows of `chunk`: the same result, many short rows for the GPU instead of D long ones). With
    the vocabulary split over `tensor` it never gathers `[B, D, V]`: each shard computes its local log-Z `[B, D]`; an
    all-gather of those gives the global log-Z (logsumexp of the local ones); each shard takes its local top-k
    of the log-probs; an all-gather of the `[B, D, tensor*k]` candidates and a global top-k finish.
    """
    mesh = _active
    vocab_axes = LOGICAL_AXES["vocab"]
    if mesh is None or _axis_size(mesh, vocab_axes) == 1:
        return topk.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k, chunk)
    v_local = logits.shape[-1] // _axis_size(mesh, vocab_axes)
    k_local = min(k, v_local)  # every global top-k entry is in its shard's top-k_local

    def local(lg):
        lg = lg.astype(jnp.float32)
        log_z_local = jax.nn.logsumexp(lg, axis=-1)  # [b, D]
        log_z = jax.nn.logsumexp(jax.lax.all_gather(log_z_local, vocab_axes, axis=-1), axis=-1)
        lp, ids = topk.top_k(lg - log_z[..., None], k_local, chunk)
        ids = ids + jax.lax.axis_index(vocab_axes) * v_local
        # Shard-major candidate order = ascending token id among equal log-probs, so top_k keeps the tie rule.
        lp_all = jax.lax.all_gather(lp, vocab_axes, axis=-1, tiled=True)
        ids_all = jax.lax.all_gather(ids, vocab_axes, axis=-1, tiled=True)
        best, pos = jax.lax.top_k(lp_all, k)
        return best, jnp.take_along_axis(ids_all, pos, axis=-1)

    batch = PartitionSpec(LOGICAL_AXES["batch"])
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=PartitionSpec(LOGICAL_AXES["batch"], None, vocab_axes),
        out_specs=(batch, batch),
        check_vma=False,  # the merged candidates are the same on every shard (all-gathered), as out_specs say
    )(logits)
