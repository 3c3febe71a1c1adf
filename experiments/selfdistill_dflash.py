"""Fine-tune a trained DFlash drafter on its target's own greedy continuations (self-distillation).

    python -m experiments.selfdistill_dflash [--num_prompts=4096 --gen_tokens=128 --max_seconds=300]

Acceptance at temperature 0 asks the drafter to predict the target's greedy tokens, so this stage builds data that
is exactly that: random windows of the training stream (--prompt_len tokens) continued greedily by the shipped
(INT4) target for --gen_tokens. The drafter then trains with the standard recipe (`trainers.DrafterTrainer`: target
features computed in the step, position-decayed cross-entropy against a mix of the greedy token and the target's
distribution, --distill) on anchors inside the generated part only. --val_prompts generated sequences are held
out of training; every --eval_every steps the drafter is scored on them (loss and position-1 agreement with the
target, fixed anchors) and the best-scoring weights are the ones written: 1M generated tokens overfit within a few
minutes on an H200 (training agreement 0.94, held-out prompts 0.73), so the stopping point is measured, not
guessed. --grow_layers / --grow_intermediate first enlarge the drafter without changing what it computes
(`trainers.grow_drafter`). --sequences keeps the generated data in a .npy file (read when it exists), so runs
that differ only in the drafter share one generation. Sized for a GPU; a few hundred steps run on a CPU.
Overwrites --out_dir (the drafter, z-lab format) and writes --results_dir/train_dflash_selfdistill_loss.json.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import flags, logging

from ddtree_jax.errors import UserError, run_app

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
flags.DEFINE_float("gen_seconds", 600.0, "Stop generating new batches after this many seconds (logged).")
flags.DEFINE_integer("val_prompts", 64, "Generated sequences held out for validation (taken first).")
flags.DEFINE_integer("eval_every", 250, "Steps between validations.")
flags.DEFINE_integer("batch", 8, "Sequences per step.")
flags.DEFINE_integer("anchors", 24, "Anchors per sequence (inside the generated part).")
flags.DEFINE_integer("steps", 2000, "Maximum steps.")
flags.DEFINE_float("max_seconds", 900.0, "Wall-clock budget of the training loop.")
flags.DEFINE_float("lr", 5e-4, "Peak learning rate.")
flags.DEFINE_float("weight_decay", 0.0, "AdamW weight decay.")
flags.DEFINE_float("gamma", 4.0, "Position decay of the loss weights.")
flags.DEFINE_float("distill", 0.5, "Weight of the target's distribution in the label (rest: the greedy token).")
flags.DEFINE_integer("seed", 0, "Data and anchor seed.")
flags.DEFINE_integer("grow_layers", 0, "Grow the drafter to this many layers first (0: keep).")
flags.DEFINE_integer("grow_intermediate", 0, "Widen the drafter's MLPs to this first (0: keep).")
flags.DEFINE_string(
    "sequences", "", ".npy of generated sequences, held-out rows first: read if present (as is), else written."
)


def generate_sequences(gen, rng: np.random.Generator, tokens: np.ndarray, count: int) -> np.ndarray:
    """`[n, prompt_len + gen_tokens]` int32, n <= count (fewer when --gen_seconds runs out; logged):
    training-stream windows + the target's greedy tokens."""
    rows, t0 = [], time.perf_counter()
    while len(rows) < count:
        if time.perf_counter() - t0 > FLAGS.gen_seconds:
            logging.warning("--gen_seconds reached: %d of %d sequences generated", len(rows), count)
            break
        starts = rng.integers(0, len(tokens) - FLAGS.prompt_len, size=FLAGS.gen_batch)
        prompts = [tokens[s : s + FLAGS.prompt_len].astype(np.int64).tolist() for s in starts]
        res = gen.generate(prompts, method="ar", max_new_tokens=FLAGS.gen_tokens, ignore_eos=True)
        rows += [p + t[: FLAGS.gen_tokens] for p, t in zip(prompts, res.tokens, strict=True)]
        logging.info("generated %d sequences in %.0fs", len(rows), time.perf_counter() - t0)
    return np.asarray(rows[:count], np.int32)


def validate(trainer, val: np.ndarray, key) -> tuple[float, float]:
    """Mean (loss, position-1 agreement) over the held-out sequences, in --batch chunks at fixed anchors."""
    import jax

    n = len(val) // FLAGS.batch * FLAGS.batch
    scores = [trainer.evaluate(val[i : i + FLAGS.batch], jax.random.fold_in(key, i)) for i in range(0, n, FLAGS.batch)]
    return tuple(float(np.mean(x)) for x in zip(*scores, strict=True))


