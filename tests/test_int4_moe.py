"""CPU tests of the Mosaic GPU INT4 MoE kernels (GPU interpret mode) against `moe_swiglu_reference`.

GPU interpret mode runs TMA, barriers, the pipeline and SMEM-operand wgmma, and fills unwritten outputs with NaN;
it does not model a register (array) wgmma LHS, so the kernels stage the dequantized weights through SMEM there
(`lhs_via_smem`). The register-LHS path itself is checked on the GPU by experiments/bench_moe.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu
from row_invariance import PROBES, SIZES, probe_outputs, rows_invariant

from pallas_kernels import int4_moe, reference

H, INTER, E, K = 256, 128, 16, 4


def _weights(key: jax.Array, hidden: int = H, inter: int = INTER) -> dict[str, jax.Array]:
    ks = jax.random.split(key, 4)
    gs = jax.random.uniform(ks[1], (E, hidden // 32, 2 * inter), jnp.float32, 0.5, 1.5) / (8 * hidden**0.5)
    ds = jax.random.uniform(ks[3], (E, inter // 32, hidden), jnp.float32, 0.5, 1.5) / (8 * inter**0.5)
    return {
        "gate_up_q": jax.random.randint(ks[0], (E, 2 * inter, hidden), -8, 8, jnp.int8).astype(jnp.int4),
        "gate_up_s": gs.astype(jnp.bfloat16),
        "down_q": jax.random.randint(ks[2], (E, hidden, inter), -8, 8, jnp.int8).astype(jnp.int4),
        "down_s": ds.astype(jnp.bfloat16),
    }


def _routing(key: jax.Array, t: int, used: int, hidden: int = H) -> tuple[jax.Array, jax.Array, jax.Array]:
    """k distinct experts per token drawn from the first `used` experts (the rest get nothing)."""
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (t, hidden), jnp.bfloat16)
    ids = jnp.argsort(jax.random.uniform(ki, (t, used)), axis=-1)[:, :K].astype(jnp.int32)
    w = jax.random.uniform(kw, (t, K), jnp.float32, 0.1, 1.0)
    return x, ids, w


def _rel_err(out: jax.Array, ref: jax.Array) -> float:
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


@pytest.mark.parametrize(
    "t, used, config",
    [
        (13, 6, None),  # one 256-column step, experts with 1..2 tiles, 10 unused experts
        (1, E, None),
        (29, 5, int4_moe.Config(bt=16, block_k=64, stages=3)),  # 4 / 2 pipelined K steps, multi-tile experts
    ],
)
def test_moe_swiglu_pallas_matches_reference(t: int, used: int, config) -> None:
    kw, kr = jax.random.split(jax.random.key(1))
    wts = _weights(kw)
    x, ids, w = _routing(kr, t, used)
    ref = reference.moe_swiglu_reference(x, ids, w, **wts)
    out = int4_moe.moe_swiglu_pallas(x, ids, w, **wts, interpret=True, config=config)
    assert out.shape == (t, H) and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < 1e-2


def test_kernels_write_every_used_row_without_races() -> None:
    """Outputs start as NaN in interpret mode: every row of every tile in use must be written, race-free."""
    kw, kr = jax.random.split(jax.random.key(2))
    wts = _weights(kw)
    x, ids, _ = _routing(kr, 11, 7)
    cfg = int4_moe.resolve_config(None, 11, K, E)
    gate_up_s, down_s = wts["gate_up_s"], wts["down_s"]
    grouping, xs = int4_moe.route(x, ids, E, cfg)
    params = plgpu.InterpretGPUParams(detect_races=True)
    h_t = int4_moe.gate_up_pallas(cfg, grouping, xs, wts["gate_up_q"], gate_up_s, interpret=params)
    y_t = int4_moe.down_pallas(cfg, grouping, h_t, wts["down_q"], down_s, interpret=params)
    used_rows = int(grouping.num_tiles[0]) * cfg.bt
    assert used_rows < h_t.shape[1]  # some tiles are unused: the check below is not vacuous
    assert np.isfinite(np.asarray(h_t[:, :used_rows], np.float32)).all()
    assert np.isfinite(np.asarray(y_t[:, :used_rows])).all()
    assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("bt", [8, 16])
def test_group_pairs_layout(bt: int) -> None:
    """Against a numpy sort-based grouping: rows, tile experts and tile count."""
    t, k, e = 37, 6, 20
    ids = np.asarray(jnp.argsort(jax.random.uniform(jax.random.key(3), (t, e // 2)), axis=-1)[:, :k], np.int32)
    g = int4_moe.group_pairs(jnp.asarray(ids), e, bt)
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=e)
    tiles = -(-counts // bt)
    tile_start = np.concatenate([[0], np.cumsum(tiles)[:-1]])
    rank = np.array([np.sum(flat[:p] == flat[p]) for p in range(flat.size)])
    np.testing.assert_array_equal(np.asarray(g.row_of_pair), tile_start[flat] * bt + rank)
    assert int(g.num_tiles[0]) == tiles.sum()
    want_tile_expert = np.repeat(np.arange(e), tiles)
    np.testing.assert_array_equal(np.asarray(g.tile_expert)[: tiles.sum()], want_tile_expert)
    assert g.tile_expert.shape == (int4_moe.max_tiles(t * k, e, bt),)


def test_rejects_checkpoint_layout_scales() -> None:
    wts = _weights(jax.random.key(4))
    wts["gate_up_s"] = wts["gate_up_s"].transpose(0, 2, 1)  # [E, 2I, H/32]: the checkpoint's, not the model's
    x, ids, w = _routing(jax.random.key(5), 3, E)
    with pytest.raises(ValueError, match="group-major"):
        int4_moe.moe_swiglu_pallas(x, ids, w, **wts, interpret=True)


def test_choose_bt() -> None:
    bts = [int4_moe.choose_bt(t, 8, 384) for t in (1, 16, 64, 256, 1024, 4096)]
    assert bts[0] == 8 and bts[-1] == 64
    assert bts == sorted(bts) and all(b % 8 == 0 for b in bts)


def test_exact_rows_are_bitwise_invariant():
    """exact=True: a token's output is the same bits in calls of 1, 9, 17 and 65 tokens, whatever other tokens share
    its experts and its tiles, and matches the reference. (No control here: on a CPU the non-exact kernel is
    invariant too, its interpreted wgmma being a per-column numpy product; `test_exact_matmul` shows the check
    catches a tiling chosen from M.)"""
    hidden, inter = 128, 64  # the smallest the kernel takes: the four calls interpret in about 10 s
    key = jax.random.key(6)
    wts = _weights(key, hidden, inter)
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 1 << 30)))

    def inputs(t: int) -> tuple[np.ndarray, ...]:
        x, ids, w = _routing(jax.random.key(int(rng.integers(1 << 30))), t, E, hidden)
        return np.asarray(x), np.asarray(ids), np.asarray(w)

    def moe(x, ids, w):
        out = int4_moe.moe_swiglu_pallas(x, ids, w, **wts, interpret=True, exact=True)
        ref = reference.moe_swiglu_reference(x, ids, w, **wts, exact=True)
        assert _rel_err(out, ref) < 1e-2
        return out

    assert rows_invariant(probe_outputs(moe, inputs(PROBES), inputs, rng))


def test_exact_reference_sums_in_rank_order():
    """The reference's exact combine (rank order) agrees with its expert-slot combine; its rows are invariant across
    calls of several rows. Not at one row: its expert products are XLA's dots, and on a CPU a 1-row dot takes a
    matrix-vector path that sums in another order (12 of 300 seeds flipped a last bit)."""
    key = jax.random.key(7)
    wts = _weights(key)
    x, ids, w = _routing(key, 9, 6)
    exact = reference.moe_swiglu_reference(x, ids, w, **wts, exact=True)
    assert _rel_err(exact, reference.moe_swiglu_reference(x, ids, w, **wts)) < 1e-2
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 1 << 30)))

    def inputs(t: int) -> tuple[np.ndarray, ...]:
        return tuple(np.asarray(a) for a in _routing(jax.random.key(int(rng.integers(1 << 30))), t, E))

    ref = jax.jit(lambda x, ids, w: reference.moe_swiglu_reference(x, ids, w, **wts, exact=True))
    assert rows_invariant(probe_outputs(ref, inputs(PROBES), inputs, rng, sizes=SIZES[1:]))


def test_exact_mode_has_one_tile_size() -> None:
    for t in (1, 17, 544, 4096):
        assert int4_moe.resolve_config(None, t, 8, 384, exact=True).bt == int4_moe.EXACT_BT
    assert int4_moe.resolve_config(None, 4096, 8, 384).bt == 64
    with pytest.raises(ValueError, match="exact"):
        int4_moe.resolve_config(int4_moe.Config(bt=16), 1, 8, 384, exact=True)
