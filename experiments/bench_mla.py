"""Benchmark the MLA decode / tree-verify kernel against the jitted plain-JAX reference.

Measures in the same run the device copy bandwidth and the bf16 matmul rate (the two ceilings), checks each
kernel on the GPU (rel. err vs an f32 reference; the Triton kernel with poisoned partial outputs), then times the
reference and each --kernels entry over a matrix of (context, nodes, batch, heads) cells: `triton`
(`mla_attention.py`) and `mosaic` (`mla_mosaic.py`, default tiling; also each --mosaic_tiling and
--mosaic_splits count). Per cell: time, bytes, FLOPs and the roofline fraction
max(bytes / copy bandwidth, FLOPs / matmul rate) / time; with `--read_floor`, also the time of one XLA kernel that
only reads the cell's cache slots, timed the same way, and the share of the copy bandwidth it reaches: what reading
that many bytes costs at that size with no attention math and no merge. A call's time is the difference between
jitted programs of `--inner` (50; unrolled 10) and 2 x `--inner` dependent calls (`mla_common.per_call_time`):
launch gaps between kernels count, host dispatch and the final sync do not. `--loop` chains the calls in a while
loop that carries the cache and rewrites one slot before each call, as the engine's generation loop does (default),
in a while loop over a loop-invariant cache, or straight-line (unrolled: XLA may then share work between calls on
the same cache, such as the reference's value slice). The cache holds context + N slots (or `--cache_len`, the
engine's allocation for a whole generation) rounded up to `--cache_align` (the engine allocates whole 64-slot
tiles); with --cache_align=1 the Mosaic kernel pads, that is copies, the cache on every call.
Results are rewritten after every cell.

    python -m experiments.bench_mla --preset=targets --kernels=triton,mosaic
    python -m experiments.bench_mla --contexts=8192 --nodes=17,33 --batches=1,8 --heads=64,8 --sweep=mixed
    python -m experiments.bench_mla --preset=custom --contexts=60 --nodes=1 --batches=8 --sweep=decode
    python -m experiments.bench_mla --cells=32768/1/8/64,8192/17/8/64 --kernels=mosaic --check=false
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from ddtree_jax.errors import UserError, run_app
from ddtree_jax.sizing import CACHE_ALIGN  # noqa: E402
from experiments import common  # noqa: E402
from experiments.mla_common import (  # noqa: E402
    DK,
    DV,
    SCALE,
    calls_per_program,
    copy_bandwidth,
    cost,
    looped,
    matmul_rate,
    mosaic_config,
    mosaic_label,
    parse_cell,
    parse_tiling,
    per_call_time,
    random_tree_mask,
    rel_err,
)
from pallas_kernels import mla_mosaic  # noqa: E402
from pallas_kernels.mla_attention import MLAConfig, default_config, mla_attention_split  # noqa: E402
from pallas_kernels.mla_mosaic_config import MosaicMLAConfig, sm_count  # noqa: E402
from pallas_kernels.reference import mla_attention_reference  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "preset",
    "targets",
    ["key", "targets", "full", "custom"],
    "cell matrix (key: the issue's target cells only)",
)
flags.DEFINE_list("contexts", ["60", "1024", "4096", "8192", "32768", "131072"], "prefix lengths (custom)")
flags.DEFINE_list("nodes", ["1", "9", "17", "33", "65"], "new nodes N (custom)")
flags.DEFINE_list("batches", ["1", "8", "32"], "batch sizes (custom)")
flags.DEFINE_list("heads", ["64", "8"], "query heads (custom)")
flags.DEFINE_list("cells", [], "these context/nodes/batch/heads cells, in this order, instead of --preset's")
flags.DEFINE_list("kernels", ["triton", "mosaic"], "kernels to time: any of KERNELS")
flags.DEFINE_enum(
    "sweep", "none", ["none", "mixed", "decode"], "also time a set of Triton tilings: mixed cells, or decode cells"
)
flags.DEFINE_list("mosaic_splits", [], "also time the Mosaic kernel at each of these split counts on every cell")
flags.DEFINE_multi_string(
    "mosaic_tiling",
    [],
    "also check and time the Mosaic kernel with these MosaicMLAConfig fields (repeatable), e.g. "
    "compute_registers=232 or num_stages=1,num_splits=8",
)
flags.DEFINE_integer(
    "inner", None, "time a call from programs of --inner and 2 x --inner calls (default 50, unrolled 10)", lower_bound=1
)
flags.DEFINE_enum(
    "loop",
    "carry",
    ["unrolled", "while", "carry"],
    "how the timed calls are chained: carry (a while loop whose carry holds the cache, one slot rewritten before "
    "each call, as the engine's generation loop holds it), while (a while loop over a loop-invariant cache) or "
    "unrolled (straight-line)",
)
flags.DEFINE_integer(
    "cache_align",
    CACHE_ALIGN,
    "cache length: context + N rounded up to this multiple (1: none)",
    lower_bound=1,
)
flags.DEFINE_integer(
    "cache_len",
    0,
    "allocated cache slots per sequence, as the engine allocates them for a whole generation (the reference reads "
    "them all, the kernels only the cell's tiles); rounded up to --cache_align; 0: context + N",
    lower_bound=0,
)
flags.DEFINE_bool(
    "read_floor",
    True,
    "per cell, also time XLA reading the cell's cache slots (a row reduction) in the same loop: what the bytes "
    "alone cost at this size (read_us, read_of_copy)",
)
flags.DEFINE_bool("check", True, "check each kernel against an f32 reference on the GPU first (about a minute)")
flags.DEFINE_float("mem_gib", 60.0, "skip a path whose working set exceeds this")
flags.DEFINE_integer(
    "ceiling_size", 8192, "matmul sizes n and 2n (the best rate); the copy moves ceiling_size^2 * 16 bf16 values"
)
flags.DEFINE_bool("interpret", False, "run the Triton kernel in Pallas interpret mode (CPU smoke test)")
flags.DEFINE_string("out_dir", None, "results directory (default experiments/results)")
flags.DEFINE_string("name", "bench_mla", "results file stem")

SWEEP_CONFIGS = [
    MLAConfig(block_r=64, block_k=32, num_warps=8, num_stages=3),
    MLAConfig(block_r=64, block_k=64, num_warps=8, num_stages=2),
    MLAConfig(block_r=64, block_k=32, num_warps=4, num_stages=3),
    MLAConfig(block_r=64, block_k=64, num_warps=4, num_stages=2),
    MLAConfig(block_r=16, block_k=64, num_warps=4, num_stages=3),
    MLAConfig(block_r=16, block_k=128, num_warps=4, num_stages=2),
]
SWEEP_CELLS = [
    (4096, 1, 8, 64),
    (32768, 1, 8, 64),
    (8192, 1, 8, 8),
    (8192, 17, 1, 64),
    (8192, 33, 8, 64),
    (8192, 17, 8, 8),
]

# Decode tilings: (block_r, block_k, num_warps, num_stages) per head count, each at split counts aiming for one,
# two and three programs per SM (one wave or more, whatever fits in SMEM).
DECODE_SWEEP_CELLS = [(8192, 1, 32, 8), (32768, 1, 8, 8), (8192, 1, 32, 64), (32768, 1, 8, 64)]
DECODE_TILINGS = {
    8: [(16, 64, 4, 3), (16, 64, 8, 3), (16, 32, 4, 4), (16, 32, 4, 2), (16, 32, 4, 3), (16, 64, 4, 2)],
    64: [(64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 8, 2)],
}
DECODE_PROGRAMS_PER_SM = (1, 2, 3)


def decode_sweep() -> list[tuple[tuple[int, int, int, int], list[tuple[str, MLAConfig]]]]:
    """(cell, Triton configs) for the decode tiling sweep: every tiling x programs per SM."""
    work = []
    for cell in DECODE_SWEEP_CELLS:
        _, _, batch, heads = cell
        configs = []
        tilings = itertools.product(DECODE_TILINGS[heads], DECODE_PROGRAMS_PER_SM)
        for (block_r, block_k, warps, stages), per_sm in tilings:
            programs = batch * pl.cdiv(heads, block_r)
            splits = max(1, round(per_sm * sm_count() / programs))
            configs.append(("triton", MLAConfig(block_r, block_k, splits, warps, stages)))
        work.append((cell, configs))
    return work


def cells() -> list[tuple[int, int, int, int]]:
    """(context, nodes, batch, heads) cells: --cells if given, else the selected preset's."""
    if FLAGS.cells:
        return [parse_cell(c) for c in FLAGS.cells]
    if FLAGS.preset == "key":
        decode = [(c, 1, b, h) for c, b in ((4096, 8), (8192, 32), (32768, 8)) for h in (64, 8)]
        return [
            (60, 1, 1, 64),
            *decode,
            *[(8192, n, b, h) for n in (17, 33) for b in (1, 8) for h in (64, 8)],
        ]
    if FLAGS.preset == "custom":
        lists = [[int(v) for v in getattr(FLAGS, f)] for f in ("contexts", "nodes", "batches", "heads")]
        return list(itertools.product(*lists))
    out = [(c, 1, b, h) for c in (4096, 8192, 32768, 131072) for b in (8, 32) for h in (64, 8)]
    out += [(c, 1, 1, h) for c in (60, 4096, 32768) for h in (64, 8)]
    out += [(8192, n, b, h) for n in (9, 17, 33, 65) for b in (1, 8) for h in (64, 8)]
    out += [(c, n, 8, h) for c in (60, 1024, 32768) for n in (17, 65) for h in (64, 8)]
    if FLAGS.preset == "full":
        out += [(c, n, 32, h) for c in (1024, 8192) for n in (9, 17, 33, 65) for h in (64, 8)]
    return out


