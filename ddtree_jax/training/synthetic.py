"""Write HF-format Kimi K2 checkpoints (config.json + sharded safetensors + index), exactly as released.

Used by tests (random weights) and by experiments/train_target.py (export a trained NNX model with
`hf_tensors_from_model`). Routed experts are written in compressed-tensors pack-quantized INT4 when the config
has a quantization_config, as `.weight` bf16 otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from ddtree_jax import quant
from ddtree_jax.checkpoint import (
    BF16,
    F32,
    I32,
    INDEX_FILE,
    expert_names,
    from_params,
    group_size,
    packed_specs,
    tensor_table,
)
from ddtree_jax.config import KimiConfig, to_hf_dict

# Tiny tensors of the K2.5/K2.6 vision wrapper, written to nested checkpoints to prove the loader skips them.
_VISION_EXTRAS = {"vision_tower.patch_embed.proj.weight": (8, 4), "mm_projector.proj.0.weight": (4, 8)}


def pack_experts(tensors: dict[str, np.ndarray], c: KimiConfig) -> dict[str, np.ndarray]:
    """Replace each float routed-expert `.weight` [out, in] by weight_packed / weight_scale / weight_shape."""
    g = group_size(c)
    out = {}
    for name, x in tensors.items():
        if ".mlp.experts." not in name or not name.endswith(".weight"):
            out[name] = x
            continue
        base = name.removesuffix(".weight")
        q, s = quant.quantize_group(np.asarray(x, np.float32), g)
        packed, scale, shape = packed_specs(base, x.shape, g)
        out[packed], out[scale] = quant.pack_int4_to_int32(q), s
        out[shape] = np.asarray(x.shape, np.int32)
    return out


def random_hf_tensors(c: KimiConfig, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under the HF names of the config's layout, experts packed when c.quant is set.

    Linear weights ~ N(0, 0.02^2), norm gains ~ 1 + N(0, 0.1^2), router bias ~ N(0, 0.01^2) in f32.
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for e in tensor_table(c):
        if e.dtype == F32:
            tensors[e.hf] = (0.01 * rng.standard_normal(e.shape)).astype(F32)
        elif len(e.shape) == 1:
            tensors[e.hf] = (1.0 + 0.1 * rng.standard_normal(e.shape)).astype(BF16)
        else:
            tensors[e.hf] = (0.02 * rng.standard_normal(e.shape, np.float32)).astype(BF16)
    for layer in c.moe_layers:
        for base, shape in expert_names(c, layer):
            tensors[base + ".weight"] = (0.02 * rng.standard_normal(shape, np.float32)).astype(BF16)
    return pack_experts(tensors, c) if c.quant is not None else tensors


def write_hf_checkpoint(
    out_dir: str | Path,
    config: KimiConfig,
    params: dict[str, np.ndarray] | None = None,
    *,
    seed: int = 0,
    num_shards: int = 2,
) -> Path:
    """Write config.json, `model-0000k-of-0000n.safetensors` shards and model.safetensors.index.json.

    params: tensors keyed by the HF names of the config's layout (see `hf_tensors_from_model`); float expert
    weights are packed when config.quant is set. Written as given otherwise (no validation), so tests can
    write broken checkpoints. None: `random_hf_tensors(config, seed=seed)`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if params is None:
        tensors = random_hf_tensors(config, seed=seed)
    else:
        tensors = pack_experts(params, config) if config.quant is not None else dict(params)
    if config.layout == "nested":
        rng = np.random.default_rng(seed + 1)
        tensors |= {k: (0.02 * rng.standard_normal(s)).astype(BF16) for k, s in _VISION_EXTRAS.items()}
    (out / "config.json").write_text(json.dumps(to_hf_dict(config), indent=2))
    names = list(tensors)
    per_shard = -(-len(names) // num_shards)
    weight_map, total = {}, 0
    for k in range(num_shards):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: np.ascontiguousarray(tensors[n]) for n in names[k * per_shard : (k + 1) * per_shard]}
        save_file(chunk, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file)
        total += sum(x.nbytes for x in chunk.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return out


def hf_tensors_from_model(model: nnx.Module) -> dict[str, np.ndarray]:
    """The HF tensors (model.config's layout) of a `KimiForCausalLM`: the inverse of the loader's table.

    Routed experts come out packed INT4 when config.quant is set (float experts are quantized), else bf16.
    Gathers the whole model on the host: meant for the small trained models of experiments/.
    """
    config = model.config
    leaves = {p: np.asarray(jax.device_get(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(model))}
    tensors = {}
    for e in tensor_table(config):
        tensors[e.hf] = from_params(e, tuple(leaves[p] for p in e.params)).astype(e.dtype)
    inter, g = config.moe_intermediate_size, group_size(config)
    for layer in config.moe_layers:
        p = ("layers", layer, "mlp", "experts")
        names = expert_names(config, layer)
        if (*p, "gate_up_q") in leaves:
            gu = (leaves[(*p, "gate_up_q")].astype(np.int8), leaves[(*p, "gate_up_s")])
            dn = (leaves[(*p, "down_q")].astype(np.int8), leaves[(*p, "down_s")])
            for k, (base, shape) in enumerate(names):
                ex, proj = divmod(k, 3)
                rows = slice(proj * inter, (proj + 1) * inter) if proj < 2 else slice(None)
                src_q, src_s = gu if proj < 2 else dn
                q, s = src_q[ex, rows], src_s[ex, :, rows].T  # scales are stored group-major [K/G, N]
                if config.quant is not None:
                    packed, scale, shp = packed_specs(base, shape, g)
                    tensors[packed], tensors[scale] = quant.pack_int4_to_int32(q), s.astype(BF16)
                    tensors[shp] = np.asarray(shape, I32)
                else:
                    tensors[base + ".weight"] = quant.dequantize(q, s, BF16)
        else:
            gu, dn = leaves[(*p, "gate_up")], leaves[(*p, "down")]
            for k, (base, _) in enumerate(names):
                ex, proj = divmod(k, 3)
                w = gu[ex, :, proj * inter : (proj + 1) * inter] if proj < 2 else dn[ex]
                tensors[base + ".weight"] = np.ascontiguousarray(w.T).astype(BF16)
    return pack_experts(tensors, config) if config.quant is not None else tensors
