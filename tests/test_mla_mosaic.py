"""The Mosaic GPU MLA kernel (`pallas_kernels/mla_mosaic.py`) on CPU.

* Lowering: `lower(lowering_platforms=("cuda",))` runs the whole Pallas -> Mosaic GPU lowering (layout inference,
  dialect lowering, TMA and wgmma checks) without a GPU; only the C++ passes (PTX, ptxas, the SMEM limit) are
  left to the device.
* Numerics: Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`: simulated SMEM, TMA, barriers and the three
  warpgroups as threads) against `mla_attention_reference`. jax 0.11.2's interpreter lacks two things this
  kernel (like the shipped `attention_mgpu`) uses: `pl.run_state` with a wgmma accumulator (it binds the primitive
  raw, which then fails with "Cannot lower jaxpr with effects: _WGMMAPipelineEffect, IOEffect") and wgmma with a
  register LHS (it reads every operand from simulated SMEM). The `patched_interpreter` fixture adds both, with the
  documented semantics (the accumulator starts at the init value, wgmma adds a @ b, run_state returns the final
  values).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import api_util, callback
from jax._src import core as jax_core
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe
from jax._src.pallas.mosaic_gpu import core as mgpu_core
from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interp_call
from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as interp
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_mosaic import (
    INTERPRET_PARAMS,
    SMEM_LIMIT,
    MosaicMLAConfig,
    mla_attention_mosaic,
    mla_attention_mosaic_split,
    smem_bytes,
    wave_splits,
)
from tests.test_mla_attention import DK, DV, SCALE, inputs, random_parent_mask, reference, rel_err


@gpu_callbacks.fail_on_exception
def _wgmma_register_lhs(*, token, mesh_location, thread, acc_key, acc_transforms, a, b_key, b_transforms, source_info):
    """`gpu_callbacks.wgmma` with the LHS given as a value (registers) instead of an SMEM buffer."""
    acc_key = memory.HostAllocationKey.from_array(acc_key)
    b_key = memory.HostAllocationKey.from_array(b_key)
    acc_transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(acc_transforms))
    b_transforms = jax.tree.map(int, gpu_callbacks._remove_noop_transforms(b_transforms))
    shared = gpu_callbacks._get_shared_memory()
    info = memory.GPULoggingInfo(mesh_location, thread, source_info)
    b, _, _ = shared.get_buffer_content(b_key, shared.access(b_key, b_transforms), thread, logging_info=info)
    acc_range = shared.access(acc_key, acc_transforms)
    acc, _, _ = shared.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
    res = acc + np.matmul(np.asarray(a), b, dtype=acc.dtype)
    shared.store_buffer_content(acc_key, acc_range, res, thread, logging_info=info)
    return token


def _interpret_wgmma(orig, self, eqn, token, get_invals):
    if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
        return orig(self, eqn, token, get_invals)
    acc, a, b, *leaves = get_invals()
    empty = jax.tree.structure([])
    acc_t, _, b_t = jax.tree.unflatten(
        jax.tree_util.treedef_tuple([eqn.params[f"{k}_transforms_tree"] or empty for k in ("acc", "a", "b")]),
        leaves,
    )
    acc, acc_t = interp.resolve_ref(eqn.invars[0].aval, acc, acc_t)
    b, b_t = interp.resolve_ref(eqn.invars[2].aval, b, b_t)
    token = callback.io_callback(
        functools.partial(_wgmma_register_lhs, source_info=eqn.source_info),
        gpu_callbacks.TOKEN_SHAPE_DTYPE,
        token=token,
        mesh_location=self.mesh_location,
        thread=self.thread,
        acc_key=acc,
        acc_transforms=acc_t,
        a=a,
        b_key=b,
        b_transforms=b_t,
    )
    return token, []


def is_ref(x: jax_core.Atom) -> bool:
    return isinstance(x.aval, state_types.AbstractRef)


def _run_state_as_scoped(eqn: jax_core.JaxprEqn) -> jax_core.Jaxpr:
    """A jaxpr computing a `run_state` of wgmma accumulators with `run_scoped`: inputs as `eqn`'s, outputs those of
    `eqn` for its non-ref inputs (refs pass through). The body runs on zeroed accumulators (it may only add to
    them with wgmma), whose final values are added to the initial ones; plain-value inputs are read directly.
    """
    body = eqn.params["jaxpr"]
    acc_idx = [i for i, v in enumerate(body.invars) if isinstance(v.aval, mgpu_core.WGMMAAbstractAccumulatorRef)]
    values = {v for v, x in zip(body.invars, eqn.invars, strict=True) if not is_ref(x)}

    def replacement(*vals):
        def scoped(*acc_refs):
            env = dict(zip(body.invars, vals, strict=True))
            env.update((body.invars[i], r) for i, r in zip(acc_idx, acc_refs, strict=True))
            for e in body.eqns:
                if e.primitive is not mgpu_primitives.wgmma_ref_p and not (
                    e.primitive is state_primitives.get_p and e.invars[0] in values
                ):
                    raise NotImplementedError(f"run_state body with {e.primitive}")
                ins = [x.val if isinstance(x, jax_core.Literal) else env[x] for x in e.invars]
                outs = [ins[0]] if e.primitive is state_primitives.get_p else e.primitive.bind(*ins, **e.params)
                env.update(zip(e.outvars, outs, strict=True))
            return [r[...] for r in acc_refs]

        sums = pl.run_scoped(scoped, *[plgpu.ACC(vals[i].shape, vals[i].dtype) for i in acc_idx])
        finals = {i: vals[i] + x for i, x in zip(acc_idx, sums, strict=True)}
        return [finals.get(i, x) for i, (x, v) in enumerate(zip(vals, eqn.invars, strict=True)) if not is_ref(v)]

    avals = [v.aval for v in eqn.invars]
    debug = api_util.debug_info("run_state", replacement, tuple(avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(replacement, debug_info=debug), avals)
    assert not consts
    return jaxpr


def _inline_run_state(jaxpr: jax_core.Jaxpr) -> jax_core.Jaxpr:
    """`jaxpr` with each top-level `run_state` eqn replaced by the eqns of `_run_state_as_scoped`."""
    eqns, alias = [], {}

    def sub(x):
        return alias.get(x, x) if isinstance(x, jax_core.Var) else x

    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=[sub(x) for x in eqn.invars])
        if eqn.primitive is not state_discharge.run_state_p:
            eqns.append(eqn)
            continue
        repl = _run_state_as_scoped(eqn)
        names = dict(zip(repl.invars, eqn.invars, strict=True))
        r_outs = iter(repl.outvars)
        for x, out in zip(eqn.invars, eqn.outvars, strict=True):
            r_out = x if is_ref(x) else next(r_outs)
            if r_out in names or is_ref(x):  # passed through: later uses read the input
                alias[out] = names.get(r_out, x)
            elif not isinstance(out, jax_core.DropVar):
                names[r_out] = out
        for e in repl.eqns:
            rename = [names.get(x, x) for x in e.invars], [names.get(x, x) for x in e.outvars]
            eqns.append(e.replace(invars=rename[0], outvars=rename[1]))
    return jaxpr.replace(eqns=eqns, outvars=[sub(x) for x in jaxpr.outvars])


def _interpret(orig, self, jaxpr, token, *args):
    if isinstance(jaxpr, jax_core.ClosedJaxpr):
        if any(e.primitive is state_discharge.run_state_p for e in jaxpr.jaxpr.eqns):
            jaxpr = jax_core.ClosedJaxpr(_inline_run_state(jaxpr.jaxpr), jaxpr.consts)
    elif any(e.primitive is state_discharge.run_state_p for e in jaxpr.eqns):
        jaxpr = _inline_run_state(jaxpr)
    return orig(self, jaxpr, token, *args)


@pytest.fixture
def patched_interpreter(monkeypatch):
    """GPU interpret mode that understands `run_state` accumulators and register-LHS wgmma."""
    cls = interp.JaxprInterpreter
    for name, patch in (("interpret", _interpret), ("_interpret_wgmma_ref_p", _interpret_wgmma)):
        orig = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *args, _p=patch, _o=orig: _p(_o, self, *args))


def _lower(b: int, n: int, heads: int, length: int, config: MosaicMLAConfig | None) -> str:
    """StableHLO text of the kernel lowered for CUDA (abstract inputs, no device needed)."""
    args = (
        jax.ShapeDtypeStruct((b, n, heads, DK), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, length, DK), jnp.bfloat16),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, n, n), jnp.bool_),
    )
    if config is None:
        fn = functools.partial(mla_attention_mosaic, scale=SCALE, value_dim=DV)
    else:
        fn = functools.partial(mla_attention_mosaic_split, scale=SCALE, value_dim=DV, config=config)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "b, n, heads, length, config",
    [
        (4, 1, 64, 4000, None),
        (2, 1, 8, 1000, None),
        (1, 17, 64, 8200, None),
        (3, 33, 8, 2050, None),
        (1, 1, 64, 60, None),
        (2, 17, 8, 1000, MosaicMLAConfig(num_splits=3, schedule_barrier=False)),
    ],
)
def test_lowers_for_cuda(b: int, n: int, heads: int, length: int, config: MosaicMLAConfig | None):
    assert "mosaic_gpu" in _lower(b, n, heads, length, config)


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


@pytest.mark.parametrize("n, share_p", [(17, False), (17, True), (33, False)])
def test_tree_verify_random_parents(n: int, share_p: bool, patched_interpreter):
    """Ragged prefixes (0, mid-tile, cache end), 2-3 row blocks, 3 splits; N = 33 needs two ancestor words.
    Race detection on at N = 17."""
    rng = np.random.default_rng(n)
    batch, heads, length = 3, 4, 203
    q, cache, prefix = inputs(rng, batch, n, heads, length, [0, 70, length - n])
    mask = jnp.asarray(random_parent_mask(rng, batch, n))
    out = run(q, cache, prefix, mask, MosaicMLAConfig(num_splits=3, share_p=share_p), races=n == 17)
    ref = reference(q, cache, prefix, mask)
    assert out.shape == (batch, n, heads, DV) and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-2
    # The mask matters on these inputs: letting every node see the whole block gives a different answer.
    assert rel_err(out, reference(q, cache, prefix, jnp.ones_like(mask))) > 5e-2


@pytest.mark.parametrize("heads", [8, 64])
def test_decode_single_node(heads: int, patched_interpreter):
    """Default tiling, and 4 splits of which prefix 0 leaves 3 empty (their partials must weigh nothing)."""
    rng = np.random.default_rng(heads)
    batch, length = 4, 300
    q, cache, prefix = inputs(rng, batch, 1, heads, length, [0, 5, 130, length - 1])
    mask = jnp.ones((batch, 1, 1), bool)
    ref = reference(q, cache, prefix, mask)
    for config in (None, MosaicMLAConfig(num_splits=4)):
        assert rel_err(run(q, cache, prefix, mask, config), ref) < 1e-2


@pytest.mark.parametrize("config", [MosaicMLAConfig(num_splits=2, share_p=False), MosaicMLAConfig(num_splits=2)])
def test_causal_block(config: MosaicMLAConfig, patched_interpreter):
    """A causal 40-node block (two ancestor words), both ways of splitting the softmax work."""
    rng = np.random.default_rng(3)
    batch, n, heads = 2, 40, 2
    q, cache, prefix = inputs(rng, batch, n, heads, 170, [0, 100])
    mask = jnp.asarray(np.broadcast_to(np.tril(np.ones((n, n), bool)), (batch, n, n)))
    assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


@pytest.mark.parametrize("share_p", [False, True])
def test_schedule_barrier_on_and_off(share_p: bool, patched_interpreter):
    """With and without the FA3 schedule barrier (used only when both warpgroups compute S); odd tile counts."""
    rng = np.random.default_rng(5)
    q, cache, prefix = inputs(rng, 2, 5, 8, 450, [201, 390])
    mask = jnp.asarray(random_parent_mask(rng, 2, 5))
    for barrier in (True, False):
        config = MosaicMLAConfig(num_splits=2, share_p=share_p, schedule_barrier=barrier)
        assert rel_err(run(q, cache, prefix, mask, config), reference(q, cache, prefix, mask)) < 1e-2


def _makespan(ctas: int, n_tiles: int, splits: int, sms: int, overhead: int) -> int:
    """List-schedule ctas * splits equal CTAs (ceil(n_tiles / splits) + overhead each) on `sms` SMs."""
    free = [0] * sms
    for _ in range(ctas * splits):
        i = free.index(min(free))
        free[i] += -(-n_tiles // splits) + overhead
    return max(free)


@pytest.mark.parametrize("ctas, n_tiles", [(136, 129), (264, 129), (8, 65), (128, 2049), (1, 1), (24, 129)])
def test_wave_splits_minimises_the_makespan(ctas: int, n_tiles: int):
    """The split count is one whose list-scheduled makespan is the smallest over all counts with >= 2 tiles."""
    best = min(_makespan(ctas, n_tiles, s, 132, 2) for s in range(1, max(1, n_tiles // 2) + 1))
    assert _makespan(ctas, n_tiles, wave_splits(ctas, n_tiles), 132, 2) == best


def test_cache_shorter_than_a_tile(patched_interpreter):
    rng = np.random.default_rng(11)
    q, cache, prefix = inputs(rng, 2, 3, 4, 7, [0, 4])
    mask = jnp.asarray(random_parent_mask(rng, 2, 3))
    assert rel_err(run(q, cache, prefix, mask, None), reference(q, cache, prefix, mask)) < 1e-2
