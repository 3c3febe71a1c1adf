"""Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`) for the MLA kernel on jax 0.11.2: test harness only.

jax 0.11.2's GPU interpreter lacks three things `pallas_kernels/mla_mosaic.py` (like the shipped `attention_mgpu`) uses:
`pl.run_state` with a wgmma accumulator (it binds the primitive raw, which then fails with "Cannot lower jaxpr with
effects: _WGMMAPipelineEffect, IOEffect"), wgmma with a register LHS (it reads every operand from simulated SMEM)
and writes to an accumulator (`acc_ref[...] = value`). `install()` adds the three to the interpreter class, with the
documented semantics (the accumulator starts at the init value or the written one, wgmma adds a @ b, run_state
returns the final values), and runs an `inline_mgpu` function that names a plain-JAX equivalent (`interpret_as`)
as that equivalent (the interpreter cannot run Mosaic GPU code); everything else still runs the interpreter's own
code. Waits are synchronous there: every wgmma has completed when it returns, whatever `wait_n` a read of its
accumulator gives. `params()` installs it (once per process, logged) and returns the interpret parameters to pass
the kernel as `interpret=`. It patches `jax._src` internals, so it lives with the tests: product code never imports it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from absl import logging
from jax._src import api_util, callback
from jax._src import core as jax_core
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe
from jax._src.pallas.mosaic_gpu import core as mgpu_core
from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret as interp
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_installed = False
# Interpret mode as the hardware behaves here: TMA reads past the cache end give zeros.
PARAMS = plgpu.InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


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
    token = _call(
        self, eqn, token, _wgmma_register_lhs, acc_key=acc, acc_transforms=acc_t, a=a, b_key=b, b_transforms=b_t
    )
    return token, []


def _call(self, eqn, token, fn, **kwargs):
    """`fn(token=, mesh_location=, thread=, source_info=, **kwargs)` on the host, ordered by the interpreter's token."""
    partial = functools.partial(fn, source_info=eqn.source_info)
    return callback.io_callback(
        partial,
        gpu_callbacks.TOKEN_SHAPE_DTYPE,
        token=token,
        mesh_location=self.mesh_location,
        thread=self.thread,
        **kwargs,
    )


@gpu_callbacks.fail_on_exception
def _store_accumulator(*, token, mesh_location, thread, acc_key, value, source_info):
    """Write `value` into a wgmma accumulator's buffer. Accumulators are a warpgroup's registers, so (as for the
    interpreter's own wgmma writes to them) no race is recorded: the buffer is reused by every CTA of the grid,
    and the race detector would otherwise pair identical clocks of two CTAs."""
    acc_key = memory.HostAllocationKey.from_array(acc_key)
    shared = gpu_callbacks._get_shared_memory()
    info = memory.GPULoggingInfo(mesh_location, thread, source_info)
    shared.store_buffer_content(acc_key, shared.access(acc_key, ()), np.asarray(value), thread, logging_info=info)
    return token


def _interpret_swap(orig, self, eqn, token, get_invals):
    """A swap into a wgmma accumulator (`_store_as_swap`) writes its buffer without race records and returns the
    written value in place of the old one (the rewrite drops it)."""
    if not isinstance(eqn.invars[0].aval, mgpu_core.WGMMAAbstractAccumulatorRef):
        return orig(self, eqn, token, get_invals)
    acc, value, *_ = get_invals()
    return _call(self, eqn, token, _store_accumulator, acc_key=acc, value=value), value


def _interpret_inline_mgpu(orig, self, eqn, token, get_invals):
    """An `inline_mgpu` whose function names a plain-JAX equivalent (`interpret_as`, e.g.
    `mla_mosaic.scale_rows`) runs that on its inputs; any other goes to the interpreter (which refuses it)."""
    equivalent = getattr(eqn.params["mgpu_fn"], "interpret_as", None)
    if equivalent is None:
        return orig(self, eqn, token, get_invals)
    return token, [equivalent(*get_invals())]


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


