"""The Pallas-Triton kernels lower to Triton IR for an H200 without one: an abstract GPU device (jax.sharding's
AbstractDevice) stands in for the GPU, so a construct the Triton lowering does not support fails here, on the CPU,
before any device run. (Numerics: the interpret-mode tests of each kernel.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from pallas_kernels.mla_attention import mla_attention_pallas
from pallas_kernels.tree_build import build_tree_pallas

H200 = AbstractMesh(
    (1,),
    ("x",),
    axis_types=(AxisType.Auto,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)


def lower_for_h200(fn, *shapes: jax.ShapeDtypeStruct) -> str:
    with use_abstract_mesh(H200):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(("batch", "depth", "budget"), [(1, 7, 8), (4, 7, 16), (2, 15, 32), (1, 7, 64)])
def test_tree_kernel_lowers(batch, depth, budget):
    text = lower_for_h200(
        lambda lp, ids, root: build_tree_pallas(lp, ids, root, budget),
        spec((batch, depth, budget)),
        spec((batch, depth, budget), jnp.int32),
        spec((batch,), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in text and "ddtree_build" in text


@pytest.mark.parametrize("nodes", [1, 17])
def test_mla_kernel_lowers(nodes):
    text = lower_for_h200(
        lambda q, cache, prefix, mask: mla_attention_pallas(q, cache, prefix, mask, 0.1, 512),
        spec((2, nodes, 16, 576), jnp.bfloat16),
        spec((2, 1024, 576), jnp.bfloat16),
        spec((2,), jnp.int32),
        spec((2, nodes, nodes), jnp.bool_),
    )
    assert "__gpu$xla.gpu.triton" in text and "mla_attention" in text
