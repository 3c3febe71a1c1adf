"""Train a DFlash drafter against a frozen, shipped (INT4) target and write it in the z-lab format.

    python -m experiments.train_dflash --target=checkpoints/kimi-mini --out_dir=checkpoints/kimi-mini-dflash

Recipe (dflash_ddtree.md §4, `ddtree_jax.training.trainers.drafter_loss`): target features at `target_layer_ids`,
--anchors random anchors per sequence, blocks [anchor, mask x 7], context strictly before the anchor,
bidirectional inside the block, cross-entropy on block positions 1..7 weighted exp(-(k-1)/gamma); the
target's embedding and lm_head are shared and frozen. The target is loaded from the shipped checkpoint with its
INT4 experts dequantized, i.e. exactly the weights inference uses. Loss curve: --results_dir/train_dflash_loss.json.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import flags, logging

from ddtree_jax.config import DFlashConfig, KimiConfig, YarnConfig
from ddtree_jax.errors import UserError, run_app

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target HF checkpoint (frozen).")
flags.DEFINE_string("data_dir", "experiments/data", "train_tokens.npy from `train_target --stage=data`.")
flags.DEFINE_string("out_dir", "checkpoints/kimi-mini-dflash", "Drafter checkpoint directory.")
flags.DEFINE_string("results_dir", "experiments/results", "Loss curve JSON.")
# preset -> (layers, attention heads, KV heads, head dim, MLP width); the hidden size is the target's
DRAFTER_PRESETS = {
    "mini": (4, 4, 2, 64, 1024),
    "wide6": (6, 8, 2, 64, 1536),
    "deep8": (8, 4, 2, 64, 1024),
    "tiny": (1, 2, 1, 16, 64),
}
flags.DEFINE_enum("preset", "mini", list(DRAFTER_PRESETS), "Drafter size (DRAFTER_PRESETS).")
flags.DEFINE_integer("block_size", 8, "Block size B (anchor + B-1 masks).")
flags.DEFINE_integer("steps", 4000, "Maximum optimizer steps.")
flags.DEFINE_float("max_seconds", 170.0, "Wall-clock budget of the training loop (the schedule follows it).")
flags.DEFINE_integer("batch", 16, "Sequences per step.")
flags.DEFINE_integer("seq_len", 512, "Tokens per sequence.")
flags.DEFINE_integer("anchors", 64, "Anchor blocks per sequence.")
flags.DEFINE_float("gamma", 4.0, "Position decay of the loss weights exp(-(k-1)/gamma).")
flags.DEFINE_float("distill", 0.5, "Weight of the target's distribution in the label (rest: the data token).")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay (matrices only).")
flags.DEFINE_integer("seed", 0, "Init, anchor and data seed.")
flags.DEFINE_string("init", "", "Continue from this drafter checkpoint (its config wins over --preset/--block_size).")
flags.DEFINE_integer("log_every", 25, "Steps between loss-curve points.")

MASK = "[MASK]"


def drafter_config(preset: str, target: KimiConfig, mask_id: int, block_size: int) -> DFlashConfig:
    """Qwen3-style drafter sized for the target; features from layers spread over its depth."""
    n = target.num_hidden_layers
    layers, heads, kv_heads, head_dim, inter = DRAFTER_PRESETS[preset]
    ids = tuple(sorted({1, n // 2, n - 1}))
    return DFlashConfig(
        hidden_size=target.hidden_size,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=target.vocab_size,
        num_target_layers=n,
        block_size=block_size,
        target_layer_ids=ids,
        mask_token_id=mask_id,
        rope_theta=50000.0,
        rope_scaling=YarnConfig(
            factor=4.0,
            original_max_position_embeddings=512,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),  # fmt: skip
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=1e-6,
        yarn_attention_factor=1.0,
    )


def main(argv: Sequence[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.dflash_checkpoint import dflash_to_hf_dict, drafter_lineage, load_drafter, save_drafter
    from ddtree_jax.models.dflash import DFlashDrafter
    from ddtree_jax.training import trainers
    from experiments.common import metadata

    target = load_target(FLAGS.target, dtype=jnp.bfloat16, quantized=False)
    vocab = json.loads((Path(FLAGS.target) / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in vocab["added_tokens"] if t["content"] == MASK)
    if FLAGS.init:
        drafter = load_drafter(FLAGS.init, dtype=jnp.float32)
        cfg = drafter.config
        if cfg.mask_token_id != mask_id:
            raise UserError(f"--init drafter's mask id {cfg.mask_token_id} is not the tokenizer's {mask_id}")
    else:
        cfg = drafter_config(FLAGS.preset, target.config, mask_id, FLAGS.block_size)
        drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(FLAGS.seed), dtype=jnp.float32)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
    tokens = np.load(Path(FLAGS.data_dir) / "train_tokens.npy")
    logging.info("drafter: %d params, target layers %s, mask id %d", n_params, cfg.target_layer_ids, mask_id)
    trainer = trainers.DrafterTrainer(
        drafter,
        target,
        trainers.adamw(FLAGS.lr, FLAGS.weight_decay),
        anchors=FLAGS.anchors,
        gamma=FLAGS.gamma,
        distill=FLAGS.distill,
    )
    rng, key = np.random.default_rng(FLAGS.seed + 1), jax.random.key(FLAGS.seed)
    curve, t0, step = [], time.perf_counter(), 0
    while step < FLAGS.steps:
        elapsed = time.perf_counter() - t0
        progress = max(step / FLAGS.steps, elapsed / FLAGS.max_seconds)
        if progress >= 1.0:
            break
        lr = trainers.lr_at(progress, FLAGS.lr)
        key, sub = jax.random.split(key)
        loss, acc = trainer.step(trainers.sample_windows(tokens, FLAGS.batch, FLAGS.seq_len, rng), sub, lr)
        step += 1
        if step == 1:  # the budget counts from the first compiled step
            t0 = time.perf_counter()
        if step % FLAGS.log_every == 0 or step == 1:
            curve.append({"step": step, "seconds": elapsed, "lr": lr, "loss": loss, "top1_agree_pos1": acc})
            logging.info("step %d  %.0fs  lr %.2e  loss %.4f  pos-1 agreement %.3f", step, elapsed, lr, loss, acc)
    train_s = time.perf_counter() - t0
    run = {
        "steps": step,
        "train_seconds": train_s,
        "params": int(n_params),
        "final_loss": curve[-1]["loss"] if curve else None,
        "flags": {
            k: FLAGS[k].value
            for k in ("preset", "init", "batch", "seq_len", "anchors", "gamma", "distill", "lr", "weight_decay")
            + ("seed",)
        },
    }
    lineage = drafter_lineage(FLAGS.init) if FLAGS.init else {}  # keep how the starting drafter was made
    save_drafter(trainer.export(), FLAGS.out_dir, metadata={**lineage, "training": json.dumps({**metadata(), **run})})
    results = Path(FLAGS.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    payload = {"meta": metadata(), "run": run, "config": dflash_to_hf_dict(cfg), "curve": curve}
    (results / "train_dflash_loss.json").write_text(json.dumps(payload, indent=1))
    logging.info("trained %d steps in %.0fs -> %s", step, train_s, FLAGS.out_dir)


if __name__ == "__main__":
    run_app(main)
