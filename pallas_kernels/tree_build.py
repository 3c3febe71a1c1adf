"""DDTree construction in one Pallas GPU kernel: the best-first heap of spec dflash_ddtree.md §3.2 plus the
ancestor mask of §3.5, one program per sequence.

Semantics are those of `ddtree_jax.tree.build_tree_from_topk` followed by `ddtree_jax.tree.ancestor_mask` (the
plain-JAX reference, which runs as dozens of small kernels). The drafter's tree is tiny (T <= 65 slots, D <= 16
depths), so the build is launch-bound, not work-bound: here it is one launch.

Inside a program, registers hold a frontier of at most T entries (score, parent score, depth, rank, parent slot
and the rank tuple, one `[F]` vector per depth level). Each of the `budget` pops takes the best entry by (score
desc, rank tuple lexicographic asc), appends it as the next node, and pushes its next sibling into the popped
slot and its first child into a fresh slot; every rank tuple has exactly one generator, so the pops are the
global top-`budget` prefixes in the reference's order. Scores add in f32 exactly as the reference does
(score(child) = score(parent) + lp), so ties and order match bit for bit. The mask row of a new node is its
parent's row plus itself.

Lowering: Pallas-Triton (scalar-heavy, sequential control flow over small vectors; nothing here for wgmma/TMA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_NEG_INF = float("-inf")


def _kernel(lp_ref, ids_ref, root_ref, tok_ref, par_ref, dep_ref, val_ref, score_ref, mask_ref, *, n_depth, k, budget):
    """One sequence. lp/ids `[Dp, Kp]` (padding -inf / 0), root scalar -> `[Tp]` node arrays and `[Tp, Tp]` mask."""
    dp, kp = lp_ref.shape
    tp = tok_ref.shape[0]
    lp, ids = lp_ref[...], ids_ref[...]
    row_d = lax.broadcasted_iota(jnp.int32, (dp, kp), 0)
    col_k = lax.broadcasted_iota(jnp.int32, (dp, kp), 1)
    slot = lax.broadcasted_iota(jnp.int32, (tp,), 0)  # frontier slots and node slots share the width Tp
    mask_row = lax.broadcasted_iota(jnp.int32, (tp, tp), 0)
    mask_col = lax.broadcasted_iota(jnp.int32, (tp, tp), 1)

    def lp_at(d, r):
        return jnp.max(jnp.where((row_d == d) & (col_k == r), lp, _NEG_INF))

    def id_at(d, r):
        return jnp.sum(jnp.where((row_d == d) & (col_k == r), ids, 0))

    zeros = jnp.zeros((tp,), jnp.int32)
    first = slot == 0
    frontier = (
        jnp.where(first, lp_at(0, 0), _NEG_INF),  # score
        jnp.zeros((tp,), jnp.float32),  # parent score
        jnp.where(first, 1, 0),  # depth
        zeros,  # rank at its depth
        zeros,  # parent node slot (0 = root)
        tuple(zeros for _ in range(n_depth)),  # rank tuple, one vector per level
    )
    nodes = (
        jnp.where(first, root_ref[...], 0),  # tokens
        jnp.full((tp,), -1, jnp.int32),  # parents (the root has none)
        zeros,  # depth
        jnp.where(first, 1, 0),  # valid
        jnp.where(first, 0.0, _NEG_INF),  # score
        (mask_row == mask_col).astype(jnp.int32),  # ancestor-or-self; padding rows stay self only
    )

    def pop(n, carry):
        (f_score, f_pscore, f_depth, f_rank, f_parent, f_path), (tok, par, dep, val, score, anc) = carry
        best_score = jnp.max(f_score)
        cand = f_score == best_score
        for level in range(n_depth):  # lexicographic tie-break on rank tuples (frontier entries never nest)
            low = jnp.min(jnp.where(cand, f_path[level], k))
            cand = cand & (f_path[level] == low)
        best = jnp.min(jnp.where(cand, slot, tp))
        sel = slot == best
        get = lambda v: jnp.sum(jnp.where(sel, v, jnp.zeros_like(v)))
        d, r, p, ps = get(f_depth), get(f_rank), get(f_parent), get(f_pscore)
        path = tuple(get(v) for v in f_path)
        ok = best_score > _NEG_INF
        i = n + 1  # node slot (slot 0 is the root)
        here = slot == i
        tok = jnp.where(here, jnp.where(ok, id_at(d - 1, r), 0), tok)
        par = jnp.where(here, jnp.where(ok, p, -1), par)
        dep = jnp.where(here, jnp.where(ok, d, 0), dep)
        val = jnp.where(here, ok.astype(jnp.int32), val)
        score = jnp.where(here, jnp.where(ok, best_score, _NEG_INF), score)
        parent_row = jnp.max(jnp.where(mask_row == p, anc, 0), axis=0)
        new_row = jnp.where(ok, parent_row, 0) | here.astype(jnp.int32)
        anc = jnp.where(mask_row == i, new_row[None, :], anc)

        # Next sibling into the popped slot; first child into a fresh frontier slot, n + 1 = i after n pops.
        sib_score = jnp.where(ok & (r + 1 < k), ps + lp_at(d - 1, r + 1), _NEG_INF)
        child_score = jnp.where(ok & (d < n_depth), best_score + lp_at(d, 0), _NEG_INF)
        fresh = here
        f_score = jnp.where(fresh, child_score, jnp.where(sel, sib_score, f_score))
        f_pscore = jnp.where(fresh, best_score, f_pscore)
        f_depth = jnp.where(fresh, d + 1, f_depth)
        f_rank = jnp.where(fresh, 0, jnp.where(sel, r + 1, f_rank))
        f_parent = jnp.where(fresh, i, f_parent)
        f_path = tuple(
            jnp.where(fresh, jnp.where(level < d, path[level], 0), jnp.where(sel & (level == d - 1), r + 1, v))
            for level, v in enumerate(f_path)
        )
        return (f_score, f_pscore, f_depth, f_rank, f_parent, f_path), (tok, par, dep, val, score, anc)

    _, (tok, par, dep, val, score, anc) = lax.fori_loop(0, budget, pop, (frontier, nodes))
    tok_ref[...], par_ref[...], dep_ref[...], val_ref[...], score_ref[...] = tok, par, dep, val, score
    mask_ref[...] = anc


def default_warps(tp: int) -> int:
    """Warps per program for Tp node slots. One warp keeps each pop's reductions inside the warp (fastest up to
    Tp = 64); at Tp = 128 the `[Tp, Tp]` mask no longer fits one warp's registers, so 4 warps share it (timings:
    experiments/results/bench_tree_warps.md)."""
    return 1 if tp <= 64 else 4


@functools.partial(jax.jit, static_argnames=("budget", "interpret", "num_warps"))
def build_tree_pallas(
    lp_k: jax.Array,
    ids_k: jax.Array,
    root: jax.Array,
    budget: int,
    *,
    interpret: bool = False,
    num_warps: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Batched DDTree from per-depth top-K log-probs lp_k `[B, D, K]` (rows sorted descending) and ids_k `[B, D, K]`.

    Returns tokens, parents, depth `[B, T]` int32, valid `[B, T]` bool, score `[B, T]` f32 (the fields of
    `ddtree_jax.tree.Tree`, T = budget + 1) and the ancestor-or-self mask `[B, T, T]` bool. `budget` is static;
    num_warps None: `default_warps`.
    """
    b, n_depth, k = lp_k.shape
    t = budget + 1
    tp, dp, kp = (pl.next_power_of_2(x) for x in (t, n_depth, k))
    lp = jnp.pad(lp_k.astype(jnp.float32), ((0, 0), (0, dp - n_depth), (0, kp - k)), constant_values=_NEG_INF)
    ids = jnp.pad(ids_k.astype(jnp.int32), ((0, 0), (0, dp - n_depth), (0, kp - k)))
    vec = lambda dtype: jax.ShapeDtypeStruct((b, tp), dtype)
    vec_spec = pl.BlockSpec((None, tp), lambda i: (i, 0))
    kernel = functools.partial(_kernel, n_depth=n_depth, k=k, budget=budget)
    tok, par, dep, val, score, mask = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[
            pl.BlockSpec((None, dp, kp), lambda i: (i, 0, 0)),
            pl.BlockSpec((None, dp, kp), lambda i: (i, 0, 0)),
            pl.BlockSpec((None,), lambda i: (i,)),
        ],
        out_specs=[vec_spec] * 5 + [pl.BlockSpec((None, tp, tp), lambda i: (i, 0, 0))],
        out_shape=[vec(jnp.int32)] * 4 + [vec(jnp.float32), jax.ShapeDtypeStruct((b, tp, tp), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or default_warps(tp), num_stages=1),
        interpret=interpret,
        name="ddtree_build",
    )(lp, ids, root.astype(jnp.int32))
    return tok[:, :t], par[:, :t], dep[:, :t], val[:, :t] != 0, score[:, :t], mask[:, :t, :t] != 0