def make_inputs(rng: np.random.Generator, context: int, n: int, batch: int, heads: int, slots: int = 0):
    """Random bf16 q `[B, N, Hq, 576]`, cache `[B, L, 576]` (L = `slots` or context + N, rounded up to
    --cache_align), prefix_len = context, tree mask."""
    key_q, key_c = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    q = jax.random.normal(key_q, (batch, n, heads, DK), jnp.bfloat16)
    length = pl.cdiv(slots or context + n, FLAGS.cache_align) * FLAGS.cache_align
    cache = jax.random.normal(key_c, (batch, length, DK), jnp.bfloat16)
    prefix = jnp.full((batch,), context, jnp.int32)
    return q, cache, prefix, jnp.asarray(random_tree_mask(rng, batch, n))


def time_per_call(fn: Callable[..., jax.Array], args: Sequence[Any]) -> tuple[float, float]:
    """(seconds per call of fn(*args), seconds paid once per timed program): `per_call_time` over --loop chains."""
    run = looped(fn, FLAGS.loop)
    return per_call_time(lambda k: functools.partial(run, *args, k), calls_per_program(FLAGS.loop, FLAGS.inner))


KERNELS = ("triton", "mosaic")
Kernel = Callable[..., jax.Array]  # (q, cache, prefix, mask) -> [B, N, Hq, 512]


