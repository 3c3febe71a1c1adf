"""HF checkpoint loading: synthetic checkpoints in both layouts, bad checkpoints, orbax round trip."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import tiny_kimi_config
from flax import nnx
from safetensors.numpy import save_file

from ddtree_jax import checkpoint
from ddtree_jax.checkpoint import CheckpointError
from ddtree_jax.config import ConfigError, to_hf_dict
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.training import synthetic

REPO = Path(__file__).resolve().parents[1]


def _unpack(packed: np.ndarray) -> np.ndarray:
    """INT4 reference: element j = ((word[j // 8] >> 4 (j % 8)) & 0xF) - 8."""
    w = packed.astype(np.int64) & 0xFFFFFFFF
    return (((w[..., :, None] >> (4 * np.arange(8))) & 0xF) - 8).reshape(*packed.shape[:-1], -1)


def _experts_by_hand(t: dict[str, np.ndarray], n: str, cfg, quantized: bool) -> dict[str, np.ndarray]:
    """One MoE layer's routed experts (HF names under prefix `n`) stacked in the model's layout."""
    q, s = {}, {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        bases = [f"{n}mlp.experts.{e}.{proj}." for e in range(cfg.n_routed_experts)]
        q[proj] = np.stack([_unpack(t[b + "weight_packed"]) for b in bases])
        s[proj] = np.stack([t[b + "weight_scale"].astype(np.float32) for b in bases])
        for b in bases:
            assert list(t[b + "weight_shape"]) == [q[proj].shape[1], q[proj].shape[2]]
    if quantized:
        return {
            "gate_up_q": np.concatenate([q["gate_proj"], q["up_proj"]], axis=1),
            "gate_up_s": np.concatenate([s["gate_proj"], s["up_proj"]], axis=1).transpose(0, 2, 1),
            "down_q": q["down_proj"],
            "down_s": s["down_proj"].transpose(0, 2, 1),
        }
    w = {k: q[k] * np.repeat(s[k], 32, axis=-1) for k in q}
    return {
        "gate_up": np.concatenate([w["gate_proj"], w["up_proj"]], axis=1).transpose(0, 2, 1),
        "down": w["down_proj"].transpose(0, 2, 1),
    }


def expected_params(t: dict[str, np.ndarray], cfg, quantized: bool) -> dict[tuple, np.ndarray]:
    """The model's param tree, built from HF tensors by hand (f32 / int values)."""
    nested = cfg.layout == "nested"
    pre = "language_model.model." if nested else "model."
    head = "language_model.lm_head.weight" if nested else "lm_head.weight"

    def f(name: str) -> np.ndarray:
        return t[name].astype(np.float32)

    out = {
        ("embed_tokens",): f(pre + "embed_tokens.weight"),
        ("norm",): f(pre + "norm.weight"),
        ("lm_head",): f(head).T,
    }
    nope, v, heads, kv = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_attention_heads, cfg.kv_lora_rank
    for i in range(cfg.num_hidden_layers):
        n, p = f"{pre}layers.{i}.", ("layers", i)
        out[(*p, "input_layernorm")] = f(n + "input_layernorm.weight")
        out[(*p, "post_attention_layernorm")] = f(n + "post_attention_layernorm.weight")
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            out[(*p, "self_attn", name)] = f(f"{n}self_attn.{name}.weight").T
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            out[(*p, "self_attn", name)] = f(f"{n}self_attn.{name}.weight")
        kv_b = f(n + "self_attn.kv_b_proj.weight")  # row h*(nope+v) + j
        w_uk, w_uv = np.zeros((heads, nope, kv)), np.zeros((heads, v, kv))
        for h in range(heads):
            w_uk[h] = kv_b[h * (nope + v) : h * (nope + v) + nope]
            w_uv[h] = kv_b[h * (nope + v) + nope : (h + 1) * (nope + v)]
        out[(*p, "self_attn", "w_uk")], out[(*p, "self_attn", "w_uv")] = w_uk, w_uv
        if i < cfg.first_k_dense_replace:
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[(*p, "mlp", name)] = f(f"{n}mlp.{name}.weight").T
            continue
        out[(*p, "mlp", "gate")] = f(n + "mlp.gate.weight").T
        out[(*p, "mlp", "e_score_correction_bias")] = t[n + "mlp.gate.e_score_correction_bias"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[(*p, "mlp", "shared_experts", name)] = f(f"{n}mlp.shared_experts.{name}.weight").T
        for name, x in _experts_by_hand(t, n, cfg, quantized).items():
            out[(*p, "mlp", "experts", name)] = x
    return out


def _leaves(model) -> dict[tuple, jax.Array]:
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module", params=["flat", "nested"])
def synthetic_ckpt(request, tmp_path_factory):
    cfg = tiny_kimi_config(request.param)
    tensors = synthetic.random_hf_tensors(cfg, seed={"flat": 0, "nested": 1}[request.param])
    path = synthetic.write_hf_checkpoint(tmp_path_factory.mktemp(request.param), cfg, tensors)
    return cfg, tensors, path


def test_writer_produces_hf_layout(synthetic_ckpt):
    cfg, tensors, path = synthetic_ckpt
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    config = json.loads((path / "config.json").read_text())
    assert sorted(set(index.values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    prefix = "language_model.model." if cfg.layout == "nested" else "model."
    assert f"{prefix}layers.1.mlp.experts.0.up_proj.weight_packed" in index
    assert not any(k.endswith("experts.0.up_proj.weight") for k in index)
    assert tensors[f"{prefix}layers.1.mlp.experts.0.up_proj.weight_packed"].dtype == np.int32
    assert tensors[f"{prefix}layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    if cfg.layout == "nested":
        assert config["model_type"] == "kimi_k25" and "text_config" in config
        assert any(k.startswith("vision_tower.") for k in index) and any(k.startswith("mm_projector.") for k in index)
    else:
        assert config["model_type"] == "kimi_k2"


@pytest.mark.parametrize("quantized", [True, False])
def test_load_matches_source_tensors(synthetic_ckpt, quantized):
    cfg, tensors, path = synthetic_ckpt
    model = checkpoint.load_target(path, quantized=quantized)
    got, want = _leaves(model), expected_params(tensors, cfg, quantized)
    assert got.keys() == want.keys()
    for p, w in want.items():
        g = got[p]
        if p[-1].endswith("_q"):
            assert g.dtype == jnp.int4
        elif p[-1] == "e_score_correction_bias":
            assert g.dtype == jnp.float32
        else:
            assert g.dtype == jnp.bfloat16, p
        g32 = np.asarray(g.astype(jnp.float32))
        if p[-1] in ("gate_up", "down"):  # dequantized to bf16: q * scale rounded once
            np.testing.assert_allclose(g32, w, rtol=2**-8, err_msg=str(p))
        else:
            np.testing.assert_array_equal(g32, w, err_msg=str(p))


def test_export_round_trip(synthetic_ckpt):
    cfg, tensors, path = synthetic_ckpt
    back = synthetic.hf_tensors_from_model(checkpoint.load_target(path))
    assert back.keys() == tensors.keys()
    for k, x in tensors.items():
        assert back[k].dtype == x.dtype and np.array_equal(back[k], x), k


def test_logits_match_model_built_from_same_weights(synthetic_ckpt):
    cfg, tensors, path = synthetic_ckpt
    loaded = checkpoint.load_target(path, dtype=jnp.float32)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: KimiForCausalLM(cfg, rngs=nnx.Rngs(7), dtype=jnp.float32)))
    want = expected_params(tensors, cfg, quantized=True)
    for p, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(want[p], var.get_value().dtype))
    direct = nnx.merge(graphdef, state)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))

    @nnx.jit
    def logits(m):
        out = m(tokens, positions, m.init_cache(2, 8), jnp.zeros(2, jnp.int32))
        return m.logits(out.hidden)

    a, b = np.asarray(logits(loaded)), np.asarray(logits(direct))
    assert np.isfinite(a).all() and a.std() > 1e-3
    np.testing.assert_array_equal(a, b)


def test_single_file_checkpoint_and_sharding_fn(tmp_path):
    cfg = tiny_kimi_config("flat")
    tensors = synthetic.random_hf_tensors(cfg, seed=11)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    calls = {}
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    model = checkpoint.load_target(tmp_path, sharding_fn=lambda p, spec: calls.setdefault(p, spec.shape) and dev)
    leaves = _leaves(model)
    assert calls == {p: x.shape for p, x in leaves.items()}
    np.testing.assert_array_equal(
        np.asarray(leaves[("lm_head",)].astype(jnp.float32)), tensors["lm_head.weight"].astype(np.float32).T
    )


def test_orbax_round_trip(synthetic_ckpt, tmp_path):
    cfg, _, path = synthetic_ckpt
    model = checkpoint.load_target(path)
    checkpoint.save_converted(model, tmp_path / "orbax")
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    calls = []
    restored = checkpoint.restore_converted(tmp_path / "orbax", cfg, sharding_fn=lambda p, spec: calls.append(p) or dev)
    a, b = _leaves(model), _leaves(restored)
    assert a.keys() == b.keys() == set(calls)
    for p in a:
        assert a[p].dtype == b[p].dtype and a[p].shape == b[p].shape, p
        assert b[p].sharding == dev
        np.testing.assert_array_equal(np.asarray(a[p].astype(jnp.float32)), np.asarray(b[p].astype(jnp.float32)))


# ---- bad checkpoints -----------------------------------------------------------------------------

_EXPERT = "model.layers.2.mlp.experts.5.up_proj"


def _write(tmp_path: Path, edit=None, layout: str = "flat") -> Path:
    cfg = tiny_kimi_config(layout)
    tensors = synthetic.random_hf_tensors(cfg, seed=3)
    if edit is not None:
        edit(tensors)
    return synthetic.write_hf_checkpoint(tmp_path, cfg, tensors)


def _raises(path: Path, error: type, *fragments: str) -> None:
    with pytest.raises(error) as info:
        checkpoint.load_target(path)
    msg = str(info.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg


def test_missing_config(tmp_path):
    path = _write(tmp_path)
    (path / "config.json").unlink()
    _raises(path, ConfigError, "config.json")


def test_missing_index_and_shard(tmp_path):
    path = _write(tmp_path)
    (path / "model-00002-of-00002.safetensors").unlink()
    _raises(path, CheckpointError, "model-00002-of-00002.safetensors", "missing")
    (path / "model.safetensors.index.json").unlink()
    _raises(path, CheckpointError, "model.safetensors.index.json")


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.self_attn.kv_b_proj.weight", "lm_head.weight", _EXPERT + ".weight_scale"],
)
def test_missing_tensor(tmp_path, name):
    _raises(_write(tmp_path, lambda t: t.pop(name)), CheckpointError, name, "missing")


def test_missing_packed_expert(tmp_path):
    name = _EXPERT + ".weight_packed"
    _raises(_write(tmp_path, lambda t: t.pop(name)), CheckpointError, name)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", _EXPERT + ".weight_packed"])
def test_wrong_shape(tmp_path, name):
    def edit(t):
        t[name] = t[name][:, :-1].copy()

    _raises(_write(tmp_path, edit), CheckpointError, name, "shape")


def test_wrong_weight_shape_value(tmp_path):
    def edit(t):
        t[_EXPERT + ".weight_shape"] = t[_EXPERT + ".weight_shape"][::-1].copy()

    _raises(_write(tmp_path, edit), CheckpointError, _EXPERT + ".weight_shape")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("model.norm.weight", np.float32),
        ("model.layers.1.mlp.gate.e_score_correction_bias", ml_dtypes.bfloat16),
    ],
)
def test_wrong_dtype(tmp_path, name, dtype):
    def edit(t):
        t[name] = t[name].astype(dtype)

    _raises(_write(tmp_path, edit), CheckpointError, name, "dtype")


def test_truncated_file(tmp_path):
    path = _write(tmp_path)
    shard = path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    _raises(path, CheckpointError, "model-00001-of-00002.safetensors", "truncated")


def test_unknown_quant_format(tmp_path):
    path = _write(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["format"] = "marlin-24"
    (path / "config.json").write_text(json.dumps(config))
    _raises(path, ConfigError, "config.json", "marlin-24")


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.experts.8.gate_proj.weight_scale",
        "model.mtp.0.weight",
        "language_model.model.norm.weight",
    ],
)
def test_unexpected_tensor(tmp_path, name):
    def edit(t):
        t[name] = np.zeros((4,), ml_dtypes.bfloat16)

    _raises(_write(tmp_path, edit), CheckpointError, name, "unexpected")


