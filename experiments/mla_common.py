"""Shapes, inputs and accounting shared by the MLA kernel benchmarks (`bench_mla`, `check_mla_mosaic`)."""

from __future__ import annotations

import jax
import numpy as np

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