def kernel(
    name: str,
    batch: int,
    rows: int,
    length: int,
    splits: int | MLAConfig | MosaicMLAConfig | None = None,
    poison: bool = False,
) -> tuple[Kernel, str]:
    """The kernel `name` with its default tiling for this shape and a config label; `splits`: a Triton tiling, or
    what `mosaic_config` takes; `poison`: NaN-filled Triton partial outputs (a check)."""
    if name == "triton":
        cfg = splits or default_config(batch, rows, length)
        label = f"r{cfg.block_r}k{cfg.block_k}s{cfg.num_splits}w{cfg.num_warps}st{cfg.num_stages}"
        return lambda q, c, p, m: mla_attention_split(
            q, c, p, m, SCALE, DV, config=cfg, poison=poison, interpret=FLAGS.interpret
        ), label
    cfg = mosaic_config(batch, rows, length, splits)
    return lambda q, c, p, m: mla_mosaic.mla_attention_mosaic_split(q, c, p, m, SCALE, DV, config=cfg), mosaic_label(
        cfg
    )


def check(rng: np.random.Generator, kernels: list[tuple[str, MosaicMLAConfig | None]]) -> list[dict[str, Any]]:
    """GPU correctness of each (kernel name, Mosaic tiling or None) entry: ragged prefixes, random trees (poisoned
    partials for Triton), and one cache whose slot norms grow 4x along it (rows' running maxima keep moving in late
    tiles: `lazy_rescale`'s rescales); rel. err vs an f32 reference."""
    records = []
    shrink = 50 if FLAGS.interpret else 1  # interpret mode is slow: shorter contexts
    cells = [(4000, 1, 4, 64, 1.0), (8100, 17, 3, 8, 1.0), (300, 33, 2, 64, 1.0), (50, 65, 2, 8, 1.0)]
    for context, n, batch, heads, growth in [*cells, (2000, 17, 2, 64, 4.0)]:
        context //= shrink
        q, cache, _, mask = make_inputs(rng, context, n, batch, heads)
        if growth != 1.0:
            norms = jnp.linspace(1.0, growth, cache.shape[1])[None, :, None]
            cache = (cache.astype(jnp.float32) * norms).astype(cache.dtype)
        prefix = jnp.asarray(rng.integers(0, context + 1, batch), jnp.int32)
        with jax.default_matmul_precision("highest"):
            ref = mla_attention_reference(q.astype(jnp.float32), cache.astype(jnp.float32), prefix, mask, SCALE)
        for name, tiling in kernels:
            fn, label = kernel(name, batch, n * heads, cache.shape[1], tiling, poison=True)
            err = rel_err(fn(q, cache, prefix, mask), ref)
            records.append(
                {
                    "kernel": name,
                    "context": context,
                    "nodes": n,
                    "batch": batch,
                    "heads": heads,
                    "growth": growth,
                    "slots": cache.shape[1],
                    "rel_err": err,
                    "ok": bool(err < 1e-2),
                    "config": label,
                }
            )
            logging.info("check %s", records[-1])
    return records


