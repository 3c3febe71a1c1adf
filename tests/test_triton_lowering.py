"""The Pallas-Triton kernels lower to Triton IR for an H200 without one: an abstract GPU device (jax.sharding's
AbstractDevice) stands in for the GPU, so a construct the Triton lowering does not support fails here, on the CPU,
before any device run. (Numerics: the interpret-mode tests of each kernel.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from experiments.mla_common import abstract_inputs, lower_for_h200
from pallas_kernels import mla_exact
from pallas_kernels.drafter_attention import drafter_attention_pallas
from pallas_kernels.drafter_swiglu import drafter_swiglu_pallas
from pallas_kernels.exact_matmul import head_matmul_pallas, matmul_pallas
from pallas_kernels.exact_norm import rms_norm_pallas
from pallas_kernels.mla_attention import mla_attention_pallas
from pallas_kernels.mla_exact import mla_output_exact
from pallas_kernels.reference import DrafterAttentionWeights, DrafterSwigluWeights
from pallas_kernels.tree_build import build_tree_pallas


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


def mla(q, cache, prefix, mask):
    return mla_attention_pallas(q, cache, prefix, mask, 0.1, 512)


@pytest.mark.parametrize(("nodes", "dtype"), [(1, jnp.bfloat16), (17, jnp.bfloat16), (17, jnp.float32)])
def test_mla_kernel_lowers(nodes, dtype):
    text = lower_for_h200(mla, *abstract_inputs(2, nodes, 16, 1024, dtype))
    assert "__gpu$xla.gpu.triton" in text and "mla_attention" in text


@pytest.mark.parametrize("heads", [64, 8, 4])
@pytest.mark.parametrize(("nodes", "length", "causal"), [(1, 192, False), (17, 1088, False), (40, 1088, True)])
def test_exact_mla_kernels_lower(nodes, length, causal, heads):
    """The exact attention and its W_UV product at K2.6 widths (576-channel latents, w_uv `[heads, 128, 512]`; 64
    heads; 8, one rank's of eight, two nodes to a program over 5 segments; 4, four): the segment kernel, then the
    merge inside the W_UV product, for a one-segment cache and a 5-segment one (the last partial), a tree block and a
    causal one, at 8 rows."""
    packs = mla_exact.nodes_per_program(heads, nodes, 8, length) > 1
    assert packs == (heads < 64 and length > mla_exact.SEGMENT)
    fn = lambda q, cache, prefix, mask, w: mla_output_exact(q, cache, prefix, mask, w, 0.1, 512, causal=causal)
    text = lower_for_h200(fn, *abstract_inputs(8, nodes, heads, length), spec((heads, 128, 512), jnp.bfloat16))
    assert re.findall(r'name = "(mla_\w*)"', text) == ["mla_attention_exact", "mla_exact_merged_w_uv"]


def dot_precisions(jaxpr) -> list:
    """The `precision` of every dot_general in `jaxpr` and the jaxprs nested in its equations (a kernel body)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(inner := getattr(sub, "jaxpr", sub), "eqns"):
                    found += dot_precisions(inner)
    return found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_kernel_multiplies_float32_in_float32(dtype):
    """Triton runs a DEFAULT-precision f32 dot in TF32 (10-bit mantissa), which made float32 GPU runs differ from AR;
    the kernel asks for HIGHEST (IEEE) on f32 operands and leaves bf16 ones at the default (the suite sets
    "highest" globally, so the test resets it)."""
    with jax.default_matmul_precision("default"):
        found = dot_precisions(jax.make_jaxpr(mla)(*abstract_inputs(2, 3, 16, 1024, dtype)).jaxpr)
    highest = [p == (jax.lax.Precision.HIGHEST,) * 2 for p in found]
    assert found and (all(highest) if dtype == jnp.float32 else not any(highest))


def drafter_inputs(batch: int, length: int, dtype, k26: bool = True) -> tuple:
    """Shapes of one drafter attention block (block 8, 6 layers): K2.6's drafter (hidden 7168, 64 query / 8 KV heads
    of 128: the projections before the kernel) or the mini drafter (hidden 256, 8 / 2 heads of 64: in it)."""
    hidden, nh, kvh, hd = (7168, 64, 8, 128) if k26 else (256, 8, 2, 64)
    sizes = [(hidden,), (hidden, nh * hd), (hd,), (hd,), (6, 2, hidden, kvh * hd)]
    return (
        spec((batch, 8, hidden), dtype),
        DrafterAttentionWeights(*(spec(size, dtype) for size in sizes)),
        *[spec((6, batch, length, kvh, hd), dtype)] * 2,
        spec((batch,), jnp.int32),
        *[spec((batch, 8, hd // 2))] * 2,
    )


def drafter(x, weights, ctx_k, ctx_v, ctx_len, cos, sin):
    return drafter_attention_pallas(x, weights, ctx_k, ctx_v, ctx_len, cos, sin, 2, 1e-6, 128**-0.5)


@pytest.mark.parametrize(
    ("batch", "dtype", "k26"),
    [(1, jnp.bfloat16, True), (32, jnp.bfloat16, True), (32, jnp.bfloat16, False), (4, jnp.float32, False)],
)
def test_drafter_attention_kernel_lowers(batch, dtype, k26):
    text = lower_for_h200(drafter, *drafter_inputs(batch, 2048, dtype, k26))
    assert "__gpu$xla.gpu.triton" in text and "drafter_attention" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_drafter_attention_kernel_multiplies_float32_in_float32(dtype):
    """As the MLA kernel: HIGHEST on f32 operands, the default on bf16 ones (projection, scores and P V)."""
    with jax.default_matmul_precision("default"):
        found = dot_precisions(jax.make_jaxpr(drafter)(*drafter_inputs(2, 256, dtype, k26=False)).jaxpr)
    highest = [p == (jax.lax.Precision.HIGHEST,) * 2 for p in found]
    assert found and (all(highest) if dtype == jnp.float32 else not any(highest))


@pytest.mark.parametrize(
    ("rows", "hidden", "inner", "dtype"), [(256, 256, 1536, jnp.bfloat16), (8, 128, 96, jnp.float32)]
)
def test_drafter_swiglu_kernel_lowers(rows, hidden, inner, dtype):
    """The mini drafter's FFN at 32 rows of 8, and the largest hidden size the kernel takes, in f32."""
    weights = DrafterSwigluWeights(spec((hidden,), dtype), spec((hidden, inner), dtype), spec((hidden, inner), dtype))
    text = lower_for_h200(lambda x, w: drafter_swiglu_pallas(x, w, 1e-6), spec((rows, hidden), dtype), weights)
    assert "__gpu$xla.gpu.triton" in text and "drafter_swiglu" in text


# K2.6's dense products: q_a_proj, kv_a_proj (576 columns), the f32 router (384 experts), lm_head.
MATMULS = [
    ((7168, 1536), jnp.bfloat16),
    ((7168, 576), jnp.bfloat16),
    ((7168, 384), jnp.float32),
    ((7168, 163840), jnp.bfloat16),
]


@pytest.mark.parametrize("rows", [1, 68])
@pytest.mark.parametrize(("weight", "dtype"), MATMULS)
def test_exact_matmul_lowers(rows, weight, dtype):
    text = lower_for_h200(
        lambda x, w: matmul_pallas(x, w, jnp.float32), spec((rows, weight[0]), dtype), spec(weight, dtype)
    )
    assert "__gpu$xla.gpu.triton" in text and "exact_matmul" in text


# K2.6's products with the norm prologue: q_a and kv_a (the input norm), q_b (q_a's norm), lm_head (the final norm).
NORMED_MATMULS = [(7168, 1536), (7168, 576), (1536, 12288), (7168, 163840)]


@pytest.mark.parametrize("weight", NORMED_MATMULS)
def test_exact_normed_matmul_lowers(weight):
    fn = lambda x, g, w: matmul_pallas(x, w, jnp.float32, norm=(g, 1e-6))
    bf16 = jnp.bfloat16
    text = lower_for_h200(fn, spec((3, weight[0]), bf16), spec((weight[0],), bf16), spec(weight, bf16))
    assert "__gpu$xla.gpu.triton" in text and "exact_normed_matmul" in text


@pytest.mark.parametrize(
    ("rows", "weight"),
    [(17, (8192, 7168)), (256, (512, 256)), (256, (1536, 256))],
)
def test_exact_residual_matmul_lowers(rows, weight):
    """K2.6's o_proj `[8192, 7168]` with the residual stream added in its epilogue, 17 rows; the shipped drafter's
    o_proj and down (`dispatch.drafter_residual`) at 32 rows of 8."""
    bf16 = jnp.bfloat16
    fn = lambda r, x, w: matmul_pallas(x, w, bf16, residual=r)
    text = lower_for_h200(fn, spec((rows, weight[1]), bf16), spec((rows, weight[0]), bf16), spec(weight, bf16))
    assert "__gpu$xla.gpu.triton" in text and "exact_matmul" in text


@pytest.mark.parametrize("transposed", [False, True])
def test_exact_head_matmul_lowers(transposed):
    """K2.6's absorbed MLA products: w_uk `[64, 128, 512]` on q's first 128 of 192 columns (q_nope, read in place),
    w_uv `[64, 128, 512]` (transposed) on the attention output, for a 17-node verify of 4 rows."""
    k = 512 if transposed else 192
    x = spec((4, 17, 64, k), jnp.bfloat16)
    fn = lambda x, w: head_matmul_pallas(x, w, jnp.float32, transposed=transposed)
    text = lower_for_h200(fn, x, spec((64, 128, 512), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in text and "exact_matmul" in text


def test_exact_norm_of_a_column_prefix_lowers():
    """K2.6's latent norm: the first 512 of kv_a's 576 columns (c_kv), read in place."""
    fn = lambda x, g: rms_norm_pallas(x, g, 1e-6)
    text = lower_for_h200(fn, spec((4, 17, 576), jnp.bfloat16), spec((512,), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in text and "exact_rms_norm" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exact_matmul_multiplies_float32_in_float32(dtype):
    """As the MLA kernel: HIGHEST on f32 operands (the router's product), the default on bf16 ones."""
    product = jax.make_jaxpr(lambda x, w: matmul_pallas(x, w, jnp.float32))
    with jax.default_matmul_precision("default"):
        found = dot_precisions(product(spec((3, 200), dtype), spec((200, 97), dtype)).jaxpr)
    highest = [p == (jax.lax.Precision.HIGHEST,) * 2 for p in found]
    assert found and (all(highest) if dtype == jnp.float32 else not any(highest))
