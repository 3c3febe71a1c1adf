"""HF safetensors checkpoint -> `KimiForCausalLM` params, and orbax save/restore of the converted state.

The mapping from HF tensor names to param paths is `tensor_table`, derived from the models' weight declarations
(`models/params.py`), plus `expert_names` for the routed experts, which the checkpoint stores one linear per
expert; `training/synthetic.py` runs it backwards. Checkpoints are streamed tensor by tensor
(one MoE layer's experts at a time) and every leaf goes to its device as soon as it is converted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import SafetensorError, safe_open

from ddtree_jax import quant
from ddtree_jax.config import KimiConfig, load_kimi_config
from ddtree_jax.models.kimi import KimiForCausalLM, weight_table
from ddtree_jax.models.params import COPY, JOIN, TRANSPOSE, ParamPath, WeightSpec, param_table

TensorSpec = tuple[tuple[int, ...], np.dtype]  # (shape, dtype) of one HF tensor
ShardingFn = Callable[[ParamPath, WeightSpec], jax.sharding.Sharding | None]

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
_ST_DTYPES = {"BF16": BF16, "F32": F32, "I32": I32}  # the only safetensors dtypes these checkpoints use
_IGNORED = re.compile(r"^(vision_tower|mm_projector)\.|\.rotary_emb\.inv_freq$")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the file and the tensor."""


# ---- the name table ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One HF tensor and the param(s) it becomes.

    kind (`params.py`): COPY (same layout), TRANSPOSE (HF [out, in] -> param [in, out]) or JOIN (one HF
    [out, in] split along dim 1 of its [params[0].shape[0], -1, in] view into params of `param_shapes`: kv_b_proj
    [heads*(nope+v), kv_lora] -> w_uk [heads, nope, kv_lora], w_uv [heads, v, kv_lora]).
    """

    hf: str
    shape: tuple[int, ...]
    dtype: np.dtype
    params: tuple[ParamPath, ...]
    kind: str = TRANSPOSE
    param_shapes: tuple[tuple[int, ...], ...] = ()


def hf_prefixes(c: KimiConfig) -> tuple[str, str]:
    """(checkpoint root prefix, LM body prefix) for the config's layout (kimi_k2.md §6)."""
    if c.layout == "nested":
        return "language_model.", "language_model.model."
    return "", "model."


def hf_name(path: ParamPath, spec: WeightSpec, root: str, body: str) -> str:
    """The checkpoint name of the weight declared by `spec` at `path`: prefix + owning module path + hf_name."""
    module = "".join(f"{k}." for k in path[:-1])
    return (root if spec.hf_root else body + module) + spec.hf_name


def tensor_table(c: KimiConfig) -> list[Entry]:
    """Every non-expert HF tensor of the checkpoint with its HF shape, dtype (bf16; the router bias f32) and
    target params, from the target's weight declarations."""
    root, body = hf_prefixes(c)
    by_name: dict[str, list[tuple[ParamPath, WeightSpec]]] = {}
    for path, spec in weight_table(c, jnp.bfloat16).items():
        if spec.hf_name is not None:
            by_name.setdefault(hf_name(path, spec, root, body), []).append((path, spec))
    rows = []
    for name, parts in by_name.items():
        spec = parts[0][1]
        shapes = tuple(s.shape for _, s in parts)
        if spec.hf_layout == JOIN:
            shape = (sum(math.prod(s[:-1]) for s in shapes), spec.shape[-1])
        else:
            shape = spec.shape[::-1] if spec.hf_layout == TRANSPOSE else spec.shape
        rows.append(Entry(name, shape, np.dtype(spec.dtype), tuple(p for p, _ in parts), spec.hf_layout, shapes))
    return rows


def expert_names(c: KimiConfig, layer: int) -> list[tuple[str, tuple[int, int]]]:
    """(HF name without the `.weight*` suffix, [out, in]) of every routed-expert projection of a MoE layer,
    expert-major: experts.0.gate_proj, experts.0.up_proj, experts.0.down_proj, experts.1.gate_proj, ..."""
    _, body = hf_prefixes(c)
    h, inter = c.hidden_size, c.moe_intermediate_size
    shapes = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    return [
        (f"{body}layers.{layer}.mlp.experts.{e}.{proj}", shape)
        for e in range(c.n_routed_experts)
        for proj, shape in shapes.items()
    ]


