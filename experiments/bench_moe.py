"""Routed-expert INT4 SwiGLU at Kimi K2.6 dims: Mosaic GPU kernel vs XLA paths vs device copy bandwidth.

python -m experiments.bench_moe [--tokens=1,8,...] [--experts=384,48] [--out_dir=...]

Per (T, E): uniform random routing (k distinct experts per token), fresh random weights. Variants:
  pallas       `pallas_kernels.int4_moe.moe_swiglu_pallas`, default config; at the --sweep points also other
               configs and the stages alone (routing glue, kernel A, kernel B; each jitted on its own);
  xla_int4     `moe_swiglu_reference` jitted (gathers and dequantizes each distinct expert);
  ragged_bf16  `lax.ragged_dot` on bf16 weights (XLA computes it densely over all E experts).
Bytes = distinct experts touched x (packed int4 + bf16 scales), the same for every variant;
TB/s = bytes / time; % copy = that rate over the measured device-to-device copy (read + write bytes).
Time: median over batches of `--calls` back-to-back calls (host dispatch overlapped), per call.
Correctness: kernel vs reference on two fresh routings per E (rel. error < 1e-2; a stale or unwritten output
of the first cannot pass the second).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax.errors import run_app
from experiments import common
from pallas_kernels import int4_moe, reference

FLAGS = flags.FLAGS
flags.DEFINE_list("tokens", ["1", "8", "16", "32", "64", "128", "256"], "token counts T")
flags.DEFINE_list("experts", ["384", "48"], "expert counts E (48 = one GPU's shard under 8-way EP)")
flags.DEFINE_list("sweep", ["1:384", "128:384", "256:48"], "T:E points for the kernel config sweep + stages")
flags.DEFINE_integer("hidden", 7168, "H")
flags.DEFINE_integer("inter", 2048, "I (moe_intermediate_size)")
flags.DEFINE_integer("topk", 8, "k")
flags.DEFINE_integer("calls", 10, "back-to-back calls per timed batch")
flags.DEFINE_integer("repeats", 5, "timed batches (median)")
flags.DEFINE_bool("baselines", True, "also time the XLA int4 reference and ragged_dot")
flags.DEFINE_string("out_dir", "", "extra directory for a copy of the results")
flags.DEFINE_bool("interpret", False, "run the kernel in GPU interpret mode (CPU smoke test of this script)")

SWEEP = (  # the default is Config() = block_k 256, 2 stages
    int4_moe.Config(stages=4),
    int4_moe.Config(stages=3),
    int4_moe.Config(block_k=128, stages=4),
)


@dataclasses.dataclass
class Weights:
    """INT4 experts for one E, in the model's layout (group-major scales)."""

    gate_up_q: jax.Array
    gate_up_s: jax.Array
    down_q: jax.Array
    down_s: jax.Array


