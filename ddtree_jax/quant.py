"""INT4 compressed-tensors `pack-quantized` format, in numpy (kimi_k2.md §5).

Signed int4 values q in [-8, 7] are stored offset-binary (u = q + 8), eight per little-endian int32 word along
the input (last) axis, the lowest element index in the lowest nibble. Dequant: w = q * scale[..., j // G].
All functions work on the last axis and accept any leading dims; `unpack_int4_device` is the jnp twin of
`unpack_int32_to_int4` that the checkpoint loader runs on the accelerator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

GROUP_SIZE = 32
QMAX = 7  # Kimi's QAT grid is [-7, 7]: scale = absmax / 7.


def unpack_int32_to_int4(packed: np.ndarray) -> np.ndarray:
    """int32 `[..., K/8]` -> int8 `[..., K]` with values in [-8, 7]."""
    if packed.dtype != np.int32:
        raise ValueError(f"packed INT4 must be int32, got {packed.dtype}")
    b = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8)  # [..., K/2]: byte k = elements 2k, 2k+1
    out = np.empty((*b.shape[:-1], 2 * b.shape[-1]), np.int8)
    out[..., 0::2] = (b & 0xF).view(np.int8)
    out[..., 1::2] = (b >> 4).view(np.int8)
    out -= 8
    return out


def unpack_int4_device(packed: jax.Array) -> jax.Array:
    """int32 `[..., K/8]` -> jnp.int4 `[..., K]` on the device (kimi_k2.md §5, "Loading into JAX").

    Each little-endian byte holds elements 2k (low nibble) and 2k+1; XOR 0x88 maps offset-binary u to the
    two's-complement nibble of u - 8, and bitcasting a byte to int4 yields (low, high).
    """
    b = jax.lax.bitcast_convert_type(packed, jnp.uint8) ^ jnp.uint8(0x88)  # [..., K/8, 4]
    return jax.lax.bitcast_convert_type(b, jnp.int4).reshape(*packed.shape[:-1], -1)


def pack_int4_to_int32(q: np.ndarray) -> np.ndarray:
    """int `[..., K]` with values in [-8, 7] (K % 8 == 0) -> int32 `[..., K/8]`."""
    if q.shape[-1] % 8:
        raise ValueError(f"last dim {q.shape[-1]} is not a multiple of 8")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError("values outside the int4 range [-8, 7]")
    u = (np.asarray(q, np.int16) + 8).astype(np.uint8)
    b = u[..., 0::2] | (u[..., 1::2] << 4)
    return np.ascontiguousarray(b).view("<i4").astype(np.int32)


def quantize_group(w: np.ndarray, group: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-group INT4: float `[..., K]` -> (q int8 `[..., K]` in [-7, 7], scale bf16 `[..., K/G]`).

    scale = absmax / 7 over each group of `group` inputs, rounded to bf16 (as stored); all-zero groups get
    scale 0 and q 0.
    """
    if w.shape[-1] % group:
        raise ValueError(f"last dim {w.shape[-1]} is not a multiple of the group size {group}")
    wf = np.asarray(w, np.float32).reshape(*w.shape[:-1], -1, group)
    scale = (np.abs(wf).max(axis=-1) / QMAX).astype(ml_dtypes.bfloat16)
    s = scale.astype(np.float32)[..., None]
    q = np.divide(wf, s, out=np.zeros_like(wf), where=s > 0)
    q = np.clip(np.rint(q), -QMAX, QMAX).astype(np.int8)
    return q.reshape(w.shape), scale


def dequantize(q: np.ndarray, scale: np.ndarray, dtype: np.dtype = np.float32) -> np.ndarray:
    """q `[..., K]` with scales `[..., K/G]` -> `[..., K]` in `dtype` (w = q * scale, computed in f32)."""
    group = q.shape[-1] // scale.shape[-1]
    s = np.repeat(np.asarray(scale, np.float32), group, axis=-1)
    return (np.asarray(q, np.float32) * s).astype(dtype)
