"""Weight declarations (ddtree_jax/models/params.py): a weight declared once gives its param, abstract shape,
sharding, checkpoint name and size; the real models' declarations match the params they create."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx
from jax.sharding import PartitionSpec

from ddtree_jax import sharding
from ddtree_jax.checkpoint import hf_name
from ddtree_jax.models import dflash, kimi
from ddtree_jax.models.params import COPY, Full, WeightSpec, init_params, param_table

FAKE_MESH = type("FakeMesh", (), {"shape": {"data": 1, "expert": 2, "tensor": 4}})()  # logical_spec reads .shape


class Toy(nnx.Module):
    """A module with one declared weight: a projection `[H, V]` split over `vocab`."""

    def __init__(self, hidden: int, vocab: int, *, rngs: nnx.Rngs):
        self.hidden, self.vocab = hidden, vocab
        init_params(self, rngs)

    def param_specs(self) -> dict[str, WeightSpec]:
        return {"proj": WeightSpec((self.hidden, self.vocab), jnp.bfloat16, (None, "vocab"), "proj.weight")}


class ToyWithGain(Toy):
    """The same module after adding a weight: one more line in its declaration, nothing else."""

    def param_specs(self) -> dict[str, WeightSpec]:
        gain = WeightSpec((self.hidden,), jnp.float32, (None,), "gain.weight", COPY, init=Full(1.0))
        return super().param_specs() | {"gain": gain}


class Outer(nnx.Module):
    def __init__(self, toy: type[Toy], *, rngs: nnx.Rngs):
        self.toy = toy(8, 16, rngs=rngs)


def _derived(toy: type[Toy]) -> dict[str, dict]:
    """Everything the rest of the code derives from the declarations of `Outer(toy)`, per param."""
    abstract = nnx.eval_shape(lambda: Outer(toy, rngs=nnx.Rngs(0)))
    concrete = Outer(toy, rngs=nnx.Rngs(0))
    values = dict(nnx.to_flat_state(nnx.state(concrete)))
    abstract_values = dict(nnx.to_flat_state(nnx.state(abstract)))
    mesh = sharding.make_mesh("tensor=1", jax.devices()[:1])
    out = {}
    for path, spec in param_table(abstract).items():
        x, a = values[path].get_value(), abstract_values[path].get_value()
        out[".".join(map(str, path))] = {
            "param": (x.shape, x.dtype),
            "abstract": (a.shape, a.dtype),
            "partition": sharding.logical_spec(FAKE_MESH, spec.logical_axes, spec.shape),
            "sharding": sharding.param_sharding(mesh, path, spec).spec,
            "hf": hf_name(path, spec, "", "model."),
            "bytes": spec.nbytes,
            "params": spec.num_params,
        }
    return out


def test_one_declared_weight_gives_param_sharding_name_and_size() -> None:
    got = _derived(Toy)
    assert got == {
        "toy.proj": {
            "param": ((8, 16), jnp.bfloat16),
            "abstract": ((8, 16), jnp.bfloat16),
            "partition": PartitionSpec(None, ("tensor",)),
            "sharding": PartitionSpec(None, ("tensor",)),
            "hf": "model.toy.proj.weight",
            "bytes": 8 * 16 * 2,
            "params": 8 * 16,
        }
    }


def test_adding_a_weight_touches_one_declaration() -> None:
    before, after = _derived(Toy), _derived(ToyWithGain)
    assert after.pop("toy.gain") == {
        "param": ((8,), jnp.float32),
        "abstract": ((8,), jnp.float32),
        "partition": PartitionSpec(None),
        "sharding": PartitionSpec(None),
        "hf": "model.toy.gain.weight",
        "bytes": 8 * 4,
        "params": 8,
    }
    assert after == before
    np.testing.assert_array_equal(ToyWithGain(8, 16, rngs=nnx.Rngs(0)).gain[...], np.ones(8, np.float32))


def test_logical_axes_must_match_the_shape() -> None:
    with pytest.raises(ValueError, match="1 logical axes for a weight of shape"):
        WeightSpec((4, 4), jnp.float32, (None,))


def test_int4_bytes_and_scales() -> None:
    q = WeightSpec((2, 64, 32), jnp.int4, ("experts", None, None))
    s = WeightSpec((2, 1, 64), jnp.bfloat16, ("experts", None, None), scale_of="q")
    assert (q.nbytes, q.num_params) == (2 * 64 * 32 // 2, 2 * 64 * 32)
    assert (s.nbytes, s.num_params) == (2 * 64 * 2, 0)


def _assert_declared(model: nnx.Module, table) -> None:
    leaves = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    assert list(leaves) == list(table)
    for path, x in leaves.items():
        assert (x.shape, x.dtype) == (table[path].shape, jnp.dtype(table[path].dtype)), path


@pytest.mark.parametrize("quantized", [True, False])
def test_model_declarations_match_their_params(quantized: bool) -> None:
    cfg = tiny_kimi_config(quantized=quantized)
    target = kimi.KimiForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, quantized=quantized)
    _assert_declared(target, kimi.weight_table(cfg, jnp.float32, quantized))
    dcfg = tiny_dflash_config(cfg)
    drafter = dflash.DFlashDrafter(dcfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    _assert_declared(drafter, dflash.weight_table(dcfg, jnp.float32))
