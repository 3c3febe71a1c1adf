"""The Mosaic GPU MLA kernel (`pallas_kernels/mla_mosaic.py`) on CPU.

* Lowering: `lower(lowering_platforms=("cuda",))` runs the whole Pallas -> Mosaic GPU lowering (layout inference,
  dialect lowering, TMA and wgmma checks) without a GPU; only the C++ passes (PTX, ptxas, the SMEM limit) are
  left to the device.
* Numerics: Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`: simulated SMEM, TMA, barriers and the three
  warpgroups as threads, with `pallas_kernels.mosaic_interpret` filling in what jax 0.11.2's interpreter lacks)
  against `mla_attention_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp_call

from experiments.mla_common import abstract_inputs, lower_for_h200
from pallas_kernels.mla_mosaic import (
    INTERPRET_PARAMS,
    SMEM_LIMIT,
    MosaicMLAConfig,
    mla_attention_mosaic,
    mla_attention_mosaic_split,
    persistent_pieces,
    persistent_schedule,
    smem_bytes,
    wave_splits,
)
from tests.test_mla_attention import (
    DK,
    DV,
    SCALE,
    builder_masks,
    decode_mask,
    inputs,
    random_parent_mask,
    reference,
    rel_err,
)


def _lower(b: int, n: int, heads: int, length: int, config: MosaicMLAConfig | None) -> str:
    """StableHLO text of the kernel lowered for CUDA (abstract inputs, no device needed)."""
    args = abstract_inputs(b, n, heads, length)
    if config is None:
        fn = functools.partial(mla_attention_mosaic, scale=SCALE, value_dim=DV)
    else:
        fn = functools.partial(mla_attention_mosaic_split, scale=SCALE, value_dim=DV, config=config)
    return lower_for_h200(fn, *args)


@pytest.mark.parametrize(
    "b, n, heads, length, config",
    [
        (4, 1, 64, 4000, None),
        (2, 1, 8, 1000, None),
        (1, 17, 64, 8200, None),
        (3, 33, 8, 2050, None),
        (1, 1, 64, 60, None),
        (2, 17, 8, 1000, MosaicMLAConfig(num_splits=3, softmax="duplicate", schedule_barrier=False)),
        (4, 1, 64, 4096, MosaicMLAConfig(softmax="duplicate")),
        (1, 17, 8, 8256, MosaicMLAConfig(num_splits=5, softmax="shared")),
        (2, 17, 64, 1000, MosaicMLAConfig(compute_registers=232, meetings=2, lazy_rescale=False)),
        (4, 1, 64, 4000, MosaicMLAConfig(overlap=True)),
        (1, 33, 8, 8200, MosaicMLAConfig(overlap=True, swap_fence=True)),
        (2, 17, 64, 8192, MosaicMLAConfig(meetings=1, lazy_rescale=False)),
        (8, 17, 64, 8192, MosaicMLAConfig(schedule="persistent")),
        (8, 1, 64, 4096, MosaicMLAConfig(schedule="persistent", meetings=1)),
        (2, 17, 64, 8192, MosaicMLAConfig(lazy_rescale=True, meetings=2)),
        (2, 17, 8, 1000, MosaicMLAConfig(schedule="persistent", softmax="shared")),
    ],
)
def test_lowers_for_cuda(b: int, n: int, heads: int, length: int, config: MosaicMLAConfig | None):
    assert "mosaic_gpu" in _lower(b, n, heads, length, config)


def test_unaligned_cache_logs_its_pad(caplog):
    """A cache length that is not a multiple of 8 is padded (copied) every call: logged as a slow path."""
    with caplog.at_level(logging.WARNING):
        _lower(1, 1, 8, 2048, None)
        assert "slow path" not in caplog.text
        _lower(1, 1, 8, 2050, None)
    assert "cache length 2050 padded to 2056" in caplog.text


def test_smem_budget():
    assert smem_bytes(MosaicMLAConfig(), DK, DV, n_words=2) <= SMEM_LIMIT
    with pytest.raises(ValueError, match="shared memory"):
        _lower(1, 1, 8, 500, MosaicMLAConfig(num_stages=3))


def run(q, cache, prefix, mask, config: MosaicMLAConfig | None, races: bool = False) -> jax.Array:
    """The kernel in GPU interpret mode (race detection on request); the public entry point if config is None."""
    if config is None:
        return mla_attention_mosaic(q, cache, prefix, mask, SCALE, DV, interpret=True)
    params = dataclasses.replace(INTERPRET_PARAMS, detect_races=races)
    out = mla_attention_mosaic_split(q, cache, prefix, mask, SCALE, DV, config=config, interpret=params)
    if races:
        assert not interp_call.get_races().races_found
    return out


def test_config_checks():
    assert MosaicMLAConfig().softmax == "split" and MosaicMLAConfig().swizzle == 64
    assert MosaicMLAConfig(softmax="duplicate").swizzle == 128
    # One meeting and the lazy rescale are the split softmax's defaults; the modes they do not apply to get 2 / off.
    assert (MosaicMLAConfig().meetings, MosaicMLAConfig().lazy_rescale) == (1, True)
    for other in (dict(softmax="duplicate"), dict(softmax="shared"), dict(overlap=True)):
        assert (MosaicMLAConfig(**other).meetings, MosaicMLAConfig(**other).lazy_rescale) == (2, False)
    with pytest.raises(ValueError, match="softmax must be one of"):
        MosaicMLAConfig(softmax="split_s")
    for compute in (232, 240):  # the three warpgroups stay within the launch's 3 x 168 registers per lane
        memory = MosaicMLAConfig(compute_registers=compute).memory_registers
        assert 2 * compute + memory <= 3 * 168 and memory >= 24
    with pytest.raises(ValueError, match="compute_registers"):
        MosaicMLAConfig(compute_registers=248)
    with pytest.raises(ValueError, match="overlap pipelines the split softmax only"):
        MosaicMLAConfig(softmax="shared", overlap=True)
    for bad in (dict(meetings=3), dict(meetings=1, softmax="duplicate"), dict(meetings=1, overlap=True)):
        with pytest.raises(ValueError, match="meetings"):
            MosaicMLAConfig(**bad)
    for bad in (dict(lazy_rescale=True, softmax="shared"), dict(lazy_rescale=True, overlap=True)):
        with pytest.raises(ValueError, match="lazy_rescale"):
            MosaicMLAConfig(**bad)
    for bad in (
        dict(schedule="waves"),
        dict(schedule="persistent", ctas=-1),
        dict(schedule="persistent", num_splits=1),
    ):
        with pytest.raises(ValueError, match="schedule"):
            MosaicMLAConfig(**bad)
    with pytest.raises(ValueError, match="multiple of 32"):
        MosaicMLAConfig(block_k=32)  # split S would leave P V a K dim of 16


SPLIT = MosaicMLAConfig(num_splits=3)
DUPLICATE = MosaicMLAConfig(num_splits=3, softmax="duplicate")
OVERLAP = MosaicMLAConfig(num_splits=3, overlap=True)
ONE_MEETING = MosaicMLAConfig(num_splits=3, meetings=1, lazy_rescale=False)
TWO_MEETINGS = MosaicMLAConfig(num_splits=3, meetings=2, lazy_rescale=False)  # the default before the tenth round
PERSISTENT = MosaicMLAConfig(schedule="persistent", ctas=4)


@pytest.mark.parametrize(
    "n, config",
    [
        (17, SPLIT),
        (17, DUPLICATE),
        (17, MosaicMLAConfig(num_splits=3, softmax="shared")),
        (17, MosaicMLAConfig(num_splits=3, swap_fence=True)),
        (17, OVERLAP),
        (17, ONE_MEETING),
        (17, TWO_MEETINGS),
        (17, PERSISTENT),
        (17, MosaicMLAConfig(schedule="persistent", ctas=3, meetings=1, softmax="split")),
        (17, MosaicMLAConfig(schedule="persistent", ctas=3, lazy_rescale=True, meetings=2)),
        (33, SPLIT),
        (33, TWO_MEETINGS),
        (33, MosaicMLAConfig(schedule="persistent", ctas=5, softmax="duplicate")),
        (33, OVERLAP),
        (33, DUPLICATE),
    ],
)
def test_tree_verify_random_parents(n: int, config: MosaicMLAConfig):
    """Ragged prefixes (0, mid-tile, cache end), 2-3 row blocks, 3 splits; N = 33 needs two ancestor words.
    Race detection on at N = 17 (it reports one if the split softmax's max swap skips its meeting; without the
    swap's fence, the default, it must not). Interpret mode completes every wgmma at issue, so it cannot see a
    race of the overlapped steps' in-flight wgmma; their order is argued in `compute_split`."""
    rng = np.random.default_rng(n)
    batch, heads, length = 3, 4, 203
    q, cache, prefix = inputs(rng, batch, n, heads, length, [0, 70, length - n])
    mask = jnp.asarray(random_parent_mask(rng, batch, n))
    out = run(q, cache, prefix, mask, config, races=n == 17)
    ref = reference(q, cache, prefix, mask)
    assert out.shape == (batch, n, heads, DV) and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-2
    # The mask matters on these inputs: letting every node see the whole block gives a different answer.
    assert rel_err(out, reference(q, cache, prefix, jnp.ones_like(mask))) > 5e-2


@pytest.mark.parametrize("meetings", [2, 1])
def test_lazy_rescale_with_scores_growing_along_the_cache(meetings: int):
    """lazy_rescale on a cache whose slot norms grow 4x from first to last, so rows' running maxima pass the
    threshold again in later tiles (counted here from the scores, so the inputs must exercise it) while most tiles
    stay under it (P up to 2^8); against the reference, with the race detector on."""
    rng = np.random.default_rng()
    batch, heads, n, length = 2, 4, 17, 400
    q, cache, prefix = inputs(rng, batch, n, heads, length, [length - n, 150])
    cache = (cache.astype(jnp.float32) * jnp.linspace(1.0, 4.0, length)[None, :, None]).astype(jnp.bfloat16)
    mask = jnp.asarray(random_parent_mask(rng, batch, n))
    scores = np.einsum("bnhd,bld->bnhl", np.float64(q), np.float64(cache)) * SCALE * np.log2(np.e)
    passes = 0
    for b in range(batch):
        tiles = scores[b, ..., : int(prefix[b]) // 64 * 64].reshape(n, heads, -1, 64).max(-1)
        running = np.maximum.accumulate(tiles, axis=-1)
        passes += int((tiles[..., 1:] > running[..., :-1] + 8.0).sum())
    assert passes >= 10, passes
    config = MosaicMLAConfig(num_splits=2, lazy_rescale=True, meetings=meetings)
    assert rel_err(run(q, cache, prefix, mask, config, races=True), reference(q, cache, prefix, mask)) < 1e-2


@pytest.mark.parametrize("config", [MosaicMLAConfig(num_splits=2), MosaicMLAConfig(num_splits=2, softmax="duplicate")])
def test_ddtree_builder_masks(config: MosaicMLAConfig):
    """Budget-16 masks from the project's tree builder (a branching tree; a chain padded out to the budget)."""
    rng = np.random.default_rng(17)
    mask = builder_masks(rng, 16)
    q, cache, prefix = inputs(rng, 2, 17, 4, 150, [40, 133])
    assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


@pytest.mark.parametrize("heads", [8, 64])
def test_decode_single_node(heads: int):
    """Default tiling, and 4 splits of which prefix 0 leaves 3 empty (their partials must weigh nothing)."""
    rng = np.random.default_rng(heads)
    batch, length = 4, 300
    q, cache, prefix = inputs(rng, batch, 1, heads, length, [0, 5, 130, length - 1])
    mask = decode_mask(batch)
    ref, ref_self = reference(q, cache, prefix, mask), reference(q, cache, prefix, jnp.ones_like(mask))
    configs = [
        MosaicMLAConfig(num_splits=4, softmax="duplicate"),
        MosaicMLAConfig(num_splits=4, overlap=True),
        MosaicMLAConfig(num_splits=4, meetings=2, lazy_rescale=False),
        MosaicMLAConfig(num_splits=4, lazy_rescale=False),
        MosaicMLAConfig(schedule="persistent", ctas=3),
    ]
    for config in (None, MosaicMLAConfig(num_splits=4), *configs):
        out = run(q, cache, prefix, mask, config)
        assert rel_err(out, ref) < 1e-2 and rel_err(out[1], ref_self[1]) > 5e-2


@pytest.mark.parametrize(
    "config",
    [MosaicMLAConfig(num_splits=2, softmax=mode) for mode in ("shared", "duplicate")]
    + [MosaicMLAConfig(), MosaicMLAConfig(overlap=True), MosaicMLAConfig(meetings=2, lazy_rescale=False)]
    + [MosaicMLAConfig(schedule="persistent", ctas=2, softmax="shared")],
)
def test_causal_block(config: MosaicMLAConfig):
    """A causal 40-node block (two ancestor words), the three ways of splitting the softmax work."""
    rng = np.random.default_rng(3)
    batch, n, heads = 2, 40, 2
    q, cache, prefix = inputs(rng, batch, n, heads, 170, [0, 100])
    mask = jnp.asarray(np.broadcast_to(np.tril(np.ones((n, n), bool)), (batch, n, n)))
    assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


@pytest.mark.parametrize("softmax", ["duplicate", "shared"])
def test_schedule_barrier_on_and_off(softmax: str):
    """With and without the FA3 schedule barrier (used only when both warpgroups compute S); odd tile counts."""
    rng = np.random.default_rng(5)
    q, cache, prefix = inputs(rng, 2, 5, 8, 450, [201, 390])
    mask = jnp.asarray(random_parent_mask(rng, 2, 5))
    for barrier in (True, False):
        config = MosaicMLAConfig(num_splits=2, softmax=softmax, schedule_barrier=barrier)
        assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


@pytest.mark.parametrize("softmax", ["duplicate", "shared"])
def test_32_slot_tiles(softmax: str):
    """32-slot KV tiles (64-byte swizzle) in a 4-deep ring: ragged prefixes, a random tree, odd tile counts."""
    rng = np.random.default_rng(13)
    q, cache, prefix = inputs(rng, 3, 9, 8, 333, [0, 47, 324])
    mask = jnp.asarray(random_parent_mask(rng, 3, 9))
    config = MosaicMLAConfig(block_k=32, num_stages=4, num_splits=3, softmax=softmax)
    assert config.swizzle == 64 and smem_bytes(config, DK, DV) <= SMEM_LIMIT
    assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


def _makespan(ctas: int, n_tiles: int, splits: int, sms: int, overhead: int) -> int:
    """List-schedule ctas * splits equal CTAs (ceil(n_tiles / splits) + overhead each) on `sms` SMs."""
    free = [0] * sms
    for _ in range(ctas * splits):
        heapq.heapreplace(free, free[0] + -(-n_tiles // splits) + overhead)
    return max(free)


@pytest.mark.parametrize(
    "ctas, n_tiles, overhead",
    [(136, 129, 2), (136, 129, 4), (264, 129, 4), (8, 65, 4), (128, 257, 2), (8, 2049, 4), (1, 1, 4), (24, 129, 2)],
)
def test_wave_splits_minimises_the_makespan(ctas: int, n_tiles: int, overhead: int):
    """The split count is one whose list-scheduled makespan is the smallest over all counts with >= 2 tiles."""
    best = min(_makespan(ctas, n_tiles, s, 132, overhead) for s in range(1, max(1, n_tiles // 2) + 1))
    assert _makespan(ctas, n_tiles, wave_splits(ctas, n_tiles, 132, overhead), 132, overhead) == best


def test_cache_shorter_than_a_tile():
    rng = np.random.default_rng(11)
    q, cache, prefix = inputs(rng, 2, 3, 4, 7, [0, 4])
    mask = jnp.asarray(random_parent_mask(rng, 2, 3))
    assert rel_err(run(q, cache, prefix, mask, None), reference(q, cache, prefix, mask)) < 1e-2


def _units(tiles: np.ndarray, row_blocks: int) -> list[tuple[int, int, int]]:
    """Every (sequence, row block, tile) unit in the persistent schedule's order, listed one by one."""
    return [(b, r, t) for b, n in enumerate(tiles) for r in range(row_blocks) for t in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_persistent_schedule_against_a_listing(seed: int):
    """Random ragged prefixes (some sequences with no tiles): the sequences' unit offsets are those of a listing,
    per_cta is ceil(total / ctas) unless the piece cap needs more, and dealing the listed units out per_cta at a
    time, no row block spans more than `pieces` CTAs and `valid` marks exactly the partials some CTA writes (piece
    = CTA - the row block's first CTA)."""
    rng = np.random.default_rng(seed)
    batch, row_blocks, block_k, n_nodes = int(rng.integers(1, 6)), int(rng.integers(1, 4)), 64, int(rng.integers(0, 3))
    prefix = rng.integers(0, 700, batch).astype(np.int32)
    prefix[rng.random(batch) < 0.3] = 0
    ctas = int(rng.integers(1, 12))
    pieces = int(rng.integers(2, 6)) if seed % 2 else persistent_pieces(batch * row_blocks, 12, ctas)
    sched, valid = persistent_schedule(jnp.asarray(prefix), n_nodes, block_k, row_blocks, ctas, pieces)
    sched, valid = np.asarray(sched), np.asarray(valid)
    tiles = -(-(prefix + n_nodes) // block_k)
    units = _units(tiles, row_blocks)
    per_cta = int(sched[-1])
    assert list(sched[:-1]) == [len(_units(tiles[:b], row_blocks)) for b in range(batch + 1)]
    assert per_cta == max(1, -(-len(units) // ctas), -(-int(tiles.max()) // (pieces - 1)))
    written = np.zeros_like(valid)
    for c in range(-(-len(units) // per_cta)):
        for b, r in {u[:2] for u in units[c * per_cta : (c + 1) * per_cta]}:
            first_cta = units.index((b, r, 0)) // per_cta
            assert c - first_cta < pieces
            written[b, c - first_cta, r] = True
    np.testing.assert_array_equal(written, valid)


def test_persistent_long_row_block_and_empty_sequence():
    """Persistent schedule over 5 CTAs: a 16-tile decode row block, a 5-tile one and a sequence with no visible slot
    (prefix 0, its node does not see itself: no units, NaN rows as in the reference). Piece caps 0 (automatic:
    3), 6 (per_cta 5: the long row block spans 4 CTAs) and 2 (per_cta 16: one CTA each)."""
    rng = np.random.default_rng(21)
    q, cache, prefix = inputs(rng, 3, 1, 8, 1000, [990, 0, 300])
    mask = decode_mask(3)
    ref = reference(q, cache, prefix, mask)
    assert bool(jnp.isnan(ref[1]).all()) and not bool(jnp.isnan(ref[::2]).any())
    for pieces in (0, 6, 2):
        out = run(q, cache, prefix, mask, MosaicMLAConfig(schedule="persistent", ctas=5, num_splits=pieces))
        assert bool(jnp.isnan(out[1]).all())
        assert rel_err(out[::2], ref[::2]) < 1e-2
