"""Weight declarations: each module says once, in its `param_specs()`, what weights it owns.

A `WeightSpec` holds a weight's shape, dtype, logical axes (one name or None per dim, mapped to mesh axes by
`sharding.LOGICAL_AXES`), its HF checkpoint name and layout, and how it is initialised. The rest derives from
the declarations:

* `init_params` creates a module's `nnx.Param`s from them (so `nnx.eval_shape` of a model gives abstract shapes);
* `param_table` collects every declaration of a (possibly abstract) model by param path: `sharding.py` places
  each leaf by its logical axes, `checkpoint.py` / `dflash_checkpoint.py` build their HF name tables from it,
  and `sizing.py` counts parameters and bytes from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

ParamPath = tuple[str | int, ...]

# How a weight sits in the HF checkpoint.
COPY = "copy"  # the same array
TRANSPOSE = "transpose"  # HF [out, in], ours [in, out]
JOIN = "join"  # several params share one HF [out, in] tensor: concatenated along dim 1, flattened to 2-D


@dataclasses.dataclass(frozen=True)
class Normal:
    """N(0, std^2) drawn in f32 from the module's `params` stream, cast to the weight's dtype."""

    std: float = 0.02

    def __call__(self, rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return (jax.random.normal(rngs.params(), shape, jnp.float32) * self.std).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Full:
    """Every element `value` (norm gains 1, router bias 0); draws no random numbers."""

    value: float = 1.0

    def __call__(self, rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jnp.full(shape, self.value, dtype)


@dataclasses.dataclass(frozen=True)
class UniformInt4:
    """Integers uniform in [-7, 7] (the INT4 QAT grid), drawn from the `params` stream."""

    def __call__(self, rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jax.random.randint(rngs.params(), shape, -7, 8, jnp.int32).astype(dtype)


Init = Normal | Full | UniformInt4


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One weight.

    hf_name: the checkpoint tensor's name relative to the owning module's checkpoint prefix (the module path
    under the model body, e.g. `model.layers.3.self_attn.`), or to the checkpoint root when `hf_root`; None when
    the checkpoint stores it in pieces its loader assembles (routed experts, the drafter's fused `kv_proj`).
    hf_layout: COPY, TRANSPOSE or JOIN (see above). scale_of: for INT4 group scales, the name of the weight
    they scale (scales are counted in bytes, not as parameters).
    """

    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[str | None, ...]
    hf_name: str | None = None
    hf_layout: str = TRANSPOSE
    hf_root: bool = False
    init: Init = Normal()
    scale_of: str | None = None

    def __post_init__(self):
        if len(self.logical_axes) != len(self.shape):
            raise ValueError(f"{len(self.logical_axes)} logical axes for a weight of shape {self.shape}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes as stored (int4: half a byte per element)."""
        bits = 4 if jnp.dtype(self.dtype) == jnp.int4 else 8 * jnp.dtype(self.dtype).itemsize
        return self.size * bits // 8

    @property
    def num_params(self) -> int:
        """Parameters it holds: its size, 0 for quantization scales."""
        return 0 if self.scale_of else self.size


def init_params(module: nnx.Module, rngs: nnx.Rngs, names: tuple[str, ...] | None = None) -> None:
    """Create `module`'s declared weights (`names` of them, default all) as `nnx.Param`s, in declaration order."""
    for name, spec in module.param_specs().items():
        if names is None or name in names:
            setattr(module, name, nnx.Param(spec.init(rngs, spec.shape, spec.dtype)))


def param_table(model: nnx.Module) -> dict[ParamPath, WeightSpec]:
    """Every param of `model` (concrete or from `nnx.eval_shape`) -> its declaration, in `nnx.state` order."""
    specs: dict[ParamPath, WeightSpec] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "param_specs"):
            specs |= {(*path, name): spec for name, spec in node.param_specs().items()}
    table = {}
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path not in specs:
            raise ValueError(f"param {'.'.join(map(str, path))} has no declaration")
        table[path] = specs[path]
    return table
