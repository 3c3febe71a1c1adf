"""Where a speculative output leaves the AR output, and how close the target's choice was there."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def divergence(target, target32, prompt: list[int], ref: list[int], out: list[int]) -> dict:
    """First position where `out` leaves `ref`, with the logit gap ref - out there under `target` and `target32`."""
    pos = next(k for k in range(min(len(ref), len(out))) if ref[k] != out[k])
    seq = jnp.asarray([prompt + ref[:pos]], jnp.int32)
    row = {"position": pos, "ar_token": ref[pos], "token": out[pos]}
    n = seq.shape[1]
    for name, model in (("gap", target), ("gap_f32", target32)):
        hidden = model(seq, jnp.arange(n)[None], model.init_cache(1, n), jnp.zeros((1,), jnp.int32)).hidden
        logits = np.asarray(model.logits(hidden[:, -1]))[0]
        row[name] = round(float(logits[ref[pos]] - logits[out[pos]]), 4)
    return row
