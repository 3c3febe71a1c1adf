"""The kernel dispatch point: which implementation runs for which mode, backend and shape."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from pallas_kernels import dispatch, mla_mosaic
from pallas_kernels.dispatch import Kernels
from pallas_kernels.mla_attention import mla_attention_pallas
from pallas_kernels.mla_mosaic import MosaicMLAConfig, mla_attention_mosaic

AUTO, TRITON, MOSAIC = Kernels(), Kernels(mla_kernel="triton"), Kernels(mla_kernel="mosaic")


def shapes(dk: int, dtype=jnp.bfloat16, nodes: int = 3, heads: int = 8):
    return jnp.zeros((2, nodes, heads, dk), dtype), jnp.zeros((2, 64, dk), dtype)


def test_auto_backend_takes_mosaic_from_64_rows_on_hopper_only(monkeypatch):
    """auto: Mosaic for nodes x heads >= 64 on a Hopper GPU (bench_mla_carry), Triton below it or elsewhere."""
    many = [shapes(576, nodes=n, heads=h) for n, h in ((17, 64), (1, 64), (17, 4))]  # verify, decode, shipped pair
    few = [shapes(576, nodes=n, heads=h) for n, h in ((1, 8), (9, 7))]  # 8-head decode, 63 rows
    for hopper, want_many in ((True, mla_attention_mosaic), (False, mla_attention_pallas)):
        monkeypatch.setattr(dispatch, "_is_hopper", lambda h=hopper: h)
        assert all(dispatch.mla_kernel_for(AUTO, *qc, 512) is want_many for qc in many)
        assert all(dispatch.mla_kernel_for(AUTO, *qc, 512) is mla_attention_pallas for qc in few)
        assert dispatch.mla_kernel_for(AUTO, *shapes(576, jnp.float32, 17, 64), 512) is mla_attention_pallas
    assert not dispatch._is_hopper()  # this CPU


def test_mla_backend_selects_the_kernel_the_shapes_allow():
    q, cache = shapes(576)
    assert dispatch.mla_kernel_for(TRITON, q, cache, 512) is mla_attention_pallas
    assert dispatch.mla_kernel_for(MOSAIC, q, cache, 512) is mla_attention_mosaic
    assert dispatch.mla_kernel_for(MOSAIC, *shapes(160), 128) is mla_attention_pallas  # 64 does not divide Dk
    assert dispatch.mla_kernel_for(MOSAIC, q, cache, 448) is mla_attention_pallas  # 128 does not divide value_dim
    assert dispatch.mla_kernel_for(MOSAIC, *shapes(576, jnp.float32), 512) is mla_attention_pallas


def test_mla_tiling_reaches_the_mosaic_kernel(monkeypatch):
    """Kernels.mla_tiling: the Mosaic kernel runs with that tiling (its split count still chosen per call); the
    default tiling is the default kernel entry point itself."""
    q, cache = shapes(576)
    tiled = Kernels(mla_kernel="mosaic", mla_tiling=dispatch.tiling_from_text("num_stages=1,compute_registers=232"))
    kernel = dispatch.mla_kernel_for(tiled, q, cache, 512)
    assert kernel.func is mla_attention_mosaic
    assert kernel.keywords["tiling"] == MosaicMLAConfig(num_stages=1, compute_registers=232)
    seen = []
    monkeypatch.setattr(mla_mosaic, "mla_attention_mosaic_split", lambda *a, config, **k: seen.append(config))
    kernel(q, cache, jnp.zeros((2,), jnp.int32), jnp.ones((2, 3, 3), bool), 0.1)
    assert seen[0].num_stages == 1 and seen[0].compute_registers == 232 and seen[0].num_splits >= 1
    assert Kernels(mla_kernel="mosaic", mla_tiling=MosaicMLAConfig()) == MOSAIC  # one value for the default
    assert dispatch.mla_kernel_for(MOSAIC, q, cache, 512) is mla_attention_mosaic


def test_reference_mode_never_calls_a_kernel(monkeypatch):
    monkeypatch.setattr(dispatch, "mla_kernel_for", lambda *a: pytest.fail("kernel chosen in reference mode"))
    q, cache = shapes(576)
    reference = Kernels().with_mode("reference")
    out = dispatch.mla_attention(reference, q, cache, jnp.zeros((2,), jnp.int32), jnp.ones((2, 3, 3), bool), 0.1)
    assert out.shape == (2, 3, 8, 512)


@pytest.mark.parametrize(
    "var,value",
    [
        ("DDTREE_KERNELS", "fast"),
        ("DDTREE_KERNELS", "auto,drafter_attention=fast"),
        ("DDTREE_KERNELS", "auto,drafter=reference"),
        ("DDTREE_MLA_KERNEL", "cutlass"),
        ("DDTREE_MLA_TILING", "schedule=waves"),
        ("DDTREE_TOPK_CHUNK", "-1"),
    ],
)
def test_unknown_environment_values_fail_naming_them(var, value):
    with pytest.raises(ValueError, match=value.split(",")[-1].split("=")[-1]):
        Kernels.from_env({var: value})


def test_environment_chooses_the_default_selection():
    env = {"DDTREE_KERNELS": "reference", "DDTREE_MLA_KERNEL": "triton", "DDTREE_TOPK_CHUNK": "0"}
    assert Kernels.from_env(env) == Kernels(
        **dict.fromkeys(dispatch.OPS, "reference"), mla_kernel="triton", topk_chunk=0
    )
    settings = {"mla_kernel", "mla_tiling", "topk_chunk", "exact"}  # the fields that are not an op's mode
    assert set(dispatch.OPS) == {f.name for f in dataclasses.fields(Kernels)} - settings
    assert Kernels.from_env({}) == Kernels() and hash(Kernels.from_env({})) == hash(Kernels())


def test_environment_names_modes_per_op():
    env = {"DDTREE_KERNELS": "pallas,drafter_attention=reference"}
    assert Kernels.from_env(env) == Kernels().with_mode("pallas").with_mode("reference", op="drafter_attention")
    env = {"DDTREE_KERNELS": "build_tree=interpret"}
    assert Kernels.from_env(env) == Kernels(build_tree="interpret")


def test_per_op_mode_applies_to_that_op_only():
    kernels = Kernels().with_mode("interpret", op="build_tree")
    assert dispatch._choose("build_tree", kernels.build_tree, True) == "interpret"
    assert dispatch._choose("moe_swiglu", kernels.moe_swiglu, True) == "reference"  # auto on a CPU
    with pytest.raises(ValueError, match="build_tre"):
        Kernels().with_mode("pallas", op="build_tre")
    with pytest.raises(ValueError, match="fast"):
        Kernels().with_mode("fast")
    with pytest.raises(RuntimeError, match="not available"):
        dispatch._choose("moe_swiglu", "interpret", False)


@pytest.mark.parametrize("dtype,kernel_runs", [(jnp.bfloat16, True), (jnp.float32, False)])
def test_gpu_auto_runs_the_moe_kernel_only_on_bf16_and_logs_the_slow_path(monkeypatch, dtype, kernel_runs):
    """On a GPU in auto mode the Mosaic MoE kernel (bf16 only) takes bf16 activations; float32 (a float32 model,
    e.g. an exactness run) goes to the reference, logged, instead of failing inside the kernel."""
    calls = []
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_moe_kernel", lambda: lambda *a, **k: calls.append(a[0].dtype) or "kernel")
    monkeypatch.setattr(dispatch, "_logged", set())
    logged = []
    monkeypatch.setattr(dispatch.logging, "info", lambda msg, *a: logged.append(msg % a))
    x = jnp.ones((3, 64), dtype)
    ids, w = jnp.zeros((3, 2), jnp.int32), jnp.full((3, 2), 0.5, jnp.float32)
    # E=2 experts, H=64, I=32, group 32: gate_up [E, 2I, H] / [E, H/G, 2I], down [E, H, I] / [E, I/G, H]
    gu_q, gu_s = jnp.ones((2, 64, 64), jnp.int4), jnp.full((2, 2, 64), 0.01, jnp.bfloat16)
    d_q, d_s = jnp.ones((2, 64, 32), jnp.int4), jnp.full((2, 1, 64), 0.01, jnp.bfloat16)
    out = dispatch.moe_swiglu(Kernels(), x, ids, w, gu_q, gu_s, d_q, d_s)
    assert (calls == [dtype]) == kernel_runs
    if not kernel_runs:
        assert out.shape == (3, 64) and any("SLOW PATH" in m and "float32" in m for m in logged)


def test_interpret_mode_reaches_the_mosaic_kernel(monkeypatch):
    """Interpret mode with the Mosaic backend asks that kernel for interpret mode: the product refuses it (jax's
    own interpreter cannot run the kernel); with the test harness's interpreter in its place (substituted here) the
    result matches the reference on a random tree."""
    import numpy as np

    from pallas_kernels import mla_mosaic
    from tests import mosaic_interpret
    from tests.test_mla_attention import DV, SCALE, inputs, random_parent_mask, reference, rel_err

    calls = []
    kernel = mla_mosaic.mla_attention_mosaic

    def harness(*args, interpret, **kwargs):
        calls.append({"interpret": interpret})
        return kernel(*args, interpret=mosaic_interpret.params() if interpret is True else interpret, **kwargs)

    monkeypatch.setattr(mla_mosaic, "mla_attention_mosaic", harness)

    rng = np.random.default_rng(1)
    q, cache, prefix = inputs(rng, 2, 5, 4, 96, [0, int(rng.integers(1, 91))])
    mask = jnp.asarray(random_parent_mask(rng, 2, 5))
    kernels = MOSAIC.with_mode("interpret", op="mla_attention")
    out = dispatch.mla_attention(kernels, q, cache, prefix, mask, SCALE, DV)
    assert calls == [{"interpret": True}]
    assert rel_err(out, reference(q, cache, prefix, mask)) < 1e-2


@pytest.mark.parametrize(
    "kernels,backend,want",
    [
        (Kernels(), "gpu", None),  # exact off: the plain jnp.dot whatever the mode and backend
        (Kernels(matmul="pallas"), "gpu", None),
        (Kernels(exact=True), "gpu", {"interpret": False}),
        (Kernels(exact=True), "cpu", None),  # auto off a GPU: the reference, jnp.dot
        (Kernels(exact=True, matmul="interpret"), "cpu", {"interpret": True}),
        (Kernels(exact=True, matmul="reference"), "gpu", None),
    ],
)
def test_exact_products_run_the_kernel_the_matmul_mode_selects(monkeypatch, kernels, backend, want):
    from pallas_kernels import exact_matmul

    calls = []
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
    for name in ("matmul_pallas", "head_matmul_pallas"):
        monkeypatch.setattr(exact_matmul, name, lambda *a, interpret, calls=calls, **k: calls.append(interpret))
    x, w, hw = jnp.ones((3, 32)), jnp.ones((32, 16)), jnp.ones((2, 16, 16))
    out = dispatch.matmul(kernels, x, w)
    out_h = dispatch.head_matmul(kernels, x.reshape(3, 2, 16), hw, transposed=True)
    if want is None:
        assert calls == [] and out.shape == (3, 16) and out_h.shape == (3, 2, 16)
    else:
        assert calls == [want["interpret"]] * 2


@pytest.mark.parametrize(
    "kernels,backend,want",
    [
        (Kernels(exact=True), "gpu", "pallas"),
        (Kernels(exact=True, mla_attention="interpret"), "cpu", "interpret"),
        (Kernels(exact=True), "cpu", "reference"),  # auto off a GPU: the reference attention, then head_matmul
        (Kernels(exact=True, mla_attention="reference"), "gpu", "reference"),
    ],
)
def test_exact_mla_output_runs_the_fused_kernel_the_mla_mode_selects(monkeypatch, kernels, backend, want):
    """Under exact, the attention and its W_UV product are one call of `mla_output_exact` (interpret as the mode
    says); with the mode at reference, the reference attention and `head_matmul` (its products' kernel as the
    `matmul` mode selects). The exact attention alone is refused, not replaced."""
    from pallas_kernels import exact_matmul, mla_exact

    fused, products = [], []
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
    monkeypatch.setattr(mla_exact, "mla_output_exact", lambda *a, interpret, **k: fused.append(interpret))
    record_product = lambda *a, interpret, **k: products.append(interpret) or jnp.zeros(())  # noqa: E731
    monkeypatch.setattr(exact_matmul, "head_matmul_pallas", record_product)
    q, cache = shapes(160, jnp.float32)
    prefix, mask, w = jnp.zeros((2,), jnp.int32), jnp.ones((2, 3, 3), bool), jnp.ones((8, 16, 128))
    dispatch.mla_output(kernels, q, cache, prefix, mask, w, 0.1, 128)
    if want == "reference":
        assert fused == [] and products == ([False] if backend == "gpu" else [])
    else:
        assert fused == [want == "interpret"] and products == []
        with pytest.raises(ValueError, match="mla_output"):
            dispatch.mla_attention(kernels, q, cache, prefix, mask, 0.1, 128)


def test_mla_output_is_the_attention_then_the_w_uv_einsum():
    """Without exact: `mla_attention`, then the per-head einsum with W_UV in f32."""
    import numpy as np

    from pallas_kernels.reference import mla_attention_reference

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 3, 8, 160)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, 64, 160)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 16, 128)), jnp.float32)
    prefix, mask = jnp.asarray([5, 40], jnp.int32), jnp.tril(jnp.ones((2, 3, 3), bool))
    out = dispatch.mla_output(Kernels().with_mode("reference"), q, cache, prefix, mask, w, 0.1, 128)
    o_lat = mla_attention_reference(q, cache, prefix, mask, 0.1, 128)
    want = jnp.einsum("bnhc,hvc->bnhv", o_lat, w, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32 and np.array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("exact", [False, True])
def test_moe_passes_exact_to_the_kernel_and_the_reference(monkeypatch, exact):
    from pallas_kernels import reference

    seen = []
    monkeypatch.setattr(dispatch, "_moe_kernel", lambda: lambda *a, interpret, exact: seen.append(("kernel", exact)))
    monkeypatch.setattr(reference, "moe_swiglu_reference", lambda *a, exact: seen.append(("reference", exact)))
    args = [jnp.ones((1, 64), jnp.bfloat16)] + [None] * 6
    dispatch.moe_swiglu(Kernels(exact=exact, moe_swiglu="interpret"), *args)
    dispatch.moe_swiglu(Kernels(exact=exact, moe_swiglu="reference"), *args)
    assert seen == [("kernel", exact), ("reference", exact)]
