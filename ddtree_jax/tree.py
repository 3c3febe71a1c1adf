"""DDTree draft trees with static shapes (spec dflash_ddtree.md §3.1-3.6).

Single sequence; the engine vmaps over the batch. A tree has T = budget + 1 slots: slot 0 is the root (the
current bonus token), slots 1..budget are draft nodes in best-first order. When fewer than `budget` prefixes
exist (tiny vocab / depth) or some draft logits are -inf, the tail is padding: `valid` False, `parents` -1,
`depth` 0, `tokens` 0, `score` -inf. Padding is never a parent, never visible to other rows of the mask.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Tree(NamedTuple):
    """Flattened draft tree, all arrays of length T = budget + 1."""

    tokens: jax.Array  # [T] int32; tokens[0] = root token; padding 0
    parents: jax.Array  # [T] int32; parents[0] = -1, parents[i] < i for valid nodes; padding -1
    depth: jax.Array  # [T] int32; depth[0] = 0; padding 0
    valid: jax.Array  # [T] bool; valid[0] = True
    score: jax.Array  # [T] f32 prefix log-prob under the drafter marginals; root 0, padding -inf


class _Beam(NamedTuple):
    """One depth's beam, stored in lexicographic rank-tuple order (slot index = lex rank within the depth)."""

    score: jax.Array  # [W] f32, -inf for entries that are not real prefixes
    parent: jax.Array  # [W] int32 slot in the previous depth's beam (0 = root at depth 1)
    token: jax.Array  # [W] int32


def _beam_widths(depth: int, budget: int, k: int) -> list[int]:
    """Static beam width per depth: min(budget, k**d), i.e. never wider than the number of prefixes."""
    widths, w = [], 1
    for _ in range(depth):
        w = min(budget, w * k)
        widths.append(w)
    return widths