def _store_as_swap(eqn: jax_core.JaxprEqn) -> jax_core.Jaxpr:
    """A jaxpr writing an accumulator (`acc_ref[...] = value`, `wgmma_accumulator_store_p`) as a plain ref swap,
    which the interpreter runs on the accumulator's simulated buffer; its output is the old value (unused)."""
    avals = [v.aval for v in eqn.invars]
    fn = lambda ref, value: state_primitives.ref_swap(ref, (), value)
    debug = api_util.debug_info("accumulator_store", fn, tuple(avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(lambda *a: [fn(*a)], debug_info=debug), avals)
    assert not consts
    return jaxpr


_REWRITES = {
    state_discharge.run_state_p: _run_state_as_scoped,
    mgpu_primitives.wgmma_accumulator_store_p: _store_as_swap,
}


def _inline_rewrites(jaxpr: jax_core.Jaxpr) -> jax_core.Jaxpr:
    """`jaxpr` with each top-level eqn of a `_REWRITES` primitive replaced by the eqns of its rewrite."""
    eqns, alias = [], {}

    def sub(x):
        return alias.get(x, x) if isinstance(x, jax_core.Var) else x

    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=[sub(x) for x in eqn.invars])
        if eqn.primitive not in _REWRITES:
            eqns.append(eqn)
            continue
        repl = _REWRITES[eqn.primitive](eqn)
        names = dict(zip(repl.invars, eqn.invars, strict=True))
        if eqn.primitive is state_discharge.run_state_p:  # one output per input: refs pass through
            r_outs = iter(repl.outvars)
            ios = zip(eqn.invars, eqn.outvars, strict=True)
            pairs = [(x if is_ref(x) else next(r_outs), out, is_ref(x)) for x, out in ios]
        else:
            pairs = [(r_out, out, False) for r_out, out in zip(repl.outvars, eqn.outvars, strict=True)]
        for r_out, out, ref in pairs:
            if r_out in names or ref:  # passed through: later uses read the input
                alias[out] = names.get(r_out, r_out)
            elif not isinstance(out, jax_core.DropVar):
                names[r_out] = out
        for e in repl.eqns:
            rename = [names.get(x, x) for x in e.invars], [names.get(x, x) for x in e.outvars]
            eqns.append(e.replace(invars=rename[0], outvars=rename[1]))
    return jaxpr.replace(eqns=eqns, outvars=[sub(x) for x in jaxpr.outvars])


def _interpret(orig, self, jaxpr, token, *args):
    if isinstance(jaxpr, jax_core.ClosedJaxpr):
        if any(e.primitive in _REWRITES for e in jaxpr.jaxpr.eqns):
            jaxpr = jax_core.ClosedJaxpr(_inline_rewrites(jaxpr.jaxpr), jaxpr.consts)
    elif any(e.primitive in _REWRITES for e in jaxpr.eqns):
        jaxpr = _inline_rewrites(jaxpr)
    return orig(self, jaxpr, token, *args)


def _before(orig, patch):
    """The interpreter method `orig` with `patch(orig, self, ...)` in front of it."""

    def method(self, *args):
        return patch(orig, self, *args)

    return method


def install() -> None:
    """Patch the GPU interpreter class in this process (idempotent)."""
    global _installed
    if _installed:
        return
    cls = interp.JaxprInterpreter
    patches = {
        "interpret": _interpret,
        "_interpret_wgmma_ref_p": _interpret_wgmma,
        "_interpret_swap_p": _interpret_swap,
        "_interpret_inline_mgpu_p": _interpret_inline_mgpu,
    }
    for name, patch in patches.items():
        setattr(cls, name, _before(getattr(cls, name), patch))
    _installed = True
    logging.info(
        "Mosaic GPU interpreter patched for run_state accumulators, accumulator writes, register-LHS wgmma, "
        "inline_mgpu with a plain-JAX equivalent"
    )


def params(**changes: object) -> plgpu.InterpretGPUParams:
    """`PARAMS` with `changes` (e.g. detect_races=True), the interpreter patched for the Mosaic MLA kernel first."""
    install()
    return dataclasses.replace(PARAMS, **changes)