def test_ignored_tensors_are_skipped(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((4,), np.float32)

    path = _write(tmp_path, edit)
    assert re.search(r"rotary_emb\.inv_freq", (path / "model.safetensors.index.json").read_text())
    checkpoint.load_target(path)


def test_float_expert_checkpoint(tmp_path):
    """Unquantized config: experts stored as bf16 `.weight`; loaded as float stacks or quantized at load."""
    cfg = tiny_kimi_config("flat", quantized=False)
    tensors = synthetic.random_hf_tensors(cfg, seed=4)
    path = synthetic.write_hf_checkpoint(tmp_path, cfg, tensors)
    inter = cfg.moe_intermediate_size
    dense, quantized = (
        _leaves(checkpoint.load_target(path)),
        _leaves(checkpoint.load_target(path, quantized=True)),
    )
    for layer in cfg.moe_layers:
        ex = ("layers", layer, "mlp", "experts")
        gate_up, down = (np.asarray(dense[(*ex, k)].astype(jnp.float32)) for k in ("gate_up", "down"))
        q = np.asarray(quantized[(*ex, "gate_up_q")].astype(jnp.int8))
        s = np.asarray(quantized[(*ex, "gate_up_s")].astype(jnp.float32))
        for e in range(cfg.n_routed_experts):
            w = {
                k: tensors[f"model.layers.{layer}.mlp.experts.{e}.{k}.weight"].astype(np.float32)
                for k in ("gate_proj", "up_proj", "down_proj")
            }
            np.testing.assert_array_equal(gate_up[e, :, :inter], w["gate_proj"].T)
            np.testing.assert_array_equal(gate_up[e, :, inter:], w["up_proj"].T)
            np.testing.assert_array_equal(down[e], w["down_proj"].T)
            both = np.concatenate([w["gate_proj"], w["up_proj"]])  # [2I, H]
            s_full = np.repeat(s[e].T, 32, axis=-1)
            assert np.all(np.abs(q[e] * s_full - both) <= 0.5 * s_full * (1 + 2**-6))
            assert np.all(np.abs(q[e]) <= 7) and s[e].max() > 0
    back = synthetic.hf_tensors_from_model(checkpoint.load_target(path))
    assert back.keys() == tensors.keys()
    for k, x in tensors.items():
        assert back[k].dtype == x.dtype and np.array_equal(back[k], x), k


def test_convert_cli(tmp_path):
    cfg = tiny_kimi_config("nested")
    path = synthetic.write_hf_checkpoint(tmp_path / "hf", cfg, seed=9)
    out = tmp_path / "orbax"
    cmd = [sys.executable, "-m", "checkpoints.convert", f"--target={path}", f"--output={out}"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    a, b = _leaves(checkpoint.load_target(path)), _leaves(checkpoint.restore_converted(out, cfg))
    assert a.keys() == b.keys()
    for p in a:
        assert a[p].dtype == b[p].dtype
        np.testing.assert_array_equal(np.asarray(a[p].astype(jnp.float32)), np.asarray(b[p].astype(jnp.float32)))
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
