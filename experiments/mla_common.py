"""Shared by the MLA kernel benchmarks (`bench_mla`, `bench_mla_stream`, `check_mla_mosaic`, `profile_mla`):
shapes, inputs, accounting, ceilings, the timed-loop builder, the cache-streaming kernel and the Mosaic tiling
parser. No flags, so tests can import it."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from ddtree_jax.errors import UserError
from experiments import common
from pallas_kernels.mla_mosaic_config import BLOCK_K, MosaicMLAConfig, default_config

DK, DV, SCALE = 576, 512, 0.1446796  # K2.6 latent + rope dims, value dims, softmax scale
# An H200 that need not be there: the Triton lowering asks the mesh for the GPU it compiles for.
H200_MESH = AbstractMesh(
    (1,),
    ("x",),
    axis_types=(AxisType.Auto,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)


def lower_for_h200(fn: Callable[..., Any], *shapes: jax.ShapeDtypeStruct) -> str:
    """StableHLO text of jit(fn) on these abstract inputs, lowered for CUDA on a machine without a GPU."""
    with use_abstract_mesh(H200_MESH):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def abstract_inputs(
    batch: int, nodes: int, heads: int, length: int, dtype: Any = jnp.bfloat16
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of one attention call's (q `[B, N, Hq, 576]`, latent cache `[B, L, 576]`, prefix_len `[B]`,
    tree_mask `[B, N, N]`), for lowering without data."""
    return (
        jax.ShapeDtypeStruct((batch, nodes, heads, DK), dtype),
        jax.ShapeDtypeStruct((batch, length, DK), dtype),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, nodes, nodes), jnp.bool_),
    )


def parse_tiling(text: str) -> MosaicMLAConfig:
    """'field=value,...' -> the default MosaicMLAConfig with those fields replaced (`MosaicMLAConfig.from_text`);
    a UserError naming the problem for an unknown field, a value of the wrong type or an impossible tiling."""
    try:
        return MosaicMLAConfig.from_text(text)
    except ValueError as e:
        raise UserError(str(e)) from None


def parse_cell(text: str) -> tuple[int, int, int, int]:
    """'context/nodes/batch/heads' -> four ints (a UserError naming the cell if malformed)."""
    parts = text.split("/")
    if len(parts) != 4 or not all(p.isdigit() for p in parts) or not all(int(p) > 0 for p in parts[1:]):
        raise UserError(f"--cells: {text!r} is not context/nodes/batch/heads (non-negative context, positive rest)")
    context, nodes, batch, heads = map(int, parts)
    return context, nodes, batch, heads


def random_tree_mask(rng: np.random.Generator, batch: int, n: int) -> np.ndarray:
    """Ancestor-or-self masks `[B, N, N]` of random trees (parents[i] < i)."""
    mask = np.zeros((batch, n, n), bool)
    for b in range(batch):
        for i in range(n):
            mask[b, i] = mask[b, rng.integers(0, i)] if i else False
            mask[b, i, i] = True
    return mask


