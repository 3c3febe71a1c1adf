"""The Mosaic GPU MLA kernel (`pallas_kernels/mla_mosaic.py`) on CPU.

* Lowering: `lower(lowering_platforms=("cuda",))` runs the whole Pallas -> Mosaic GPU lowering (layout inference,
  dialect lowering, TMA and wgmma checks) without a GPU; only the C++ passes (PTX, ptxas, the SMEM limit) are
  left to the device.
* Numerics: Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`: simulated SMEM, TMA, barriers and the three
  warpgroups as threads, with `tests.mosaic_interpret` filling in what jax 0.11.2's interpreter lacks) against
  `mla_attention_reference`.
"""

from __future__ import annotations

import functools
import heapq
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp_call

from experiments.mla_common import abstract_inputs, lower_for_h200
from pallas_kernels.mla_mosaic import mla_attention_mosaic, mla_attention_mosaic_split
from pallas_kernels.mla_mosaic_config import SMEM_LIMIT, MosaicMLAConfig, smem_bytes, wave_splits
from tests import mosaic_interpret
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
        (2, 17, 8, 1000, MosaicMLAConfig(num_splits=3)),
        (2, 17, 64, 1000, MosaicMLAConfig(compute_registers=232)),
        (1, 33, 8, 8200, MosaicMLAConfig(num_stages=1, num_splits=5)),
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
    params = mosaic_interpret.params(detect_races=races)
    if config is None:
        return mla_attention_mosaic(q, cache, prefix, mask, SCALE, DV, interpret=params)
    out = mla_attention_mosaic_split(q, cache, prefix, mask, SCALE, DV, config=config, interpret=params)
    if races:
        assert not interp_call.get_races().races_found
    return out


def test_config_checks():
    for compute in (232, 240):  # the three warpgroups stay within the launch's 3 x 168 registers per lane
        memory = MosaicMLAConfig(compute_registers=compute).memory_registers
        assert 2 * compute + memory <= 3 * 168 and memory >= 24
    for bad in (dict(compute_registers=248), dict(num_splits=-1), dict(num_stages=0)):
        with pytest.raises(ValueError, match="must be"):
            MosaicMLAConfig(**bad)


def test_tiling_from_text():
    assert MosaicMLAConfig.from_text("") == MosaicMLAConfig()
    assert MosaicMLAConfig.from_text("num_splits=3,compute_registers=232") == MosaicMLAConfig(
        num_splits=3, compute_registers=232
    )
    for bad, says in [
        ("num_splits", "FIELD=VALUE"),
        ("softmax=split", "FIELD=VALUE"),
        ("num_stages=x", "takes an int"),
    ]:
        with pytest.raises(ValueError, match=says):
            MosaicMLAConfig.from_text(bad)


def test_product_refuses_interpret_mode_without_the_harness():
    rng = np.random.default_rng(0)
    q, cache, prefix = inputs(rng, 1, 1, 8, 64, [10])
    with pytest.raises(NotImplementedError, match="tests/mosaic_interpret.py"):
        mla_attention_mosaic(q, cache, prefix, decode_mask(1), SCALE, DV, interpret=True)


SPLIT = MosaicMLAConfig(num_splits=3)


@pytest.mark.parametrize("n, config", [(17, SPLIT), (17, MosaicMLAConfig(num_stages=1, num_splits=3)), (33, SPLIT)])
def test_tree_verify_random_parents(n: int, config: MosaicMLAConfig):
    """Ragged prefixes (0, mid-tile, cache end), 2-3 row blocks, 3 splits; N = 33 needs two ancestor words.
    Race detection on at N = 17 (it reports one if a warpgroup overwrites a P half or maximum the other has not
    read, or reads one before the meeting)."""
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


def test_lazy_rescale_with_scores_growing_along_the_cache():
    """A cache whose slot norms grow 4x from first to last, so rows' running maxima pass the rescale threshold
    again in later tiles (counted here from the scores, so the inputs must exercise it) while most tiles stay
    under it (P up to 2^8); against the reference, with the race detector on."""
    rng = np.random.default_rng(1)
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
    config = MosaicMLAConfig(num_splits=2)
    assert rel_err(run(q, cache, prefix, mask, config, races=True), reference(q, cache, prefix, mask)) < 1e-2


def test_ddtree_builder_masks():
    """Budget-16 masks from the project's tree builder (a branching tree; a chain padded out to the budget)."""
    rng = np.random.default_rng(17)
    mask = builder_masks(rng, 16)
    q, cache, prefix = inputs(rng, 2, 17, 4, 150, [40, 133])
    config = MosaicMLAConfig(num_splits=2)
    assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


@pytest.mark.parametrize("heads", [8, 64])
def test_decode_single_node(heads: int):
    """Default tiling, and 4 splits of which prefix 0 leaves 3 empty (their partials must weigh nothing)."""
    rng = np.random.default_rng(heads)
    batch, length = 4, 300
    q, cache, prefix = inputs(rng, batch, 1, heads, length, [0, 5, 130, length - 1])
    mask = decode_mask(batch)
    ref, ref_self = reference(q, cache, prefix, mask), reference(q, cache, prefix, jnp.ones_like(mask))
    for config in (None, MosaicMLAConfig(num_splits=4)):
        out = run(q, cache, prefix, mask, config)
        assert rel_err(out, ref) < 1e-2 and rel_err(out[1], ref_self[1]) > 5e-2


def test_causal_block():
    """A causal 40-node block (two ancestor words), default tiling."""
    rng = np.random.default_rng(3)
    batch, n, heads = 2, 40, 2
    q, cache, prefix = inputs(rng, batch, n, heads, 170, [0, 100])
    mask = jnp.asarray(np.broadcast_to(np.tril(np.ones((n, n), bool)), (batch, n, n)))
    assert rel_err(run(q, cache, prefix, mask, None), reference(q, cache, prefix, mask)) < 1e-2


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