def read_slots(length: int, q: jax.Array, cache: jax.Array, prefix: jax.Array, mask: jax.Array) -> jax.Array:
    """`[B, length, 1, 1]`: the max of each of the first `length` cache slots `[B, L, 576]`, so each of their bytes
    is read once (the size-matched floor for the call's bytes; q, prefix and mask are unused)."""
    del q, prefix, mask
    return jnp.max(cache[:, :length], axis=2)[:, :, None, None]


def bench_cell(
    rng: np.random.Generator,
    cell: tuple[int, int, int, int],
    ceilings: dict[str, float],
    kernels: Sequence[tuple[str, int | MLAConfig | None]],
) -> list[dict[str, Any]]:
    """Time the reference and each (kernel name, `kernel`'s splits argument) on one cell; one record per kernel."""
    context, n, batch, heads = cell
    nbytes, flops = cost(*cell)
    floor = max(nbytes / ceilings["bw"], flops / ceilings["mm"])
    q, cache, prefix, mask = make_inputs(rng, context, n, batch, heads, FLAGS.cache_len)
    base = {
        "context": context,
        "nodes": n,
        "batch": batch,
        "heads": heads,
        "MB": nbytes / 1e6,
        "GFLOP": flops / 1e9,
        "floor_us": floor * 1e6,
        "slots": cache.shape[1],
    }
    ref_set = 3 * batch * n * heads * cache.shape[1] * 4
    ref_t = float("nan")
    if ref_set < FLAGS.mem_gib * 2**30:
        ref_fn = lambda q_, c_, p_, m_: mla_attention_reference(q_, c_, p_, m_, SCALE, DV)
        ref_t, _ = time_per_call(ref_fn, (q, cache, prefix, mask))
    if FLAGS.read_floor:
        read_t, _ = time_per_call(functools.partial(read_slots, context + n), (q, cache, prefix, mask))
        base |= {"read_us": read_t * 1e6, "read_of_copy": batch * (context + n) * DK * 2 / ceilings["bw"] / read_t}
    records = []
    for name, splits in kernels:
        fn, label = kernel(name, batch, n * heads, cache.shape[1], splits)
        try:
            t, once = time_per_call(fn, (q, cache, prefix, mask))
        except Exception as e:  # noqa: BLE001 - one failing kernel or tiling must not end the run
            logging.warning("cell %s kernel %s %s failed: %s", cell, name, label, str(e)[:300])
            continue
        records.append(
            {
                **base,
                "kernel": name,
                "ref_us": ref_t * 1e6,
                "kernel_us": t * 1e6,
                "once_us": once * 1e6,
                "speedup": ref_t / t,
                "TB/s": nbytes / t / 1e12,
                "TFLOP/s": flops / t / 1e12,
                "roofline": floor / t,
                "ref_roofline": floor / ref_t,
                "bound": "mem" if nbytes / ceilings["bw"] > flops / ceilings["mm"] else "mma",
                "config": label,
            }
        )
        logging.info("%s", records[-1])
    return records


