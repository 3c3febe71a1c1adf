"""The whole generation as one jit-compiled XLA program: prefill, then a `lax.while_loop` of rounds.

Methods share caches and kernels so comparisons are fair:
  * `ar`     - one target step per round.
  * `dflash` - draft one block, verify the greedy chain (a tree whose node i has parent i - 1).
  * `ddtree` - draft one block, build the best `budget`-node tree on device, verify it with the ancestor mask,
               walk it, commit the accepted path and compact the latent cache.

Invariants at the top of a round, per row b:
  out[b, :n_out]   generated tokens; out[b, n_out-1] == root[b] (the bonus token, not yet in the target cache)
  start[b]         target cache length == position of root == prompt_len + n_out - 1
  ctx_len[b] + pend_count[b] == start[b]; pend_feats hold the target features of the pending positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax import sharding
from ddtree_jax import tree as ddtree
from ddtree_jax.models.dflash import DFlashDrafter, DrafterCache
from ddtree_jax.models.kimi import ForwardOut, KimiForCausalLM, LatentCache
from ddtree_jax.sampling import sample, split_rows
from ddtree_jax.sizing import cache_slots
from pallas_kernels import dispatch
from pallas_kernels.mla_exact import MAX_BLOCK

METHODS = ("ar", "dflash", "ddtree")
DEFAULT_BUDGET = 16  # DDTree's node budget when none is given
EXACT_PREFILL_TOKENS = 4096  # prompt tokens of all rows per prefill pass under the exact numerics (`prefill_chunk`)


@dataclasses.dataclass(frozen=True)
class GenSpec:
    """Static shape and method parameters: one compiled program per distinct GenSpec."""

    method: str
    batch: int
    prompt_len: int  # padded prompt length P
    max_new_tokens: int
    budget: int = DEFAULT_BUDGET  # non-root tree nodes (ddtree); the chain uses D
    temperature: float = 0.0
    top_k: int = 0  # sampling: keep the k most likely tokens; 0 = all (`sampling.transform_logits`)
    top_p: float = 1.0  # sampling: keep the nucleus of this mass; 1 = all
    stop_ids: tuple[int, ...] = ()  # a row ends at its first token in these (included in its output)
    prefill_chunk: int = 512  # prompts longer than this are prefilled in chunks (absorbed MLA over the cache)
    kernels: dispatch.Kernels = dataclasses.field(default_factory=dispatch.Kernels.from_env)  # traced into the program

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} not one of {METHODS}")
        if min(self.budget, self.max_new_tokens, self.batch, self.prompt_len, self.prefill_chunk) < 1:
            raise ValueError(f"invalid GenSpec {self}")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got top_k={self.top_k}, top_p={self.top_p}")
        if self.temperature == 0.0 and (self.top_k or self.top_p < 1.0):
            raise ValueError("top_k and top_p need temperature > 0 (temperature 0 is greedy)")


class LoopState(NamedTuple):
    out: jax.Array  # [B, max_new + D + 1] int32 generated tokens
    n_out: jax.Array  # [B] int32
    start: jax.Array  # [B] int32
    root: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    cache: LatentCache
    dcache: DrafterCache | None
    ctx_len: jax.Array  # [B] int32 drafter cache length
    pend_feats: jax.Array | None  # [B, D+1, K*H]
    pend_count: jax.Array  # [B] int32
    keys: jax.Array  # [B] each row's own key (`sampling.request_keys`), split once per round
    rounds: jax.Array  # [B] int32 rounds in which the row was active
    accept_hist: jax.Array  # [B, D+2] int32 histogram of tokens committed per round (tau)
    bad_round: jax.Array  # [B] int32: first round whose target logits were not finite (0 = prefill), -1 if none


class GenOut(NamedTuple):
    tokens: jax.Array  # [B, max_new + D + 1]; row b valid up to n_out[b]
    n_out: jax.Array  # [B]
    rounds: jax.Array  # [B]
    accept_hist: jax.Array  # [B, D+2]
    bad_round: jax.Array  # [B] -1, or the round (0 = prefill) where the row stopped on NaN/inf logits


def num_draft(drafter: DFlashDrafter | None) -> int:
    return drafter.config.num_draft if drafter is not None else 0


def tree_size(spec: GenSpec, draft_len: int) -> int:
    """T: tokens verified per round (root + nodes)."""
    if spec.method == "ar":
        return 1
    return 1 + (draft_len if spec.method == "dflash" else spec.budget)


def prefill_chunk(spec: GenSpec) -> int:
    """Prompt tokens per prefill pass: `spec.prefill_chunk`; under the exact numerics at most EXACT_PREFILL_TOKENS
    over the batch's rows, but not below `mla_exact.MAX_BLOCK`: their attention writes a partial per (row, token group,
    context segment), so a pass's memory follows batch x chunk."""
    if not spec.kernels.exact:
        return spec.prefill_chunk
    return min(spec.prefill_chunk, max(MAX_BLOCK, EXACT_PREFILL_TOKENS // spec.batch))


def prefill_len(spec: GenSpec) -> int:
    """Slots the prefill writes: the prompt, rounded up to whole chunks when it is chunked."""
    chunk = prefill_chunk(spec)
    if spec.prompt_len <= chunk:
        return spec.prompt_len
    return -(-spec.prompt_len // chunk) * chunk


def cache_capacity(spec: GenSpec, draft_len: int) -> int:
    """Slots of the target and drafter caches: prompt + generated + one verify block + one slot of slack, rounded
    up to whole KV tiles (`sizing.cache_slots`)."""
    needed = max(prefill_len(spec), spec.prompt_len + spec.max_new_tokens + tree_size(spec, draft_len) + 1)
    return cache_slots(needed)


def _is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def _sample(spec: GenSpec, logits: jax.Array, keys: jax.Array) -> jax.Array:
    """logits `[B, ..., V]`, keys `[B]` -> tokens `[B, ...]` drawn as `spec` says: the one draw of prefill, `ar` and
    verify alike."""
    return sample(logits, keys, spec.temperature, spec.top_k, spec.top_p)


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x `[B, N, ...]`, idx `[B, M]` -> `[B, M, ...]`."""
    return jax.vmap(lambda a, i: a[i])(x, idx)


def compact_cache(cache: LatentCache, start: jax.Array, path: jax.Array) -> LatentCache:
    """Move the accepted tree entries to sit contiguously: cache[b, start+j] = cache[b, start+path[b, j]].

    path `[B, M]` is strictly increasing on its valid prefix (padding repeats entries past tau; what lands past
    start + tau is garbage beyond the valid length and is overwritten next round).
    """
    b, m = path.shape
    rows = jnp.arange(b)[:, None]
    src = start[:, None] + path
    dst = start[:, None] + jnp.arange(m)[None, :]
    return [c.at[rows, dst].set(c[rows, src], mode="drop") for c in cache]


def _finite_rows(logits: jax.Array) -> jax.Array:
    """`[B, ...]` -> `[B]` bool: every logit of the row is finite."""
    return jnp.all(jnp.isfinite(logits), axis=tuple(range(1, logits.ndim)))


def _commit(spec: GenSpec, s: LoopState, new_tokens: jax.Array, tau: jax.Array, finite: jax.Array):
    """Append up to tau of `new_tokens [B, M]` to `out`, truncating at a stop token or max_new_tokens.
    A row whose logits were not finite commits nothing and stops.

    Returns (out, n_out, done, n_new) for active rows; frozen rows keep their values.
    """
    m = new_tokens.shape[1]
    j = jnp.arange(m)[None, :]
    within = j < tau[:, None]
    stop = _is_stop(new_tokens, spec.stop_ids) & within
    first_stop = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, m + 1)
    room = spec.max_new_tokens - s.n_out
    n_new = jnp.minimum(jnp.minimum(tau, first_stop), room)
    n_new = jnp.where(s.done | ~finite, 0, n_new)
    slot = jnp.where(j < n_new[:, None], s.n_out[:, None] + j, s.out.shape[1])
    out = s.out.at[jnp.arange(s.out.shape[0])[:, None], slot].set(new_tokens, mode="drop")
    n_out = s.n_out + n_new
    done = s.done | ~finite | (first_stop <= n_new) | (n_out >= spec.max_new_tokens)
    return out, n_out, done, n_new


def prefill(
    target: KimiForCausalLM,
    drafter: DFlashDrafter | None,
    spec: GenSpec,
    prompts: jax.Array,
    prompt_len: jax.Array,
    keys: jax.Array,
) -> LoopState:
    """prompts `[B, P]` right-padded, prompt_len `[B]`, keys `[B]` (one per row) -> the loop state after the first
    generated token.

    Up to `prefill_chunk(spec)` tokens: one pass in the naive (per-head) MLA form (the absorbed form under
    `spec.kernels.exact`, so a prompt token's cache entry is the one decoding would write). Longer: a scan over
    chunks in the absorbed form, each attending to the cache the earlier chunks wrote, so attention memory stays
    chunk x context.
    """
    b = prompts.shape[0]
    d = num_draft(drafter)
    cap = cache_capacity(spec, d)
    zeros = jnp.zeros((b,), jnp.int32)
    cache = target.init_cache(b, cap)
    dcache = drafter.init_cache(b, cap) if drafter is not None else None
    chunk = min(spec.prompt_len, prefill_chunk(spec))
    n_chunks = prefill_len(spec) // chunk
    chunks = jnp.pad(prompts, ((0, 0), (0, n_chunks * chunk - prompts.shape[1])))
    chunks = chunks.reshape(b, n_chunks, chunk).transpose(1, 0, 2)  # [n_chunks, B, C]
    feature_layers = drafter.config.target_layer_ids if drafter is not None else ()

    def step(carry, i):
        cache, dcache, last = carry
        offset = i * chunk
        positions = jnp.broadcast_to(offset + jnp.arange(chunk, dtype=jnp.int32), (b, chunk))
        fwd = target(
            chunks[i],
            positions,
            cache,
            zeros + offset,
            feature_layers=feature_layers,
            naive=n_chunks == 1 and not spec.kernels.exact,  # exact: the absorbed form, as decode computes
            kernels=spec.kernels,
        )
        if drafter is not None:
            dcache = drafter.append_context(dcache, fwd.features, positions, zeros + offset)
        idx = prompt_len - 1 - offset  # the row's last prompt token, if it falls in this chunk
        here = (idx >= 0) & (idx < chunk)
        last = jnp.where(here[:, None], _gather_rows(fwd.hidden, jnp.clip(idx, 0, chunk - 1)[:, None])[:, 0], last)
        return (fwd.cache, dcache, last), None

    last0 = jnp.zeros((b, target.config.hidden_size), target.dtype)
    (cache, dcache, last), _ = jax.lax.scan(step, (cache, dcache, last0), jnp.arange(n_chunks))
    keys, sub = split_rows(keys)
    logits = target.logits(last, spec.kernels)
    first = _sample(spec, logits, sub)
    finite = _finite_rows(logits)
    out = jnp.zeros((b, spec.max_new_tokens + d + 1), jnp.int32).at[:, 0].set(first)
    done = _is_stop(first, spec.stop_ids) | (spec.max_new_tokens <= 1) | ~finite
    pend_feats = None
    if drafter is not None:
        width = len(drafter.config.target_layer_ids) * target.config.hidden_size
        pend_feats = jnp.zeros((b, d + 1, width), target.dtype)
    return LoopState(
        out=out,
        n_out=finite.astype(jnp.int32),
        start=prompt_len.astype(jnp.int32),
        root=first,
        done=done,
        cache=cache,
        dcache=dcache,
        ctx_len=prompt_len.astype(jnp.int32),
        pend_feats=pend_feats,
        pend_count=zeros,
        keys=keys,
        rounds=zeros,
        accept_hist=jnp.zeros((b, d + 2), jnp.int32),
        bad_round=jnp.where(finite, -1, 0),
    )


def _finish_round(spec: GenSpec, s: LoopState, new_tokens, tau, bonus, cache, finite, **updates) -> LoopState:
    """Commit, advance positions for active rows, record stats; rows with non-finite logits stop here."""
    out, n_out, done, _ = _commit(spec, s, new_tokens, tau, finite)
    active = ~s.done
    tau_a = jnp.where(active, tau, 0)
    hist = s.accept_hist.at[jnp.arange(tau.shape[0]), tau].add(active.astype(jnp.int32))
    return s._replace(
        out=out,
        n_out=n_out,
        done=done,
        start=s.start + tau_a,
        root=jnp.where(active, bonus, s.root),
        cache=cache,
        rounds=s.rounds + active.astype(jnp.int32),
        accept_hist=hist,
        bad_round=jnp.where(active & ~finite, s.rounds + 1, s.bad_round),
        **updates,
    )


def ar_round(target: KimiForCausalLM, spec: GenSpec, s: LoopState) -> LoopState:
    """One autoregressive step for every row."""
    keys, sub = split_rows(s.keys)
    with jax.named_scope("step"):
        fwd = target(s.root[:, None], s.start[:, None], s.cache, s.start, kernels=spec.kernels)
        logits = target.logits(fwd.hidden[:, 0], spec.kernels)
        nxt = _sample(spec, logits, sub)
        tau = jnp.ones_like(nxt)
        return _finish_round(spec, s, nxt[:, None], tau, nxt, fwd.cache, _finite_rows(logits), keys=keys)


def draft(
    target: KimiForCausalLM, drafter: DFlashDrafter, s: LoopState, kernels: dispatch.Kernels | None = None
) -> tuple[jax.Array, DrafterCache]:
    """Flush pending context features into the drafter cache, then draft one block -> logits `[B, D, V]`. kernels:
    the drafter's kernel selection (None: `Kernels.from_env()`; `spec_round` passes its `GenSpec.kernels`)."""
    kernels = dispatch.Kernels.or_env(kernels)
    c = drafter.config
    b = s.root.shape[0]
    pend_pos = s.ctx_len[:, None] + jnp.arange(s.pend_feats.shape[1])[None, :]
    dcache = drafter.append_context(s.dcache, s.pend_feats, pend_pos, s.ctx_len)
    ctx_len = s.ctx_len + s.pend_count
    block = jnp.full((b, c.block_size), c.mask_token_id, jnp.int32).at[:, 0].set(s.root)
    positions = s.start[:, None] + jnp.arange(c.block_size)[None, :]
    hidden = drafter(target.embed(block), positions, dcache, ctx_len, kernels)
    draft_head = dataclasses.replace(kernels, exact=False)  # draft logits need no invariance, only speed
    return target.head_logits(hidden[:, 1:], draft_head) * c.output_multiplier, dcache


def build_trees(
    spec: GenSpec, drafter: DFlashDrafter, draft_logits: jax.Array, root: jax.Array
) -> tuple[ddtree.Tree, jax.Array]:
    """Per-row tree from draft logits `[B, D, V]` and its ancestor-or-self mask `[B, T, T]`: the greedy chain
    (dflash) or the best-`budget` tree (ddtree; built by the one-launch Pallas kernel on GPU, see dispatch)."""
    if spec.method == "dflash":
        tree = jax.vmap(ddtree.chain_tree)(draft_logits, root)
        return tree, _masks(tree, drafter.config.num_draft)
    # = ddtree.build_tree per row; vocab-parallel when the active mesh splits the lm_head vocabulary.
    k = min(spec.budget, draft_logits.shape[-1])
    lp_k, ids_k = sharding.topk_logsoftmax(draft_logits, k, spec.kernels.topk_chunk)
    *fields, mask = dispatch.build_tree(spec.kernels, lp_k, ids_k, root, spec.budget, _reference_trees)
    return ddtree.Tree(*fields), mask


def _masks(tree: ddtree.Tree, max_depth: int) -> jax.Array:
    """`[B, T, T]` ancestor-or-self masks of a batch of trees of depth <= max_depth."""
    return jax.vmap(lambda t: ddtree.ancestor_mask(t, max_depth))(tree)


def _reference_trees(lp_k: jax.Array, ids_k: jax.Array, root: jax.Array, budget: int):
    """Plain-JAX `dispatch.build_tree`: the Tree fields `[B, T]` and masks `[B, T, T]`."""
    tree = jax.vmap(lambda lp, ids, r: ddtree.build_tree_from_topk(lp, ids, r, budget))(lp_k, ids_k, root)
    return (*tree, _masks(tree, lp_k.shape[1]))


def verify(
    target: KimiForCausalLM,
    drafter: DFlashDrafter,
    spec: GenSpec,
    s: LoopState,
    tree: ddtree.Tree,
    mask: jax.Array,
    keys: jax.Array,
) -> tuple[ForwardOut, jax.Array, jax.Array]:
    """Target forward over the trees (mask `[B, T, T]` from `build_trees`, positions start + depth), then one
    target draw per node (row b's from keys[b]). Returns (forward, post `[B, T]`, finite `[B]`: every logit of the
    row was finite).
    """
    positions = s.start[:, None] + tree.depth
    layers = drafter.config.target_layer_ids
    fwd = target(tree.tokens, positions, s.cache, s.start, mask, feature_layers=layers, kernels=spec.kernels)
    logits = target.logits(fwd.hidden, spec.kernels)
    return fwd, _sample(spec, logits, keys), _finite_rows(logits)


def accept(
    spec: GenSpec,
    s: LoopState,
    tree: ddtree.Tree,
    mask: jax.Array,
    features: jax.Array,
    cache: LatentCache,
    post: jax.Array,
    finite: jax.Array,
) -> LoopState:
    """Walk the verified trees (mask `[B, T, T]` as verified), commit the accepted path + bonus, compact the target
    cache (already holding the tree's entries at start..start+T-1) and queue the accepted nodes' features for the
    drafter."""
    d = s.pend_feats.shape[1] - 1
    path, tau, bonus = jax.vmap(lambda t, p, m: ddtree.follow_verified_tree(t, p, d, m))(tree, post, mask)
    path = jnp.maximum(path, 0)
    # Emitted this round: the accepted nodes after the root, then the bonus token.
    accepted = _gather_rows(tree.tokens, jnp.concatenate([path[:, 1:], path[:, :1]], axis=1))
    new_tokens = jnp.where(jnp.arange(d + 1)[None, :] == (tau - 1)[:, None], bonus[:, None], accepted)
    active = ~s.done
    cache = compact_cache(cache, s.start, jnp.where(active[:, None], path, jnp.arange(d + 1)[None, :]))
    return _finish_round(
        spec,
        s,
        new_tokens,
        tau,
        bonus,
        cache,
        finite,
        ctx_len=jnp.where(active, s.ctx_len + s.pend_count, s.ctx_len),
        pend_feats=_gather_rows(features, path),
        pend_count=jnp.where(active, tau, 0),
    )


def spec_round(target: KimiForCausalLM, drafter: DFlashDrafter, spec: GenSpec, s: LoopState) -> LoopState:
    """draft -> tree -> verify -> walk -> commit + compact, for every row (each under its `jax.named_scope`, so a
    device profile can attribute every kernel: experiments/breakdown.py)."""
    keys, sub = split_rows(s.keys)
    with jax.named_scope("draft"):
        draft_logits, dcache = draft(target, drafter, s, spec.kernels)
    with jax.named_scope("tree"):
        tree, mask = build_trees(spec, drafter, draft_logits, s.root)
    with jax.named_scope("verify"):
        fwd, post, finite = verify(target, drafter, spec, s, tree, mask, sub)
    with jax.named_scope("accept"):
        return accept(spec, s._replace(keys=keys, dcache=dcache), tree, mask, fwd.features, fwd.cache, post, finite)


def generate(
    target: KimiForCausalLM,
    drafter: DFlashDrafter | None,
    spec: GenSpec,
    prompts: jax.Array,
    prompt_len: jax.Array,
    keys: jax.Array,
) -> GenOut:
    """Prefill + rounds until every row hit max_new_tokens or a stop token; keys `[B]`, one per row
    (`sampling.request_keys`). Pure; jit it (see `compile_generate`)."""
    with jax.named_scope("prefill"):
        s = prefill(target, drafter, spec, prompts, prompt_len, keys)

    def body(st: LoopState) -> LoopState:
        if spec.method == "ar":
            return ar_round(target, spec, st)
        return spec_round(target, drafter, spec, st)

    s = jax.lax.while_loop(lambda st: ~jnp.all(st.done), body, s)
    return GenOut(s.out, s.n_out, s.rounds, s.accept_hist, s.bad_round)


def matmul_precision(dtype) -> str | None:
    """The matmul precision a model of `dtype` compiles under: "highest" for float32 (a float32 model computes in
    float32; XLA's GPU default would run its f32 matmuls in TF32), else None (the ambient setting)."""
    return "highest" if dtype == jnp.float32 else None


def compile_generate(target: KimiForCausalLM, drafter: DFlashDrafter | None, spec: GenSpec):
    """AOT-compile `generate` for `spec`: returns (compiled, target_state, drafter_state).

    Call as `compiled(target_state, drafter_state, prompts, prompt_len, keys)`, keys `[batch]`
    (`sampling.request_keys`).
    """
    if spec.method != "ar" and drafter is None:
        raise ValueError(f"method {spec.method!r} needs a drafter")
    tg, ts = nnx.split(target)
    dg, ds = nnx.split(drafter) if drafter is not None else (None, None)

    def run(t_state, d_state, prompts, prompt_len, keys):
        t = nnx.merge(tg, t_state)
        d = nnx.merge(dg, d_state) if dg is not None else None
        return generate(t, d, spec, prompts, prompt_len, keys)

    precision = matmul_precision(target.dtype)
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        compiled = jax.jit(run).lower(ts, ds, *call_shapes(spec)).compile(compiler_options(spec.kernels))
    return compiled, ts, ds


def call_shapes(spec: GenSpec) -> tuple:
    """The shapes of a `spec` program's per-call arguments: prompts `[B, P]` and prompt_len `[B]` int32, keys `[B]`."""
    return (
        jax.ShapeDtypeStruct((spec.batch, spec.prompt_len), jnp.int32),
        jax.ShapeDtypeStruct((spec.batch,), jnp.int32),
        jax.eval_shape(lambda: jax.random.split(jax.random.key(0), spec.batch)),
    )


def compiler_options(kernels: dispatch.Kernels) -> dict[str, bool] | None:
    """XLA options of a program: under the exact numerics every bf16 result is rounded where the program says so.
    XLA otherwise may keep an intermediate in f32 inside a fusion, and which values share a fusion depends on the
    shapes, so a token's numerics would follow the batch and block size (docs/exactness.md)."""
    return {"xla_allow_excess_precision": False} if kernels.exact else None
