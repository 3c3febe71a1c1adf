"""z-lab DFlash drafter checkpoints (`config.json` + safetensors) <-> `DFlashDrafter`.

Tensor names and shapes come from the drafter's weight declarations (`tensor_table`; HF `[out, in]`, e.g.
`layers.{l}.self_attn.q_proj.weight`). A leading `model.` is accepted. k_proj/v_proj of every layer are stacked
into the drafter's fused `kv_proj [layers, 2, H, kvh*hd]`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from ddtree_jax.checkpoint import BF16, CheckpointError, Reader, hf_name
from ddtree_jax.config import DFlashConfig, load_dflash_config
from ddtree_jax.models.dflash import DFlashDrafter, weight_table
from ddtree_jax.models.params import TRANSPOSE

ParamRef = tuple[tuple[str | int, ...], tuple[int, ...]]  # (param path, index inside that param)


def tensor_table(c: DFlashConfig) -> list[tuple[str, tuple[int, ...], ParamRef]]:
    """(HF name, HF shape, (param path, index)) for every drafter tensor, from the drafter's weight declarations;
    2-D tensors are transposed. The fused kv_proj `[layers, 2, H, kvh*hd]` is one k_proj / v_proj per layer."""
    specs = weight_table(c)
    rows = []
    for path, spec in specs.items():
        if spec.hf_name is not None:
            shape = spec.shape[::-1] if spec.hf_layout == TRANSPOSE else spec.shape
            rows.append((hf_name(path, spec, "", ""), shape, (path, ())))
    kv = specs[("kv_proj",)].shape
    for layer in range(kv[0]):
        for j, proj in enumerate(("k_proj", "v_proj")):
            rows.append((f"layers.{layer}.self_attn.{proj}.weight", (kv[3], kv[2]), (("kv_proj",), (layer, j))))
    return rows


def load_drafter(path: str | Path, *, dtype=jnp.bfloat16) -> DFlashDrafter:
    """Load a z-lab DFlash drafter directory; every tensor is checked for presence, shape and dtype."""
    c = load_dflash_config(path)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(c, rngs=nnx.Rngs(0), dtype=dtype)))
    flat = dict(nnx.to_flat_state(state))
    host = {p: np.zeros(v.shape, np.float32) for p, v in flat.items()}
    with Reader(path) as reader:
        names = reader.names()
        prefix = "model." if "model.fc.weight" in names else ""
        table = tensor_table(c)
        expected = {prefix + name for name, _, _ in table}
        extra = sorted(names - expected)
        if extra:
            raise CheckpointError(f"{reader.dir}: unexpected tensor '{extra[0]}' in a DFlash drafter checkpoint")
        for name, shape, (ppath, idx) in table:
            x = reader.read(prefix + name, shape, BF16).astype(np.float32)
            host[ppath][idx] = x.T if x.ndim == 2 else x
    for p, var in flat.items():
        var.set_value(jnp.asarray(host[p], var.get_value().dtype))
    return nnx.merge(graphdef, state)


def drafter_hf_tensors(model: DFlashDrafter) -> dict[str, np.ndarray]:
    """The drafter's tensors under their z-lab names, bf16, HF orientation (inverse of `load_drafter`)."""
    leaves = {p: np.asarray(jax.device_get(v.get_value()), np.float32) for p, v in nnx.to_flat_state(nnx.state(model))}
    out = {}
    for name, _, (ppath, idx) in tensor_table(model.config):
        x = leaves[ppath][idx]
        out[name] = np.ascontiguousarray((x.T if x.ndim == 2 else x).astype(BF16))
    return out


def dflash_to_hf_dict(c: DFlashConfig) -> dict:
    """A z-lab `config.json` dict for `c`."""
    d = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "num_target_layers": c.num_target_layers,
        "block_size": c.block_size,
        "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id},
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else {"type": "yarn", **dataclasses.asdict(c.rope_scaling)},
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "yarn_attention_factor": c.yarn_attention_factor,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if c.input_embedding_scale != 1.0:
        d["input_embedding_scale"] = c.input_embedding_scale
    if c.output_multiplier != 1.0:
        d["output_multiplier"] = c.output_multiplier
    return d


def save_drafter(model: DFlashDrafter, out_dir: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write `model` as a z-lab checkpoint: config.json + model.safetensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dflash_to_hf_dict(model.config), indent=2))
    save_file(
        drafter_hf_tensors(model),
        str(out / "model.safetensors"),
        metadata={"format": "pt", **(metadata or {})},
    )
    return out


def drafter_lineage(path: str | Path) -> dict[str, str]:
    """The metadata records of the drafter checkpoint at `path`, each key prefixed with "init_": what a drafter
    trained from it keeps of how its starting point was made (one "init_" per generation back)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "numpy") as f:
        return {f"init_{k}": v for k, v in (f.metadata() or {}).items() if k != "format"}