def main(argv: Sequence[str]) -> None:
    del argv
    if unknown := sorted(set(FLAGS.kernels) - set(KERNELS)):
        raise UserError(f"--kernels: unknown {unknown}; choose from {list(KERNELS)}")
    tilings = [("mosaic", parse_tiling(text)) for text in FLAGS.mosaic_tiling]  # bad values fail before measuring
    if FLAGS.interpret and ("mosaic" in FLAGS.kernels or tilings or FLAGS.mosaic_splits):
        raise UserError("--interpret runs the Triton kernel only (the Mosaic kernel's interpreter is the tests')")
    grid = cells()
    if FLAGS.cache_len and (short := [c for c in grid if c[0] + c[1] > FLAGS.cache_len]):
        raise UserError(f"--cache_len={FLAGS.cache_len} is shorter than context + nodes of cell {short[0]}")
    t0 = time.time()
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(FLAGS.ceiling_size)
    mm = matmul_rate(FLAGS.ceiling_size)
    ceilings = {"bw": bw.get("torch_copy_tbps", bw["xla_add_tbps"]) * 1e12, "mm": mm}
    logging.info("ceilings: %s, matmul %.1f TFLOP/s", bw, mm / 1e12)
    checks = check(rng, [(name, None) for name in FLAGS.kernels] + tilings) if FLAGS.check else []
    columns = [
        "context",
        "nodes",
        "batch",
        "heads",
        "slots",
        "kernel",
        "ref_us",
        "kernel_us",
        "once_us",
        "speedup",
        "MB",
        "GFLOP",
        "TB/s",
        "TFLOP/s",
        "bound",
        "roofline",
        "ref_roofline",
        "read_us",
        "read_of_copy",
        "config",
    ]
    extra = {
        "ceilings": {**bw, "matmul_tflops": mm / 1e12, "roofline_bw_tbps": ceilings["bw"] / 1e12},
        "checks": checks,
        "inner": calls_per_program(FLAGS.loop, FLAGS.inner),
        "loop": FLAGS.loop,
        "cache_align": FLAGS.cache_align,
    }
    work = [(cell, [(name, None) for name in FLAGS.kernels]) for cell in grid]
    work += [(cell, [("triton", c) for c in SWEEP_CONFIGS]) for cell in SWEEP_CELLS] if FLAGS.sweep == "mixed" else []
    work += decode_sweep() if FLAGS.sweep == "decode" else []
    work += [(cell, [("mosaic", int(s)) for s in FLAGS.mosaic_splits]) for cell in grid] if FLAGS.mosaic_splits else []
    work += [(cell, tilings) for cell in grid] if tilings else []
    records = []
    for cell, configs in work:
        records += bench_cell(rng, cell, ceilings, configs)
        path = common.write_results(FLAGS.name, records, columns, FLAGS.out_dir, {**extra, "wall_s": time.time() - t0})
    print(f"ceilings: {extra['ceilings']}")
    print("checks:", [(c["kernel"], c["nodes"], c["heads"], f"{c['rel_err']:.1e}") for c in checks])
    print(common.markdown_table(records, columns))
    print(f"wrote {path} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    run_app(main)
