"""GPU check of the drafter FFN kernel, compiled: `dispatch.drafter_ffn` in "pallas" mode against the reference at
the shipped mini drafter's sizes (hidden 256, inner 1536), bf16 and f32, 8, 100 and 256 rows. Prints one line per
cell and exits 1 if any differs by more than 2% of the reference's largest value.

    python -m experiments.check_drafter_ffn
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels.dispatch import Kernels
from pallas_kernels.reference import DrafterFFNWeights, drafter_ffn_reference

HIDDEN, INNER, EPS = 256, 1536, 1e-6


def main() -> int:
    rng = np.random.default_rng(0)
    failed = 0
    kernel = jax.jit(lambda x, w: dispatch.drafter_ffn(Kernels().with_mode("pallas"), x, w, EPS))
    reference = jax.jit(lambda x, w: drafter_ffn_reference(x, w, EPS))
    for dtype in (jnp.bfloat16, jnp.float32):

        def normal(shape, scale=1.0, dtype=dtype):
            return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

        w = DrafterFFNWeights(
            normal((HIDDEN,), 0.1) + 1,
            normal((HIDDEN, INNER), HIDDEN**-0.5),
            normal((HIDDEN, INNER), HIDDEN**-0.5),
            normal((INNER, HIDDEN), INNER**-0.5),
        )
        for rows in (8, 100, 256):
            x = normal((rows, HIDDEN), 2.0)
            got, want = kernel(x, w), reference(x, w)
            err, scale = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))
            ok = err <= 2e-2 * scale
            failed += not ok
            print(f"{jnp.dtype(dtype).name} rows {rows}: max diff {err:.3g} of {scale:.3g} {'OK' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