def _int4(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.jit(lambda k: jax.random.randint(k, shape, -8, 8, jnp.int8).astype(jnp.int4))(key)


def _scales(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """Scales ~ U(0.5, 1.5) / (8 sqrt(fan_in)): keeps activations O(1)."""
    return jax.jit(lambda k: jax.random.uniform(k, shape, jnp.float32, 0.5, 1.5) / (8 * fan_in**0.5))(key).astype(
        jnp.bfloat16
    )


def make_weights(key: jax.Array, e: int, h: int, i: int) -> Weights:
    ks = jax.random.split(key, 4)
    gus = _scales(ks[1], (e, h // int4_moe.GROUP, 2 * i), h)
    ds = _scales(ks[3], (e, i // int4_moe.GROUP, h), i)
    return Weights(_int4(ks[0], (e, 2 * i, h)), gus, _int4(ks[2], (e, h, i)), ds)


def make_routing(key: jax.Array, t: int, e: int, k: int, h: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x `[T, H]` bf16, topk_ids `[T, k]` (k distinct experts, uniform), topk_weights `[T, k]` (sum 2.827)."""
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (t, h), jnp.bfloat16)
    ids = jnp.argsort(jax.random.uniform(ki, (t, e)), axis=-1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(kw, (t, k), jnp.float32, 0.1, 1.0)
    return x, ids, w / w.sum(-1, keepdims=True) * 2.827


def expert_bytes(h: int, i: int) -> int:
    """Packed int4 + bf16 scale bytes of one expert (gate, up, down)."""
    params = 3 * h * i
    return params // 2 + params // int4_moe.GROUP * 2


def ragged_moe(x, ids, w, wgu, wd):
    """Routed SwiGLU through `lax.ragged_dot`; wgu bf16 `[E, H, 2I]`, wd bf16 `[E, I, H]`."""
    t, k = ids.shape
    e, _, two_i = wgu.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    xs = x[order // k]
    gu = jax.lax.ragged_dot(xs, wgu, sizes, preferred_element_type=jnp.float32)
    hmid = (jax.nn.silu(gu[:, : two_i // 2]) * gu[:, two_i // 2 :]).astype(x.dtype)
    y = jax.lax.ragged_dot(hmid, wd, sizes, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)
    return jnp.einsum("tkh,tk->th", y, w).astype(x.dtype)


def time_per_call(fn, args) -> float:
    """Median seconds per call over batches of FLAGS.calls back-to-back calls."""
    batch = lambda: [fn(*args) for _ in range(FLAGS.calls)]  # noqa: E731
    return common.time_fn(batch, warmup=1, repeats=FLAGS.repeats) / FLAGS.calls


def copy_bandwidth() -> dict[str, float]:
    """Device-to-device copy of 2 GiB (jnp.copy under jit) and bf16 `a + 1`, read + write bytes counted."""
    a = jax.random.normal(jax.random.key(1), (1 << (29 if jax.default_backend() == "gpu" else 20),), jnp.float32)
    nbytes = 2 * a.size * a.dtype.itemsize
    copy = time_per_call(jax.jit(jnp.copy), (a,))
    b = a.astype(jnp.bfloat16)
    add = time_per_call(jax.jit(lambda v: v + 1), (b,))
    return {"copy_tbps": nbytes / copy / 1e12, "bf16_add_tbps": nbytes / 2 / add / 1e12}


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.isfinite(o).all():
        return float("inf")
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def check(wts: Weights, t: int, e: int, seed: int) -> dict[str, float]:
    """Kernel vs reference on two fresh routings (stale outputs of the first cannot pass the second)."""
    errs = []
    for s in (seed, seed + 1):
        x, ids, w = make_routing(jax.random.key(s), t, e, FLAGS.topk, FLAGS.hidden)
        ref = jax.jit(reference.moe_swiglu_reference)(x, ids, w, wts.gate_up_q, wts.gate_up_s, wts.down_q, wts.down_s)
        out = int4_moe.moe_swiglu_pallas(
            x,
            ids,
            w,
            wts.gate_up_q,
            wts.gate_up_s,
            wts.down_q,
            wts.down_s,
            interpret=FLAGS.interpret,
        )
        errs.append(rel_err(out, ref))
    return {"check_T": t, "check_E": e, "rel_err": max(errs), "ok": max(errs) < 1e-2}


def stage_runs(wts: Weights, x, ids) -> dict:
    """Default-config stages alone: routing glue (XLA), kernel A (gate/up + SwiGLU), kernel B (down)."""
    t, k = ids.shape
    e = wts.gate_up_q.shape[0]
    cfg = int4_moe.resolve_config(None, t, k, e)
    route = jax.jit(functools.partial(int4_moe.route, num_experts=e, cfg=cfg))
    grouping, xs = route(x, ids)
    interp = plgpu.InterpretGPUParams() if FLAGS.interpret else None
    gate_up = jax.jit(functools.partial(int4_moe.gate_up_pallas, cfg, interpret=interp))
    h_t = gate_up(grouping, xs, wts.gate_up_q, wts.gate_up_s)
    down = jax.jit(functools.partial(int4_moe.down_pallas, cfg, interpret=interp))
    return {
        "stage: route": (route, (x, ids)),
        "stage: gate_up kernel": (gate_up, (grouping, xs, wts.gate_up_q, wts.gate_up_s)),
        "stage: down kernel": (down, (grouping, h_t, wts.down_q, wts.down_s)),
    }


def bench_one(wts: Weights, wbf16, t: int, e: int, configs, baselines: bool, stages: bool) -> list[dict]:
    x, ids, w = make_routing(jax.random.key(1000 + t), t, e, FLAGS.topk, FLAGS.hidden)
    distinct = int(np.unique(np.asarray(ids)).size)
    nbytes = distinct * expert_bytes(FLAGS.hidden, FLAGS.inter)
    base = {"T": t, "E": e, "experts": distinct, "MB": nbytes / 1e6}
    runs = {}
    for cfg in configs:
        name = "pallas" if cfg is None else f"pallas bk{cfg.block_k} s{cfg.stages}"
        fn = jax.jit(functools.partial(int4_moe.moe_swiglu_pallas, config=cfg, interpret=FLAGS.interpret))
        runs[name] = (fn, (x, ids, w, wts.gate_up_q, wts.gate_up_s, wts.down_q, wts.down_s))
    if stages:
        runs.update(stage_runs(wts, x, ids))
    if baselines:
        ref_args = (x, ids, w, wts.gate_up_q, wts.gate_up_s, wts.down_q, wts.down_s)
        runs["xla_int4"] = (jax.jit(reference.moe_swiglu_reference), ref_args)
        runs["ragged_bf16"] = (jax.jit(ragged_moe), (x, ids, w, *wbf16))
    records = []
    for name, (fn, args) in runs.items():
        try:
            sec = time_per_call(fn, args)
            rec = {**base, "variant": name, "us": sec * 1e6, "TB/s": nbytes / sec / 1e12}
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the rest of the run
            rec = {**base, "variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(rec, flush=True)
        records.append(rec)
    return records


def write(records: list[dict], bw: dict, checks: list[dict]) -> None:
    """Write the results so far (called after every T, so a run cut short still leaves its numbers)."""
    for r in records:
        if "TB/s" in r:
            r["% copy"] = 100 * r["TB/s"] / bw["copy_tbps"]
    cols = ["T", "E", "experts", "MB", "variant", "us", "TB/s", "% copy", "error"]
    extra = {
        "bandwidth": bw,
        "checks": checks,
        "dims": {"H": FLAGS.hidden, "I": FLAGS.inter, "k": FLAGS.topk},
    }
    common.write_results("bench_moe", records, cols, extra=extra)
    if FLAGS.out_dir:
        common.write_results("bench_moe", records, cols, out_dir=FLAGS.out_dir, extra=extra)


def main(_) -> None:
    h, i = FLAGS.hidden, FLAGS.inter
    bw = copy_bandwidth()
    print(bw, flush=True)
    records, checks = [], []
    for n, e in enumerate(int(v) for v in FLAGS.experts):
        t0 = time.perf_counter()
        wts = make_weights(jax.random.key(7 + e), e, h, i)
        wbf16 = None
        if FLAGS.baselines:
            kb = jax.random.split(jax.random.key(11 + e))
            wbf16 = (
                jax.random.normal(kb[0], (e, h, 2 * i), jnp.bfloat16) * 0.01,
                jax.random.normal(kb[1], (e, i, h), jnp.bfloat16) * 0.01,
            )
        print(f"E={e}: weights in {time.perf_counter() - t0:.1f} s", flush=True)
        checks.append(check(wts, 16 if n == 0 else 256, e, seed=100 + e))
        print(checks[-1], flush=True)
        for t in (int(v) for v in FLAGS.tokens):
            swept = f"{t}:{e}" in FLAGS.sweep
            records += bench_one(wts, wbf16, t, e, (None, *(SWEEP if swept else ())), FLAGS.baselines, swept)
            write(records, bw, checks)
        del wts, wbf16
    print(common.markdown_table(records, ["T", "E", "experts", "variant", "us", "TB/s", "% copy", "error"]))
    print(bw, checks)


if __name__ == "__main__":
    run_app(main)
