"""The kernel dispatch point: which implementation runs for which mode, backend and shape."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from pallas_kernels import dispatch
from pallas_kernels.mla_attention import mla_attention_pallas
from pallas_kernels.mla_mosaic import mla_attention_mosaic


@pytest.fixture(autouse=True)
def restore_backend():
    yield
    dispatch.set_mla_backend("triton")


def shapes(dk: int, dtype=jnp.bfloat16):
    return jnp.zeros((2, 3, 8, dk), dtype), jnp.zeros((2, 64, dk), dtype)


def test_mla_backend_selects_the_kernel_the_shapes_allow():
    q, cache = shapes(576)
    assert dispatch.mla_kernel_for(q, cache, 512) is mla_attention_pallas  # default: Triton
    dispatch.set_mla_backend("mosaic")
    assert dispatch.mla_kernel_for(q, cache, 512) is mla_attention_mosaic
    assert dispatch.mla_kernel_for(*shapes(160), 128) is mla_attention_pallas  # 64 does not divide Dk
    assert dispatch.mla_kernel_for(q, cache, 448) is mla_attention_pallas  # 128 does not divide value_dim
    assert dispatch.mla_kernel_for(*shapes(576, jnp.float32), 512) is mla_attention_pallas


def test_reference_mode_never_calls_a_kernel(monkeypatch):
    monkeypatch.setattr(dispatch, "mla_kernel_for", lambda *a: pytest.fail("kernel chosen in reference mode"))
    q, cache = shapes(576)
    with dispatch.use_kernels("reference"):
        out = dispatch.mla_attention(q, cache, jnp.zeros((2,), jnp.int32), jnp.ones((2, 3, 3), bool), 0.1)
    assert out.shape == (2, 3, 8, 512)


@pytest.mark.parametrize("var,value", [("DDTREE_KERNELS", "fast"), ("DDTREE_MLA_KERNEL", "cutlass")])
def test_unknown_environment_values_fail_naming_them(var, value):
    env = {**os.environ, var: value, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", "import pallas_kernels.dispatch"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0 and repr(value) in proc.stderr.splitlines()[-1]
    with pytest.raises(ValueError, match=value):
        (dispatch.set_kernel_mode if var == "DDTREE_KERNELS" else dispatch.set_mla_backend)(value)


def test_per_op_override_applies_to_that_op_only_and_is_restored():
    with dispatch.use_kernels("interpret", op="build_tree"):
        assert dispatch._choose("build_tree", True) == "interpret"
        assert dispatch._choose("moe_swiglu", True) == "reference"  # auto on a CPU
    assert dispatch._choose("build_tree", True) == "reference"
    with pytest.raises(ValueError, match="build_tre"):
        with dispatch.use_kernels("pallas", op="build_tre"):
            pass
    with pytest.raises(RuntimeError, match="not available"):
        with dispatch.use_kernels("interpret", op="moe_swiglu"):
            dispatch._choose("moe_swiglu", False)
