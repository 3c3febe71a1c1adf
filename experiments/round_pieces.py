"""One generation round cut into separately jitted pieces (engine.py's own functions), for timing.

Pieces of a DDTree / DFlash round: draft (flush pending features into the drafter cache + draft one block),
tree (build the trees and their ancestor masks), verify (target forward over the tree + one draw per node),
accept (walk, commit, compact the latent cache). Plus the whole round and one AR step, each as one jit, and
`synthetic_state`: a mid-generation loop state with random cache contents (bench_round, layer_profile).

Every piece donates the cache it updates and the timer threads the updated cache into the next call, so cache
writes happen in place as inside the generate loop. All other inputs stay those of the given state: repeated
calls redo the same round (same start, same tree), so the state never runs out of cache capacity.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax import engine
from ddtree_jax.models.dflash import DrafterCache
from ddtree_jax.sampling import request_keys

PIECES = ("draft", "tree", "verify", "accept")


def _no_caches(s: engine.LoopState) -> engine.LoopState:
    return s._replace(cache=None, dcache=None)


def timed_threaded(step: Callable, carry, *, warmup: int, repeats: int) -> tuple[float, object]:
    """Median seconds of `carry = step(carry)` (carry's buffers donated each call) -> (median, last carry)."""
    for _ in range(warmup):
        carry = jax.block_until_ready(step(carry))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(step(carry))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), carry


def time_round(
    target, drafter, spec: engine.GenSpec, s: engine.LoopState, *, warmup: int = 2, repeats: int = 5, pieces=True
):
    """Median seconds of each piece (unless pieces=False), of their sum and of the whole round (or of one AR step
    when spec.method == "ar") on state `s`. Consumes `s`'s caches (donated); returns (times, final state).

    Each jitted function returns everything its piece produces, so nothing is dead code to XLA.
    """
    tg, ts = nnx.split(target)
    rest, keys = _no_caches(s), request_keys(0, range(spec.batch))
    if spec.method == "ar":

        @functools.partial(jax.jit, donate_argnums=2)
        def ar(ts, s, cache):
            return engine.ar_round(nnx.merge(tg, ts), spec, s._replace(cache=cache))

        sec, out = timed_threaded(lambda st: ar(ts, rest, st.cache), s, warmup=warmup, repeats=repeats)
        return {"ar_step": sec}, out
    dg, ds = nnx.split(drafter)

    def merged(fn):
        return lambda ts, ds, *a: fn(nnx.merge(tg, ts), nnx.merge(dg, ds), *a)

    @functools.partial(jax.jit, donate_argnums=3)
    @merged
    def draft(t, d, s, dcache):
        return engine.draft(t, d, s._replace(dcache=dcache), spec.kernels)

    @jax.jit
    @merged
    def build(t, d, logits, root):
        return engine.build_trees(spec, d, logits, root)

    @functools.partial(jax.jit, donate_argnums=3)
    @merged
    def verify(t, d, s, cache, tree, mask, keys):
        fwd, post, finite = engine.verify(t, d, spec, s._replace(cache=cache), tree, mask, keys)
        return fwd.cache, fwd.features, post, finite

    @functools.partial(jax.jit, donate_argnums=2)
    def accept(s, tree, mask, cache, features, post, finite):
        return engine.accept(spec, s, tree, mask, features, cache, post, finite)

    @functools.partial(jax.jit, donate_argnums=(3, 4))
    @merged
    def whole(t, d, s, cache, dcache):
        return engine.spec_round(t, d, spec, s._replace(cache=cache, dcache=dcache))

    def timed(step, carry):
        return timed_threaded(step, carry, warmup=warmup, repeats=repeats)

    times, out = {}, s
    if pieces:
        times["draft"], (logits, dcache) = timed(lambda c: draft(ts, ds, rest, c[1]), (None, s.dcache))
        times["tree"], (tree, mask) = timed(lambda _: build(ts, ds, logits, s.root), None)
        times["verify"], (cache, features, post, finite) = timed(
            lambda c: verify(ts, ds, rest, c[0], tree, mask, keys), (s.cache,)
        )
        times["accept"], out = timed(
            lambda st: accept(rest, tree, mask, st.cache, features, post, finite), s._replace(cache=cache)
        )
        times["sum_of_pieces"] = sum(times[p] for p in PIECES)
        out = out._replace(dcache=dcache)
    times["round"], out = timed(lambda st: whole(ts, ds, rest, st.cache, st.dcache), out)
    return times, out


def synthetic_state(target, drafter, spec: engine.GenSpec, context: int) -> engine.LoopState:
    """A mid-generation loop state with `context` tokens in every cache (random contents) and a few pending
    drafter features, built on device."""
    c = target.config
    d = drafter.config.num_draft if drafter is not None else 0
    b, cap = spec.batch, engine.cache_capacity(spec, d)
    pend = min(4, d + 1) if drafter is not None else 0
    keys = iter(jax.random.split(jax.random.key(1), c.num_hidden_layers + 4))

    @functools.partial(jax.jit, static_argnums=(1,))
    def normal(k, shape):
        return jax.random.normal(k, shape, jnp.bfloat16)

    zeros = jnp.zeros((b,), jnp.int32)
    s = engine.LoopState(
        out=jnp.zeros((b, spec.max_new_tokens + d + 1), jnp.int32),
        n_out=zeros + 1,
        start=zeros + context,
        root=jax.random.randint(next(keys), (b,), 3, c.vocab_size - 2, jnp.int32),
        done=jnp.zeros((b,), bool),
        cache=[normal(next(keys), (b, cap, c.latent_dim)) for _ in range(c.num_hidden_layers)],
        dcache=None,
        ctx_len=zeros + context - pend,
        pend_feats=None,
        pend_count=zeros + pend,
        keys=request_keys(2, range(b)),
        rounds=zeros,
        accept_hist=jnp.zeros((b, d + 2), jnp.int32),
        bad_round=zeros - 1,
    )
    if drafter is None:
        return s
    dc = drafter.config
    shape = (dc.num_hidden_layers, b, cap, dc.num_key_value_heads, dc.head_dim)
    width = len(dc.target_layer_ids) * c.hidden_size
    return s._replace(
        dcache=DrafterCache(normal(next(keys), shape), normal(next(keys), shape)),
        pend_feats=normal(next(keys), (b, d + 1, width)),
    )
