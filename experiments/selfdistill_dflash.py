"""Fine-tune a trained DFlash drafter on its target's own greedy continuations (self-distillation).

    python -m experiments.selfdistill_dflash [--num_prompts=4096 --gen_tokens=128 --max_seconds=300]

Acceptance at temperature 0 asks the drafter to predict the target's greedy tokens, so this stage builds data that
is exactly that: random windows of the training stream (--prompt_len tokens) continued greedily by the shipped
(INT4) target for --gen_tokens. The drafter then trains with the standard recipe (`training.DrafterTrainer`: target
features computed in the step, position-decayed cross-entropy against a mix of the greedy token and the target's
distribution, --distill) on anchors inside the generated part only. Sized for a GPU; a few hundred steps run on a
CPU. Overwrites --out_dir (the drafter, z-lab format) and writes --results_dir/train_dflash_selfdistill_loss.json.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/kimi-mini", "Target checkpoint (frozen).")
flags.DEFINE_string("drafter", "checkpoints/kimi-mini-dflash", "Drafter to start from.")
flags.DEFINE_string("out_dir", "checkpoints/kimi-mini-dflash", "Where the fine-tuned drafter goes.")
flags.DEFINE_string("data_dir", "experiments/data", "train_tokens.npy.")
flags.DEFINE_string("results_dir", "experiments/results", "Loss curve JSON.")
flags.DEFINE_integer("num_prompts", 256, "Generated sequences.")
flags.DEFINE_integer("prompt_len", 96, "Prompt tokens per sequence (a window of the training stream).")
flags.DEFINE_integer("gen_tokens", 128, "Greedy tokens generated per sequence.")
flags.DEFINE_integer("gen_batch", 64, "Generation batch size.")
flags.DEFINE_integer("batch", 8, "Sequences per step.")
flags.DEFINE_integer("anchors", 24, "Anchors per sequence (inside the generated part).")
flags.DEFINE_integer("steps", 2000, "Maximum steps.")
flags.DEFINE_float("max_seconds", 900.0, "Wall-clock budget of the training loop.")
flags.DEFINE_float("lr", 5e-4, "Peak learning rate.")
flags.DEFINE_float("gamma", 4.0, "Position decay of the loss weights.")
flags.DEFINE_float("distill", 0.5, "Weight of the target's distribution in the label (rest: the greedy token).")
flags.DEFINE_integer("seed", 0, "Data and anchor seed.")


def generate_sequences(gen, rng: np.random.Generator, tokens: np.ndarray) -> np.ndarray:
    """`[num_prompts, prompt_len + gen_tokens]` int32: training-stream windows + the target's greedy tokens."""
    rows = []
    for _ in range(0, FLAGS.num_prompts, FLAGS.gen_batch):
        starts = rng.integers(0, len(tokens) - FLAGS.prompt_len, size=FLAGS.gen_batch)
        prompts = [tokens[s : s + FLAGS.prompt_len].astype(np.int64).tolist() for s in starts]
        res = gen.generate(prompts, method="ar", max_new_tokens=FLAGS.gen_tokens, ignore_eos=True)
        rows += [p + t[: FLAGS.gen_tokens] for p, t in zip(prompts, res.tokens, strict=True)]
        logging.info("generated %d sequences", len(rows))
    return np.asarray(rows[: FLAGS.num_prompts], np.int32)


def main(argv: Sequence[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors import safe_open

    from ddtree_jax import training
    from ddtree_jax.api import Generator
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.dflash_checkpoint import load_drafter, save_drafter
    from experiments.common import metadata

    rng = np.random.default_rng(FLAGS.seed)
    t_start = time.perf_counter()
    seqs = generate_sequences(Generator.load(FLAGS.target), rng, np.load(Path(FLAGS.data_dir) / "train_tokens.npy"))
    logging.info("data: %s tokens in %.0fs", seqs.shape, time.perf_counter() - t_start)
    trainer = training.DrafterTrainer(
        load_drafter(FLAGS.drafter, dtype=jnp.float32),
        load_target(FLAGS.target, dtype=jnp.bfloat16, quantized=False),
        training.adamw(FLAGS.lr, 0.0),
        anchors=FLAGS.anchors,
        gamma=FLAGS.gamma,
        distill=FLAGS.distill,
        anchor_lo=FLAGS.prompt_len - 1,  # the last prompt token: every label is a greedy target token
    )
    key = jax.random.key(FLAGS.seed)
    curve, t0, n = [], time.perf_counter(), 0
    while n < FLAGS.steps:
        elapsed = time.perf_counter() - t0
        progress = max(n / FLAGS.steps, elapsed / FLAGS.max_seconds)
        if progress >= 1.0:
            break
        lr = training.lr_at(progress, FLAGS.lr)
        key, sub = jax.random.split(key)
        loss, acc = trainer.step(seqs[rng.integers(0, len(seqs), size=FLAGS.batch)], sub, lr)
        n += 1
        if n == 1:  # the budget counts from the first compiled step
            t0 = time.perf_counter()
        if n % 50 == 0 or n == 1:
            curve.append({"step": n, "seconds": elapsed, "lr": lr, "loss": loss, "top1_agree_pos1": acc})
            logging.info("step %d  %.0fs  loss %.4f  pos-1 agreement %.3f", n, elapsed, loss, acc)
    run = {
        "base_drafter": str(FLAGS.drafter),
        "sequences": list(seqs.shape),
        "steps": n,
        "train_seconds": time.perf_counter() - t0,
        "flags": {
            k: FLAGS[k].value
            for k in ("num_prompts", "prompt_len", "gen_tokens", "batch", "anchors", "lr", "distill", "gamma")
        },
    }
    with safe_open(str(Path(FLAGS.drafter) / "model.safetensors"), "numpy") as f:
        base_meta = {k: v for k, v in (f.metadata() or {}).items() if k != "format"}
    save_drafter(trainer.export(), FLAGS.out_dir, metadata={**base_meta, "selfdistill": json.dumps(run)})
    out = Path(FLAGS.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": metadata(), "run": run, "curve": curve}
    (out / "train_dflash_selfdistill_loss.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    app.run(main)
