"""Shapes, inputs and accounting shared by the MLA kernel benchmarks (`bench_mla`, `check_mla_mosaic`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common

DK, DV, SCALE = 576, 512, 0.1446796  # K2.6 latent + rope dims, value dims, softmax scale


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
    """bf16 n x n matmul rate through XLA, FLOP/s (random data)."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / common.time_fn(lambda: f(a, b))