def main(argv: Sequence[str]) -> None:
    del argv
    import jax
    import jax.numpy as jnp

    from ddtree_jax.api import Generator
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.dflash_checkpoint import drafter_lineage, load_drafter, save_drafter
    from ddtree_jax.training import trainers
    from experiments.common import metadata

    rng = np.random.default_rng(FLAGS.seed)
    t_start = time.perf_counter()
    if FLAGS.val_prompts < FLAGS.batch:
        raise UserError(f"--val_prompts ({FLAGS.val_prompts}) must be at least --batch ({FLAGS.batch})")
    cached = Path(FLAGS.sequences) if FLAGS.sequences else None
    if cached is not None and cached.exists():
        seqs = np.load(cached)
        if seqs.ndim != 2 or seqs.shape[1] != FLAGS.prompt_len + FLAGS.gen_tokens or len(seqs) <= FLAGS.val_prompts:
            raise UserError(f"--sequences {cached}: shape {seqs.shape} does not fit the length/val flags")
        logging.info("data: %s read from %s", seqs.shape, cached)
    else:
        seqs = generate_sequences(
            Generator.load(FLAGS.target),
            rng,
            np.load(Path(FLAGS.data_dir) / "train_tokens.npy"),
            FLAGS.val_prompts + FLAGS.num_prompts,
        )
        if cached is not None:
            np.save(cached, seqs)
    val, seqs = seqs[: FLAGS.val_prompts], seqs[FLAGS.val_prompts :]
    logging.info("data: %s train, %s held out, in %.0fs", seqs.shape, val.shape, time.perf_counter() - t_start)
    drafter = load_drafter(FLAGS.drafter, dtype=jnp.float32)
    if FLAGS.grow_layers or FLAGS.grow_intermediate:
        c = drafter.config
        drafter = trainers.grow_drafter(
            drafter, FLAGS.grow_layers or c.num_hidden_layers, FLAGS.grow_intermediate or c.intermediate_size
        )
        logging.info("grown to %d layers x %d", drafter.config.num_hidden_layers, drafter.config.intermediate_size)
    trainer = trainers.DrafterTrainer(
        drafter,
        load_target(FLAGS.target, dtype=jnp.bfloat16, quantized=False),
        trainers.adamw(FLAGS.lr, FLAGS.weight_decay),
        anchors=FLAGS.anchors,
        gamma=FLAGS.gamma,
        distill=FLAGS.distill,
        anchor_lo=FLAGS.prompt_len - 1,  # the last prompt token: every label is a greedy target token
    )
    key, val_key = jax.random.split(jax.random.key(FLAGS.seed))
    best = {"step": 0, "val_agree_pos1": validate(trainer, val, val_key)[1]}
    best_params = trainer.snapshot()
    logging.info("held-out position-1 agreement of the starting drafter %.3f", best["val_agree_pos1"])
    curve, val_curve, t0, n = [], [], time.perf_counter(), 0  # after the first validation: warm-up starts at 0
    while n < FLAGS.steps:
        elapsed = time.perf_counter() - t0
        progress = max(n / FLAGS.steps, elapsed / FLAGS.max_seconds)
        if progress >= 1.0:
            break
        lr = trainers.lr_at(progress, FLAGS.lr)
        key, sub = jax.random.split(key)
        loss, acc = trainer.step(seqs[rng.integers(0, len(seqs), size=FLAGS.batch)], sub, lr)
        n += 1
        if n == 1:  # the budget counts from the first compiled step
            t0 = time.perf_counter()
        if n % 50 == 0 or n == 1:
            curve.append({"step": n, "seconds": elapsed, "lr": lr, "loss": loss, "top1_agree_pos1": acc})
            logging.info("step %d  %.0fs  loss %.4f  pos-1 agreement %.3f", n, elapsed, loss, acc)
        if n % FLAGS.eval_every == 0:
            v_loss, v_acc = validate(trainer, val, val_key)
            val_curve.append({"step": n, "seconds": elapsed, "loss": v_loss, "top1_agree_pos1": v_acc})
            logging.info("step %d  held-out loss %.4f  pos-1 agreement %.3f", n, v_loss, v_acc)
            if v_acc > best["val_agree_pos1"]:
                best, best_params = {"step": n, "val_agree_pos1": v_acc}, trainer.snapshot()
    logging.info("writing the weights of step %d (held-out agreement %.3f)", best["step"], best["val_agree_pos1"])
    run = {
        "base_drafter": str(FLAGS.drafter),
        "sequences": list(seqs.shape),
        "sequences_file": FLAGS.sequences,
        "held_out_sequences": len(val),
        "steps": n,
        "best": best,
        "train_seconds": time.perf_counter() - t0,
        "flags": {
            k: FLAGS[k].value
            for k in ("num_prompts", "val_prompts", "prompt_len", "gen_tokens", "batch", "anchors", "lr", "distill")
            + ("gamma", "weight_decay", "grow_layers", "grow_intermediate")
        },
    }
    lineage = drafter_lineage(FLAGS.drafter)
    save_drafter(trainer.export(best_params), FLAGS.out_dir, metadata={**lineage, "selfdistill": json.dumps(run)})
    out = Path(FLAGS.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": metadata(), "run": run, "curve": curve, "val_curve": val_curve}
    (out / "train_dflash_selfdistill_loss.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    run_app(main)