def packed_specs(base: str, out_in: tuple[int, int], group: int) -> dict[str, TensorSpec]:
    """The three compressed-tensors tensors of one INT4 linear (kimi_k2.md §5)."""
    out, k = out_in
    return {
        base + ".weight_packed": ((out, k // 8), I32),
        base + ".weight_scale": ((out, k // group), BF16),
        base + ".weight_shape": ((2,), I32),
    }


def group_size(c: KimiConfig) -> int:
    return c.quant.group_size if c.quant is not None else quant.GROUP_SIZE


def to_params(entry: Entry, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """HF tensor -> the entry's param arrays (numpy, same dtype)."""
    if entry.kind == COPY:
        return (x,)
    if entry.kind == TRANSPOSE:
        return (np.ascontiguousarray(x.T),)
    first = entry.param_shapes[0]
    joined = x.reshape(first[0], -1, first[-1])
    splits = np.cumsum([math.prod(s[1:-1]) for s in entry.param_shapes[:-1]])
    parts = np.split(joined, splits, axis=1)
    return tuple(np.ascontiguousarray(p).reshape(s) for p, s in zip(parts, entry.param_shapes, strict=True))


def from_params(entry: Entry, xs: tuple[np.ndarray, ...]) -> np.ndarray:
    """Inverse of `to_params`."""
    if entry.kind == COPY:
        return xs[0]
    if entry.kind == TRANSPOSE:
        return np.ascontiguousarray(xs[0].T)
    return np.concatenate(xs, axis=1).reshape(entry.shape)


# ---- reading safetensors -------------------------------------------------------------------------


def _open(file: Path):
    """`safe_open` one safetensors file (numpy); one it refuses is a CheckpointError saying whether it is cut short."""
    try:
        return safe_open(str(file), framework="numpy")
    except SafetensorError as e:
        what = "truncated" if _cut_short(file) else "malformed"
        raise CheckpointError(f"{file}: {what} safetensors file ({e})") from None


def _cut_short(file: Path) -> bool:
    """Whether `file` ends before the bytes its header claims (the 8-byte header length, then the data offsets)."""
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else size
        if 8 + n > size:
            return True
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return False
    return 8 + n + end > size


class Reader:
    """Resolves HF tensor names through the index to shard files; reads tensors with shape/dtype checks."""

    def __init__(self, ckpt_dir: str | Path):
        d = Path(ckpt_dir)
        index, single = d / INDEX_FILE, d / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        elif single.is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{d}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        self._files: dict[str, Any] = {}  # shard file name -> its open safetensors handle
        if weight_map is None:
            self._files[SINGLE_FILE] = _open(single)
            weight_map = dict.fromkeys(self._files[SINGLE_FILE].keys(), SINGLE_FILE)
        for name, file in weight_map.items():
            if file in self._files:
                continue
            if not (d / file).is_file():
                raise CheckpointError(f"{d / file}: shard file missing (holds tensor '{name}')")
            self._files[file] = _open(d / file)
        keys = {file: set(handle.keys()) for file, handle in self._files.items()}
        for name, file in weight_map.items():
            if name not in keys[file]:
                raise CheckpointError(f"{d / file}: tensor '{name}' listed in the index is not in this shard")
        for file, names in keys.items():
            for name in sorted(names):
                if weight_map.get(name) != file and not _IGNORED.search(name):
                    raise CheckpointError(f"{d / file}: tensor '{name}' is not listed in {INDEX_FILE}")
        self.dir, self.weight_map = d, weight_map

    def names(self) -> set[str]:
        """All tensor names except the ignorable ones (vision tower, projector, rotary inv_freq)."""
        return {k for k in self.weight_map if not _IGNORED.search(k)}

    def read(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.dir}: tensor '{name}' missing")
        file = self.weight_map[name]
        handle = self._files[file]
        info = handle.get_slice(name)
        got_shape, got_dtype = info.get_shape(), info.get_dtype()
        if tuple(got_shape) != tuple(shape):
            raise CheckpointError(f"{self.dir / file}: tensor '{name}' has shape {got_shape}, expected {list(shape)}")
        if _ST_DTYPES.get(got_dtype) != dtype:
            raise CheckpointError(f"{self.dir / file}: tensor '{name}' has dtype {got_dtype}, expected {dtype.name}")
        return handle.get_tensor(name)

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- HF tensors -> params ------------------------------------------------------------------------


def _expert_plan(reader: Reader, c: KimiConfig, layer: int) -> list[tuple[str, tuple[int, int], bool]]:
    """(base name, [out, in], packed?) per expert projection; packed iff `weight_packed` is present."""
    plan = []
    for base, out_in in expert_names(c, layer):
        packed = base + ".weight_packed" in reader.weight_map
        if not packed and base + ".weight" not in reader.weight_map:
            missing = base + (".weight_packed" if c.quant is not None else ".weight")
            raise CheckpointError(f"{reader.dir}: tensor '{missing}' missing")
        plan.append((base, out_in, packed))
    return plan


def _plan_names(c: KimiConfig, plans: dict[int, list[tuple[str, tuple[int, int], bool]]]) -> set[str]:
    names = {e.hf for e in tensor_table(c)}
    g = group_size(c)
    for plan in plans.values():
        for base, out_in, packed in plan:
            names |= set(packed_specs(base, out_in, g)) if packed else {base + ".weight"}
    return names


def _read_packed(reader: Reader, base: str, out_in: tuple[int, int], group: int) -> tuple[np.ndarray, np.ndarray]:
    """A pack-quantized linear -> (int32 words [out, in/8], bf16 scales [out, in/G]); checks weight_shape."""
    (packed, packed_spec), (scale, scale_spec), (shape, shape_spec) = packed_specs(base, out_in, group).items()
    stored = reader.read(shape, *shape_spec).tolist()
    if tuple(stored) != out_in:
        raise CheckpointError(
            f"{reader.dir / reader.weight_map[shape]}: tensor '{shape}' is {stored}, expected {list(out_in)}"
        )
    return reader.read(packed, *packed_spec), reader.read(scale, *scale_spec)


def _read_expert(reader: Reader, base: str, out_in: tuple[int, int], packed: bool, group: int, quantized: bool):
    """One expert projection in the model's form: (int32 packed words, bf16 scale) if quantized, else bf16
    w [out, in]. Float weights are quantized and packed; INT4 ones dequantized, as needed."""
    if packed:
        words, s = _read_packed(reader, base, out_in, group)
        return (words, s) if quantized else quant.dequantize(quant.unpack_int32_to_int4(words), s, BF16)
    w = reader.read(base + ".weight", out_in, BF16)
    if not quantized:
        return w
    q, s = quant.quantize_group(w, group)
    return quant.pack_int4_to_int32(q), s


def _experts(
    reader: Reader, c: KimiConfig, layer: int, plan: list, quantized: bool
) -> Iterator[tuple[ParamPath, np.ndarray]]:
    """Stack one MoE layer's routed experts into the arrays its declarations describe (int4 weights as packed
    int32 words `[..., K/8]`, unpacked on the device): gate_up_q `[E, 2I, H/8]`, gate_up_s `[E, H/G, 2I]`, down_q
    `[E, H, I/8]`, down_s `[E, I/G, H]` (scales group-major: the MoE kernel's layout, transposed from the
    checkpoint's `[out, in/G]`); or, unquantized, gate_up `[E, H, 2I]`, down `[E, I, H]`."""
    p = ("layers", layer, "mlp", "experts")
    specs = weight_table(c, jnp.bfloat16, quantized).items()
    a = {path[-1]: np.empty(*_host_form(spec)) for path, spec in specs if path[:-1] == p}
    inter, g = c.moe_intermediate_size, group_size(c)
    for k, (base, out_in, packed) in enumerate(plan):
        ex, proj = divmod(k, 3)  # proj 0 gate, 1 up, 2 down (expert_names order)
        x = _read_expert(reader, base, out_in, packed, g, quantized)
        rows = slice(proj * inter, (proj + 1) * inter)
        if quantized and proj < 2:
            a["gate_up_q"][ex, rows], a["gate_up_s"][ex, :, rows] = x[0], x[1].T
        elif quantized:
            a["down_q"][ex], a["down_s"][ex] = x[0], x[1].T
        elif proj < 2:
            a["gate_up"][ex, :, rows] = x.T
        else:
            a["down"][ex] = x.T
    yield from (((*p, name), x) for name, x in a.items())


def _host_form(spec: WeightSpec) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a weight as read on the host: int4 as packed int32 words `[..., K/8]`."""
    if jnp.dtype(spec.dtype) == jnp.int4:
        return (*spec.shape[:-1], spec.shape[-1] // 8), I32
    return spec.shape, np.dtype(spec.dtype)


def iter_params(reader: Reader, c: KimiConfig, *, quantized: bool) -> Iterator[tuple[ParamPath, np.ndarray]]:
    """Validate the checkpoint's tensor set, then yield (param path, numpy array) one leaf at a time.

    quantized: routed experts become packed int32 words + bf16 scales (`gate_up_q`, ...; the int4 leaves'
    last dim / 8), else bf16 `[in, out]` stacks.
    """
    plans = {i: _expert_plan(reader, c, i) for i in c.moe_layers}
    expected = _plan_names(c, plans)
    extra = sorted(reader.names() - expected)
    if extra:
        raise CheckpointError(
            f"{reader.dir / reader.weight_map[extra[0]]}: unexpected tensor '{extra[0]}'"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    missing = sorted(expected - reader.names())
    if missing:
        raise CheckpointError(
            f"{reader.dir}: tensor '{missing[0]}' missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    last_layer = None  # a MoE layer's routed experts follow the layer's other tensors
    for entry in tensor_table(c):
        layer = _layer_of(entry)
        if layer != last_layer and last_layer in plans:
            yield from _experts(reader, c, last_layer, plans[last_layer], quantized)
        last_layer = layer
        arrays = to_params(entry, reader.read(entry.hf, entry.shape, entry.dtype))
        yield from zip(entry.params, arrays, strict=True)


def _layer_of(entry: Entry) -> int | None:
    return entry.params[0][1] if entry.params[0][0] == "layers" else None


def _to_device(x: np.ndarray, like: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding | None):
    """Place one leaf; int4 leaves arrive as packed int32 words and are unpacked on the device."""
    if like.dtype == jnp.int4:
        return jax.jit(quant.unpack_int4_device, out_shardings=sharding)(jax.device_put(x, sharding))
    return jax.device_put(x if x.dtype == like.dtype else x.astype(like.dtype), sharding)


def _unpacked_shape(x: np.ndarray, like: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] * 8) if like.dtype == jnp.int4 else x.shape


def _abstract_model(c: KimiConfig, dtype, quantized: bool | None) -> KimiForCausalLM:
    return nnx.eval_shape(lambda: KimiForCausalLM(c, rngs=nnx.Rngs(0), dtype=dtype, quantized=quantized))


def _is_quantized(state: nnx.State) -> bool:
    return any(path[-1] == "gate_up_q" for path, _ in nnx.to_flat_state(state))


def load_target(
    path: str | Path,
    *,
    dtype=jnp.bfloat16,
    quantized: bool | None = None,
    sharding_fn: ShardingFn | None = None,
) -> KimiForCausalLM:
    """Load an HF Kimi K2 checkpoint directory (either layout) into a `KimiForCausalLM`.

    quantized: routed experts as INT4 (default: iff the config has a quantization_config); float experts are
    quantized and INT4 ones dequantized as needed. dtype: floating-point params (the router bias stays f32).
    sharding_fn(path, weight spec) -> Sharding | None places each leaf; int4 leaves are first placed as packed int32
    `[..., K/8]` with the same sharding (so a sharded last axis must divide K/8), then unpacked in place.
    """
    c = load_kimi_config(path)
    model = _abstract_model(c, dtype, quantized)
    specs = param_table(model)
    graphdef, state = nnx.split(model)
    leaves = dict(nnx.to_flat_state(state))
    with Reader(path) as reader:
        for p, x in iter_params(reader, c, quantized=_is_quantized(state)):
            var = leaves.pop(p, None)
            if var is None:
                raise CheckpointError(f"{path}: param {_fmt(p)} from the checkpoint is not in the model")
            like = var.get_value()
            if _unpacked_shape(x, like) != tuple(like.shape):
                raise CheckpointError(
                    f"{path}: param {_fmt(p)} has shape {list(x.shape)}, model wants {list(like.shape)}"
                )
            var.set_value(_to_device(x, like, sharding_fn(p, specs[p]) if sharding_fn else None))
    if leaves:
        raise CheckpointError(f"{path}: model param {_fmt(next(iter(leaves)))} not found in the checkpoint")
    return nnx.merge(graphdef, state)


def _fmt(p: ParamPath) -> str:
    return ".".join(str(k) for k in p)


# ---- orbax save / restore of the converted state -------------------------------------------------


def save_converted(model: nnx.Module, directory: str | Path) -> None:
    """Write `nnx.state(model)` (int4 leaves included) as an orbax checkpoint at a new `directory`."""
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(Path(directory).absolute(), nnx.state(model))
    ckpt.wait_until_finished()


def restore_converted(
    directory: str | Path,
    config: KimiConfig,
    *,
    dtype=jnp.bfloat16,
    quantized: bool | None = None,
    sharding_fn: ShardingFn | None = None,
) -> KimiForCausalLM:
    """Inverse of `save_converted`: a `KimiForCausalLM` with the saved params, placed by sharding_fn."""
    model = _abstract_model(config, dtype, quantized)
    specs = param_table(model)
    graphdef, state = nnx.split(model)
    if sharding_fn is not None:
        for p, var in nnx.to_flat_state(state):
            like = var.get_value()
            var.set_value(jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding_fn(p, specs[p])))
    restored = ocp.StandardCheckpointer().restore(Path(directory).absolute(), state)
    return nnx.merge(graphdef, restored)
