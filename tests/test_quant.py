"""INT4 pack-quantized format: bit order against hand-built words, round trips, quantization error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddtree_jax import quant


def _words(*hex_words: int) -> np.ndarray:
    return np.array([hex_words], np.uint32).view(np.int32)


def _unpack_by_shifts(packed: np.ndarray) -> np.ndarray:
    """Independent reference: element j = ((word[j // 8] >> 4 (j % 8)) & 0xF) - 8, with 64-bit shifts."""
    w = packed.astype(np.int64) & 0xFFFFFFFF
    nib = (w[..., :, None] >> (4 * np.arange(8))) & 0xF
    return (nib - 8).reshape(*packed.shape[:-1], -1)


def test_unpack_hand_built_words():
    # 0x76543210: nibbles 0..7 from the lowest; 0xFEDCBA98 (a negative int32): nibbles 8..15.
    got = quant.unpack_int32_to_int4(_words(0x76543210, 0xFEDCBA98, 0x0000000F, 0x80000000))
    want = [*range(-8, 0), *range(0, 8), 7, *[-8] * 7, *[-8] * 7, 0]
    np.testing.assert_array_equal(got, np.array([want], np.int8))
    assert got.dtype == np.int8


def test_pack_hand_built_words():
    q = np.array([[*range(-8, 0), *range(0, 8)]], np.int8)
    np.testing.assert_array_equal(quant.pack_int4_to_int32(q), _words(0x76543210, 0xFEDCBA98))


def test_unpack_matches_shift_reference_and_jax_bitcast():
    rng = np.random.default_rng(0)
    packed = rng.integers(-(2**31), 2**31, size=(3, 5, 16), dtype=np.int64).astype(np.int32)
    got = quant.unpack_int32_to_int4(packed)
    np.testing.assert_array_equal(got, _unpack_by_shifts(packed))
    # The spec's device path: bytes XOR 0x88, bitcast to int4 pairs (low nibble first).
    as_bytes = jnp.asarray(packed.view(np.uint8)) ^ jnp.uint8(0x88)
    via_jax = jax.lax.bitcast_convert_type(as_bytes, jnp.int4).reshape(got.shape)
    np.testing.assert_array_equal(np.asarray(via_jax.astype(jnp.int8)), got)


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, size=(2, 7, 64)).astype(np.int8)
    packed = quant.pack_int4_to_int32(q)
    assert packed.dtype == np.int32 and packed.shape == (2, 7, 8)
    np.testing.assert_array_equal(_unpack_by_shifts(packed), q)
    np.testing.assert_array_equal(quant.unpack_int32_to_int4(packed), q)


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError, match="int4 range"):
        quant.pack_int4_to_int32(np.full((1, 8), 8, np.int8))


def test_quantize_group_error_bound_and_zero_groups():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 128)).astype(np.float32) * rng.uniform(0.01, 3.0, size=(6, 1))
    w[2, 32:64] = 0.0  # an all-zero group
    q, scale = quant.quantize_group(w, 32)
    assert q.dtype == np.int8 and scale.dtype == ml_dtypes.bfloat16 and scale.shape == (6, 4)
    assert q.min() >= -7 and q.max() <= 7
    groups = w.astype(np.float64).reshape(6, 4, 32)
    absmax = np.abs(groups).max(-1)
    s64 = scale.astype(np.float64)
    np.testing.assert_allclose(s64, absmax / 7, rtol=2**-8)  # bf16 rounding of absmax / 7
    assert s64[2, 1] == 0 and not q[2, 32:64].any()
    err = np.abs(groups - q.reshape(6, 4, 32) * s64[..., None]).max(-1)
    assert np.all(err <= s64 * 0.5 * (1 + 2**-6) + 1e-30)
    assert np.all(np.abs(q.reshape(6, 4, 32)).max(-1)[absmax > 0] == 7)  # the grid is used fully


def test_dequantize_matches_float64():
    rng = np.random.default_rng(3)
    q = rng.integers(-7, 8, size=(4, 64)).astype(np.int8)
    scale = rng.uniform(1e-3, 1.0, size=(4, 2)).astype(ml_dtypes.bfloat16)
    want = q.astype(np.float64) * np.repeat(scale.astype(np.float64), 32, axis=-1)
    got = quant.dequantize(q, scale)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-7)


def test_unpack_int4_device_matches_numpy():
    rng = np.random.default_rng(4)
    packed = rng.integers(-(2**31), 2**31, size=(2, 3, 12), dtype=np.int64).astype(np.int32)
    got = quant.unpack_int4_device(jnp.asarray(packed))
    assert got.dtype == jnp.int4 and got.shape == (2, 3, 96)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.int8)), _unpack_by_shifts(packed))
