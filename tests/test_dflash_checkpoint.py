"""z-lab drafter checkpoints: round trip, the real Kimi drafter config, bad checkpoints."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx
from safetensors.numpy import load_file, save_file

from ddtree_jax.checkpoint import CheckpointError
from ddtree_jax.config import load_dflash_config
from ddtree_jax.dflash_checkpoint import load_drafter, save_drafter
from ddtree_jax.models.dflash import DFlashDrafter


def saved_drafter(tmp_path, seed):
    cfg = tiny_dflash_config(tiny_kimi_config())
    model = DFlashDrafter(cfg, rngs=nnx.Rngs(seed))
    return model, save_drafter(model, tmp_path / "drafter")


def test_round_trip_and_names(tmp_path):
    model, path = saved_drafter(tmp_path, np.random.randint(1 << 20))
    tensors = load_file(str(path / "model.safetensors"))
    c = model.config
    # The HF orientation is [out, in]; k_proj comes out of the fused kv_proj[l, 0].
    np.testing.assert_array_equal(
        tensors["layers.1.self_attn.k_proj.weight"].astype(np.float32),
        np.asarray(model.kv_proj[1, 0], np.float32).T,
    )
    assert tensors["fc.weight"].shape == (c.hidden_size, 2 * c.hidden_size)
    loaded = load_drafter(path)
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(
            np.asarray(a.get_value(), np.float32), np.asarray(b.get_value(), np.float32), err_msg=str(p)
        )


def test_model_prefix_accepted(tmp_path):
    model, path = saved_drafter(tmp_path, 1)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({"model." + k: v for k, v in tensors.items()}, str(path / "model.safetensors"))
    loaded = load_drafter(path)
    np.testing.assert_array_equal(np.asarray(loaded.fc[...], np.float32), np.asarray(model.fc[...], np.float32))


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda t: t.pop("layers.0.mlp.up_proj.weight"), "layers.0.mlp.up_proj.weight"),
        (lambda t: t.__setitem__("norm.weight", t["norm.weight"][:-1]), "norm.weight"),
        (lambda t: t.__setitem__("fc.weight", t["fc.weight"].astype(np.float32)), "fc.weight"),
        (lambda t: t.__setitem__("lm_head.weight", t["norm.weight"]), "lm_head.weight"),
    ],
)
def test_bad_checkpoints_name_the_tensor(tmp_path, damage, needle):
    _, path = saved_drafter(tmp_path, 2)
    tensors = load_file(str(path / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        load_drafter(path)


def test_real_kimi_drafter_config_builds(spec_configs):
    """The z-lab Kimi drafter: 6 layers, hidden 7168, 64/8 heads, block 8; 3.479B params besides embed/head."""
    cfg = load_dflash_config(spec_configs / "kimi-k2.5-dflash")
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.num_draft, cfg.mask_token_id) == (6, 8, 7, 163838)
    state = nnx.state(nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0))))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert n == pytest.approx(3.479e9, rel=1e-3)
    assert state["kv_proj"].shape == (6, 2, 7168, 1024)


def test_config_json_round_trip(tmp_path):
    model, path = saved_drafter(tmp_path, 3)
    raw = json.loads((path / "config.json").read_text())
    assert raw["dflash_config"]["target_layer_ids"] == list(model.config.target_layer_ids)
    assert load_dflash_config(path) == model.config
    assert jnp.dtype(load_drafter(path, dtype=jnp.float32).dtype) == jnp.float32