def cost(context: int, n: int, batch: int, heads: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one call: cache rows read once, q read, output written; QK (576) + PV (512) MACs."""
    length = context + n
    nbytes = batch * (length * DK + n * heads * (DK + DV)) * 2
    flops = 2.0 * batch * n * heads * length * (DK + DV)
    return nbytes, flops


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    """||out - ref|| / ||ref|| in f64 on the host (NaN if out holds NaN)."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(o - r) / np.linalg.norm(r))


def copy_bandwidth(size: int) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written per second) over size^2 * 16 bf16 values: PyTorch copy_ if
    importable, and XLA x + 1."""
    out = {}
    n = size**2 * 16
    f = jax.jit(lambda a: a + 1)
    x = jnp.ones((n,), jnp.bfloat16) * 3
    out["xla_add_tbps"] = 2 * x.nbytes / common.time_fn(lambda: f(x)) / 1e12
    x.delete()
    try:
        import torch
    except ImportError:
        return out
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        b.copy_(a)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    out["torch_copy_tbps"] = 2 * a.numel() * 2 * 10 / (start.elapsed_time(end) * 1e-3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return out


def matmul_rate(n: int) -> float:
    """bf16 matmul rate through XLA, FLOP/s (random data): the best of 20 timed products at n x n and at 2n x 2n.
    A ceiling is the best rate the device reaches; the median of one size moved 13 % between H200 machine starts
    (594-675 TFLOP/s at 8192)."""
    f = jax.jit(lambda x, y: x @ y)

    def rate(size: int) -> float:
        ka, kb = jax.random.split(jax.random.key(size))
        a = jax.random.normal(ka, (size, size), jnp.bfloat16)
        b = jax.random.normal(kb, (size, size), jnp.bfloat16)
        return 2 * size**3 / common.time_fn(lambda: f(a, b), repeats=20, stat=min)

    return max(rate(n), rate(2 * n))


def looped(fn: Callable[..., jax.Array], loop: str = "unrolled") -> Callable[..., jax.Array]:
    """jit of (q, cache, prefix, mask, k) -> q after k dependent calls of fn(q, cache, prefix, mask); q[0,0,0,0] is
    rewritten each step, so nothing is hoisted. loop: "unrolled" (no while loop), "while" (the cache is
    loop-invariant) or "carry" (the cache is in the loop carry and slot prefix[0] of row 0 is rewritten before each
    call, as the engine writes the new nodes' latents and then attends). k is static: with a traced trip count XLA
    reads the loop predicate back to the host every iteration (12-15 us per call on the H200, measured)."""

    def run(q, cache, prefix, mask, k):
        def body(_, carry):
            q, cache = carry
            if loop == "carry":
                cache = cache.at[0, prefix[0], 0].set(q[0, 0, 0, 1].astype(cache.dtype))
            o = fn(q, cache, prefix, mask)
            q = q.at[0, 0, 0, 0].set(q[0, 0, 0, 0] + 0 * o[0, 0, 0, 0].astype(q.dtype))
            return q, cache

        if loop == "carry":
            return lax.fori_loop(0, k, body, (q, cache))[0]
        return lax.fori_loop(0, k, lambda i, q: body(i, (q, cache))[0], q, unroll=loop == "unrolled")

    return jax.jit(run, static_argnums=(4,))


def calls_per_program(loop: str, inner: int | None = None) -> int:
    """Calls in the shorter timed program: `inner`, else 50 in a while loop and 10 unrolled (a straight-line
    program compiles every call)."""
    return inner or (10 if loop == "unrolled" else 50)


def per_call_time(build: Callable[[int], Callable[[], Any]], inner: int, repeats: int = 11) -> tuple[float, float]:
    """(seconds per call, seconds paid once per program) from `build(k)`, a no-argument program of k chained calls,
    at k = inner and 2 * inner, run alternately `repeats` times after a warm-up: per call = the difference of the
    two medians / inner, which leaves out what each program pays once (host dispatch, the sync, the first
    launch's latency); the rest of the shorter program's median is the once-per-program cost. A call shorter than
    the programs' run-to-run noise can come out at or below zero: it is returned as measured and logged."""
    short, long = build(inner), build(2 * inner)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats + 1):
        for prog, ts in ((short, times[0]), (long, times[1])):
            t0 = time.perf_counter()
            jax.block_until_ready(prog())
            ts.append(time.perf_counter() - t0)
    t1, t2 = (statistics.median(ts[1:]) for ts in times)
    per = (t2 - t1) / inner
    if per <= 0:
        logging.warning("per-call time %.3g us is below the timing noise (%d vs %d calls: %.6g s, %.6g s)",
                        per * 1e6, inner, 2 * inner, t1, t2)  # fmt: skip
    return per, t1 - inner * per


def _stream_kernel(token_ref, kv_ref, o_ref, kv_smem, kv_bars, free_bars, *, block_k: int, stages: int, tiles: int):
    """CTA (split, batch) streams tiles [split * tiles, (split + 1) * tiles) of kv_ref `[B, L, dk]` through the
    ring kv_smem `[stages, block_k, dk]`; o_ref `[B, splits]` f32 gets one value per CTA."""
    wg = lax.axis_index("wg")
    b = lax.axis_index("batch")
    split = lax.axis_index("split")
    t_lo = split * tiles

    @pl.when(wg == 0)
    def _consume():
        @pl.loop(0, tiles)
        def _(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(kv_bars.at[slot])
            plgpu.barrier_arrive(free_bars.at[slot])

    @pl.when(wg == 1)
    def _memory():
        @pl.loop(0, tiles)
        def _(step):
            slot = lax.rem(step, stages)

            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(free_bars.at[slot])

            t = t_lo + step
            plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(t * block_k, block_k)], kv_smem.at[slot], kv_bars.at[slot])

        @pl.loop(jnp.maximum(tiles - stages, 0), tiles)
        def _(step):
            plgpu.barrier_wait(free_bars.at[lax.rem(step, stages)])

    del token_ref, o_ref  # token: a loop-carried input, so a timing loop cannot hoist the call; o_ref: unwritten


@functools.partial(jax.jit, static_argnames=("block_k", "stages", "splits"))
def stream(token: jax.Array, cache: jax.Array, *, block_k: int, stages: int, splits: int) -> jax.Array:
    """Stream `cache` `[B, L, dk]` (L divisible by splits * block_k) once through the ring; token `[1]` f32 is
    unused; -> `[B, splits]` (unwritten)."""
    b, length, dk = cache.shape
    tiles = length // (splits * block_k)
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        functools.partial(_stream_kernel, block_k=block_k, stages=stages, tiles=tiles),
        out_type=jax.ShapeDtypeStruct((b, splits), jnp.float32),
        scratch_types=[
            plgpu.SMEM((stages, block_k, dk), cache.dtype, transforms=swizzled),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ],
        grid=(splits, b),
        grid_names=("split", "batch"),
        num_threads=2,
        thread_name="wg",
    )
    return kernel(token, cache)


def whole_wave_splits(batch: int, n_tiles: int, slots: int) -> int:
    """The largest split count s dividing n_tiles with batch * s <= slots (CTAs in one wave), at least 1."""
    fits = [s for s in range(1, n_tiles + 1) if n_tiles % s == 0 and batch * s <= slots]
    return max(fits, default=1)


def mosaic_config(batch: int, rows: int, length: int, splits: int | MosaicMLAConfig | None) -> MosaicMLAConfig:
    """The Mosaic kernel's tiling for this shape: `splits` a split count replacing the chosen one, or a tiling (its
    split count chosen for the shape unless it sets one), or None (the kernel's default tiling)."""
    tiling = splits if isinstance(splits, MosaicMLAConfig) else MosaicMLAConfig()
    cfg = tiling if tiling.num_splits else default_config(batch, rows, length, tiling)
    return dataclasses.replace(cfg, num_splits=splits) if isinstance(splits, int) else cfg


def mosaic_label(cfg: MosaicMLAConfig) -> str:
    """A short name of a Mosaic tiling: tile, splits and stages, then the registers if not the default's."""
    label = f"k{BLOCK_K}s{cfg.num_splits}st{cfg.num_stages}"
    return label + ("" if cfg.compute_registers == MosaicMLAConfig().compute_registers else f"r{cfg.compute_registers}")
