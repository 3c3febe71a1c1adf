"""One generation round cut into separately jitted pieces (engine.py's own functions), for timing.

Pieces of a DDTree / DFlash round: draft (flush pending features into the drafter cache + draft one block),
tree (build the trees and their ancestor masks), verify (target forward over the tree + one draw per node),
accept (walk, commit, compact the latent cache). Plus the whole round and one AR step, each as one jit.

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
from flax import nnx

from ddtree_jax import engine
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