def _next_beam(prev: _Beam, lp_k: jax.Array, ids_k: jax.Array, width: int) -> _Beam:
    """Top-`width` children of `prev` ([W] beam; lp_k, ids_k [K] for this depth), laid out in lex order.

    With `prev` in lex order the flat candidate index slot * K + rank is the children's lex order, and
    `lax.top_k` breaks score ties by lower index, so the cut is exact for (score desc, rank tuple asc).
    """
    k = lp_k.shape[0]
    cand = (prev.score[:, None] + lp_k[None, :]).reshape(-1)  # [W*K]; -inf parents stay -inf
    _, idx = jax.lax.top_k(cand, width)
    idx = jnp.sort(idx)  # back to lex order
    return _Beam(score=cand[idx], parent=(idx // k).astype(jnp.int32), token=ids_k[idx % k])


def _lex_keys(beams: list[_Beam]) -> list[jax.Array]:
    """Sort keys [M] per depth level: the lex slot of each entry's ancestor at that level, -1 below its depth.

    Comparing these D keys in order is lexicographic comparison of the entries' rank tuples (prefix first).
    """
    n_depth = len(beams)
    per_beam = []  # per_beam[d][j] = slot of the depth-(j+1) ancestor of each depth-(d+1) entry
    for d, beam in enumerate(beams):
        anc = [jnp.arange(beam.score.shape[0], dtype=jnp.int32)]
        for j in range(d, 0, -1):
            anc.append(beams[j].parent[anc[-1]])
        per_beam.append(anc[::-1])
    keys = []
    for level in range(n_depth):
        parts = [
            per_beam[d][level] if level <= d else jnp.full(b.score.shape, -1, jnp.int32) for d, b in enumerate(beams)
        ]
        keys.append(jnp.concatenate(parts))
    return keys


def _prepend_root(
    root_token: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    depth: jax.Array,
    valid: jax.Array,
    score: jax.Array,
) -> Tree:
    """Tree from [N] node arrays (padding already canonical) plus the root at slot 0."""
    one = lambda value, dtype: jnp.full((1,), value, dtype)
    return Tree(
        tokens=jnp.concatenate([jnp.asarray(root_token, jnp.int32).reshape(1), tokens]),
        parents=jnp.concatenate([one(-1, jnp.int32), parents]),
        depth=jnp.concatenate([one(0, jnp.int32), depth]),
        valid=jnp.concatenate([one(True, bool), valid]),
        score=jnp.concatenate([one(0.0, jnp.float32), score]),
    )


def build_tree(draft_logits: jax.Array, root_token: jax.Array, budget: int) -> Tree:
    """Best-first DDTree of `budget` nodes from draft_logits [D, V] (row d-1 = depth d); T = budget + 1.

    log_softmax at temperature 1 in f32, K = min(budget, V) tokens per depth, then `build_tree_from_topk`.
    Tokens with -inf logit are never nodes. `budget` must be static.
    """
    k = min(budget, draft_logits.shape[-1])
    lp_k, ids_k = jax.lax.top_k(jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1), k)
    return build_tree_from_topk(lp_k, ids_k, root_token, budget)


def build_tree_from_topk(lp_k: jax.Array, ids_k: jax.Array, root_token: jax.Array, budget: int) -> Tree:
    """Best-first DDTree of `budget` nodes from per-depth top-K log-probs lp_k [D, K] (each row sorted
    descending, ties in the order the heap should rank them) and their token ids ids_k [D, K].

    Exactly the first `budget` pops of the reference heap (spec §3.2) with f32 scores score(child) =
    score(parent) + lp: nodes ordered by (score desc, rank tuple lexicographic asc), so parents precede
    children and ties match the heap bit for bit. Entries with lp = -inf are never nodes. For a vocab-sharded
    lm_head pass the merged global top-K directly. `budget` must be static.
    """
    n_depth, k = lp_k.shape
    lp_k, ids_k = lp_k.astype(jnp.float32), ids_k.astype(jnp.int32)

    widths = _beam_widths(n_depth, budget, k)
    w1 = widths[0]
    beams = [_Beam(score=lp_k[0, :w1], parent=jnp.zeros(w1, jnp.int32), token=ids_k[0, :w1])]
    for d in range(1, n_depth):
        beams.append(_next_beam(beams[-1], lp_k[d], ids_k[d], widths[d]))

    # All beam entries, indexed by a global id; parents as global ids (-1 = root).
    offsets = [sum(widths[:d]) for d in range(n_depth)]
    score = jnp.concatenate([b.score for b in beams])  # [M]
    token = jnp.concatenate([b.token for b in beams])
    depth = jnp.concatenate([jnp.full(w, d + 1, jnp.int32) for d, w in enumerate(widths)])
    parent_gid = jnp.concatenate([b.parent + (offsets[d - 1] if d else -1) for d, b in enumerate(beams)])

    gids = jnp.arange(score.shape[0], dtype=jnp.int32)
    order = jax.lax.sort((-score, *_lex_keys(beams), gids), num_keys=n_depth + 1)[-1]
    m = order.shape[0]
    if m < budget:  # fewer prefixes than budget in total: pad with one entry that is invalid by construction
        order = jnp.concatenate([order, jnp.full(budget - m, m, jnp.int32)])
        score, token = jnp.append(score, -jnp.inf), jnp.append(token, 0)
        depth, parent_gid = jnp.append(depth, 0), jnp.append(parent_gid, -1)
    order = order[:budget]

    flat_idx = jnp.arange(1, budget + 1, dtype=jnp.int32)
    flat_of_gid = jnp.zeros(score.shape[0], jnp.int32).at[order].set(flat_idx)
    valid = score[order] > -jnp.inf
    parent = jnp.where(parent_gid[order] < 0, 0, flat_of_gid[jnp.maximum(parent_gid[order], 0)])
    return _prepend_root(
        root_token,
        tokens=jnp.where(valid, token[order], 0),
        parents=jnp.where(valid, parent, -1),
        depth=jnp.where(valid, depth[order], 0),
        valid=valid,
        score=jnp.where(valid, score[order], -jnp.inf),
    )


def chain_tree(draft_logits: jax.Array, root_token: jax.Array, budget: int | None = None) -> Tree:
    """The DFlash chain: argmax token per depth of draft_logits [D, V], parents[i] = i - 1.

    T = budget + 1 with budget (static) defaulting to D; slots beyond min(budget, D) are padding.
    """
    n_depth = draft_logits.shape[0]
    budget = n_depth if budget is None else budget
    n, pad = min(budget, n_depth), max(budget - n_depth, 0)
    lp = jax.nn.log_softmax(draft_logits[:n].astype(jnp.float32), axis=-1)
    idx = jnp.arange(n, dtype=jnp.int32)
    padded = lambda x, value: jnp.concatenate([x, jnp.full((pad,), value, x.dtype)])
    return _prepend_root(
        root_token,
        tokens=padded(jnp.argmax(lp, axis=-1).astype(jnp.int32), 0),
        parents=padded(idx, -1),
        depth=padded(idx + 1, 0),
        valid=padded(jnp.ones(n, bool), False),
        score=padded(jnp.cumsum(jnp.max(lp, axis=-1)), -jnp.inf),
    )


def ancestor_mask(tree: Tree, max_depth: int | None = None) -> jax.Array:
    """[T, T] bool: vis[i, j] = node j is an ancestor-or-self of node i (padding rows: self only).

    Pointer jumping: ceil(log2(max_depth)) rounds of `anc |= anc[jump]; jump = jump[jump]`, where max_depth
    (static; default T - 1) bounds the tree depth (pass D).
    """
    t = tree.parents.shape[0]
    max_depth = t - 1 if max_depth is None else max_depth
    idx = jnp.arange(t, dtype=jnp.int32)
    jump = jnp.where(tree.parents < 0, idx, tree.parents)  # root and padding point at themselves
    anc = (idx[:, None] == idx[None, :]) | (jump[:, None] == idx[None, :])  # distance <= 1
    reach = 1
    while reach < max_depth:
        anc = anc | anc[jump]
        jump = jump[jump]
        reach *= 2
    return anc


def positions(tree: Tree, start: jax.Array | int) -> jax.Array:
    """[T] int32 RoPE positions start + depth (siblings share positions; padding gets `start`)."""
    return (jnp.asarray(start, jnp.int32) + tree.depth).astype(jnp.int32)


def follow_verified_tree(
    tree: Tree, post: jax.Array, max_depth: int, anc: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walk the verified tree from the root (spec §3.6) given post [T], the target's token at each node.

    The walk descends to the valid child c of the current node with tokens[c] == post[current] (unique: siblings
    have distinct tokens) for at most `max_depth` (static) steps. Computed without a loop: a node is reached iff
    every ancestor-or-self j != 0 matches (valid, tokens[j] == post[parents[j]]) and its depth <= max_depth; the
    reached nodes form one path and the deepest is where the walk stops. `anc` is `ancestor_mask(tree,
    max_depth)` when the caller already has it. Returns path [max_depth + 1] int32 (visited node indices,
    path[0] = 0, entries from tau on padded with 0), tau int32 = number of visited nodes (>= 1), and
    bonus = post[path[tau - 1]].
    """
    post = post.astype(jnp.int32)
    anc = ancestor_mask(tree, max_depth) if anc is None else anc
    idx = jnp.arange(tree.tokens.shape[0], dtype=jnp.int32)
    match = tree.valid & (tree.tokens == post[jnp.maximum(tree.parents, 0)]) & (tree.depth <= max_depth)
    match = match | (idx == 0)
    reached = jnp.all(match[None, :] | ~anc, axis=1) & tree.valid
    last = jnp.argmax(jnp.where(reached, tree.depth, -1)).astype(jnp.int32)
    tau = tree.depth[last] + 1
    slot = jnp.where(anc[last], tree.depth, max_depth + 1)  # path[depth of each ancestor-or-self of last]
    path = jnp.zeros(max_depth + 1, jnp.int32).at[slot].set(idx, mode="drop")
    return path, tau, post[last]
