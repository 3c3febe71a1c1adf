"""The check of a batch-invariant op: the same rows, computed inside calls of M = 1, 9, 17 and 65 rows (other rows
around them, at other positions), must come out bit for bit the same."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

SIZES = (1, 9, 17, 65)  # one row; a partial row tile; a row tile and one row; several tiles
PROBES = 4  # the rows followed through every call (the 1-row call holds the first)


def probe_outputs(
    fn: Callable[..., object],
    probes: tuple[np.ndarray, ...],
    filler: Callable[[int], tuple[np.ndarray, ...]],
    rng,
    sizes: tuple[int, ...] = SIZES,
) -> list[np.ndarray]:
    """For each M of `sizes`: fn(*inputs) on M rows of `filler(M)` with the first min(M, PROBES) rows of `probes`
    (each input's leading axis is the row) written at distinct random positions -> the output rows at those
    positions, in probe order, as float32 bit patterns."""
    outs = []
    for m in sizes:
        pos = rng.choice(m, size=min(m, PROBES), replace=False)
        inputs = [np.array(f) for f in filler(m)]
        for a, p in zip(inputs, probes, strict=True):
            a[pos] = p[: len(pos)]
        out = np.asarray(fn(*inputs), np.float32)
        outs.append(out[pos].view(np.uint32))
    return outs


def rows_invariant(outs: list[np.ndarray]) -> bool:
    """Every call's probe rows are bitwise equal to the same rows of the largest call."""
    return all(np.array_equal(o, outs[-1][: len(o)]) for o in outs)
