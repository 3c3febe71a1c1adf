"""Runs under 8 simulated CPU devices in a subprocess of test_sharding.py (the device count must be fixed before
jax initialises; the rest of the suite keeps one device). Prints one JSON object for the parent to assert on.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded_checks.py MESH [MESH ...] OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from conftest import tiny_dflash_config, tiny_kimi_config
from flax import nnx
from test_engine import oracle_draft

from ddtree_jax import engine, sharding
from ddtree_jax import tree as ddtree
from ddtree_jax.api import Generator
from ddtree_jax.models.dflash import DFlashDrafter
from ddtree_jax.models.kimi import KimiForCausalLM
from ddtree_jax.models.params import param_table
from ddtree_jax.sampling import request_keys
from ddtree_jax.training import synthetic
from pallas_kernels.dispatch import TOPK_CHUNK, Kernels

CFG = tiny_kimi_config(vocab_size=96)  # 96: divisible by every tensor size tested
BATCH, PROMPT, NEW, BUDGET = 2, 6, 16, 8


def pair() -> tuple[KimiForCausalLM, DFlashDrafter]:
    target = KimiForCausalLM(CFG, rngs=nnx.Rngs(3), dtype=jnp.float32)
    # KV heads split over tensor <= 4; head dim 32, the drafter attention kernel's least; 128 inner columns: 32 a
    # device at tensor=4, a multiple of the SwiGLU kernel's 16
    drafter_cfg = tiny_dflash_config(CFG, num_key_value_heads=4, head_dim=32, intermediate_size=128)
    return target, DFlashDrafter(drafter_cfg, rngs=nnx.Rngs(4), dtype=jnp.float32)


def forward_logits(target: KimiForCausalLM, tokens: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(target)
    b, n = tokens.shape

    @jax.jit
    def run(state, tokens):
        m = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(n), (b, n))
        return m.logits(m(tokens, positions, m.init_cache(b, n + 4), jnp.zeros((b,), jnp.int32)).hidden)

    return np.asarray(run(state, jnp.asarray(tokens)))


def generate_ar(target: KimiForCausalLM, prompts: np.ndarray, plen: np.ndarray) -> list[list[int]]:
    """The single-device reference: greedy AR, no mesh."""
    spec = engine.GenSpec("ar", BATCH, PROMPT, NEW)
    program, ts, ds = engine.compile_generate(target, None, spec)
    out = program(ts, ds, jnp.asarray(prompts), jnp.asarray(plen), request_keys(0, range(BATCH)))
    return [np.asarray(out.tokens[b, : out.n_out[b]]).tolist() for b in range(spec.batch)]


def drafter_hidden(drafter: DFlashDrafter, mode: str) -> np.ndarray:
    """The drafter's output `[B, S, H]` on fixed inputs (context lengths 0 and 7 of 16 slots), its attention and
    SwiGLU run in `mode` (under the active mesh per device: on its heads, `sharding.drafter_attention`, and on its
    inner columns, `sharding.drafter_swiglu`)."""
    c, b, ctx = drafter.config, 2, 10
    rng = np.random.default_rng(6)
    feats = jnp.asarray(rng.standard_normal((b, ctx, len(c.target_layer_ids) * c.hidden_size)), jnp.float32)
    embeds = jnp.asarray(rng.standard_normal((b, c.block_size, c.hidden_size)), jnp.float32)
    cache_len = jnp.asarray([0, 7], jnp.int32)
    graphdef, state = nnx.split(drafter)

    @jax.jit
    def run(state):
        d = nnx.merge(graphdef, state)
        cache = d.append_context(
            d.init_cache(b, 16), feats, jnp.arange(ctx)[None].repeat(b, 0), jnp.zeros((b,), jnp.int32)
        )
        positions = cache_len[:, None] + jnp.arange(c.block_size)[None, :]
        kernels = Kernels().with_mode(mode, op="drafter_attention").with_mode(mode, op="drafter_swiglu")
        return d(embeds, positions, cache, cache_len, kernels)

    return np.asarray(run(state))


def vocab_sharded_trees(mesh, vocab: int) -> dict:
    """Trees from random logits `[B, D, vocab]` (ties included) built from vocab-sharded top-K vs full logits; a vocab
    whose shards are longer than `TOPK_CHUNK` takes the chunk-wise top-k inside each shard."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((4, 7, vocab)).astype(np.float32)
    logits[0, :, ::3] = 1.5  # many exactly tied tokens across shards
    logits[1, 2, 10:] = -np.inf  # a depth with few finite tokens
    root = jnp.arange(4, dtype=jnp.int32)
    full = jax.vmap(lambda lg, r: ddtree.build_tree(lg, r, 12))(jnp.asarray(logits), root)
    placed = jax.device_put(logits, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tensor")))

    @jax.jit
    def sharded(lg):
        lp, ids = sharding.topk_logsoftmax(lg, 12, TOPK_CHUNK)
        return jax.vmap(lambda a, b, r: ddtree.build_tree_from_topk(a, b, r, 12))(lp, ids, root)

    with sharding.use_mesh(mesh):
        got = sharded(placed)
    return {
        "structure_equal": all(
            np.array_equal(np.asarray(getattr(full, f)), np.asarray(getattr(got, f)))
            for f in ("tokens", "parents", "depth", "valid")
        ),
        "score_max_diff": float(np.nanmax(np.abs(np.nan_to_num(np.asarray(full.score) - np.asarray(got.score))))),
        "n_valid": int(np.asarray(got.valid).sum()),
    }


def loader_placement(mesh, ckpt: Path) -> dict:
    """Load the synthetic checkpoint sharded; per leaf: sharding as the rules say, distinct shards, bytes."""
    gen = Generator.load(ckpt, mesh=mesh)
    specs = param_table(gen.target)
    leaves = {}
    for path, var in nnx.to_flat_state(nnx.state(gen.target)):
        x = var.get_value()
        want = sharding.param_sharding(mesh, path, specs[path])
        distinct = {tuple((s.start, s.stop) for s in idx) for idx in x.sharding.devices_indices_map(x.shape).values()}
        leaves[".".join(map(str, path))] = {
            "as_rule": x.sharding.is_equivalent_to(want, x.ndim),
            "shards": len(distinct),
            "bytes_per_device": x.addressable_shards[0].data.nbytes,
            "bytes": x.nbytes,
        }
    return leaves


def main(specs: list[str], out_dir: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size - 1, (BATCH, PROMPT)).astype(np.int32)
    plen = np.array([PROMPT, 3], np.int32)
    base_target, _ = pair()
    ar = generate_ar(base_target, tokens, plen)
    reference = np.zeros((BATCH, NEW + 16), np.int32)
    for b, t in enumerate(ar):
        reference[b, : len(t)] = t
    engine.draft = oracle_draft(reference, noise=1.2, seed=7)  # deep acceptance, siblings, compaction
    base_logits = forward_logits(base_target, tokens)
    base_drafter = drafter_hidden(pair()[1], "reference")
    ckpt = synthetic.write_hf_checkpoint(out_dir / "ckpt", tiny_kimi_config(vocab_size=96), seed=2)

    results = {"ar": ar}
    for spec in specs:
        gen = Generator(*pair(), mesh=spec)  # shards the in-memory pair
        mesh = gen.mesh
        with sharding.use_mesh(mesh):
            logits = forward_logits(gen.target, tokens)
            drafter = {mode: drafter_hidden(gen.drafter, mode) for mode in ("reference", "interpret")}
        prompts = [row[:n].tolist() for row, n in zip(tokens, plen, strict=True)]
        ddt = gen.generate(prompts, method="ddtree", budget=BUDGET, max_new_tokens=NEW, ignore_eos=True)
        results[spec] = {
            "logits_max_diff": float(np.abs(logits - base_logits).max()),
            "logits_scale": float(np.abs(base_logits).max()),
            "drafter_max_diff": {mode: float(np.abs(h - base_drafter).max()) for mode, h in drafter.items()},
            "drafter_scale": float(np.abs(base_drafter).max()),
            "ddtree": ddt.tokens,
            "ddtree_tau": float(np.mean([s["tokens_per_round"] for s in ddt.stats])),
            "tree": vocab_sharded_trees(mesh, CFG.vocab_size) if mesh.shape["tensor"] > 1 else None,
            "tree_chunked": vocab_sharded_trees(mesh, 8192) if mesh.shape["tensor"] > 1 else None,
            "loader": loader_placement(mesh, ckpt),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:-1], Path(sys.argv[-1]))
