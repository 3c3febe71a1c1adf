"""Convert an HF Kimi K2 checkpoint to an orbax checkpoint of the converted NNX state.

    python -m checkpoints.convert --target=HF_DIR --output=ORBAX_DIR

Restore with `ddtree_jax.checkpoint.restore_converted(ORBAX_DIR, load_kimi_config(HF_DIR))`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
from absl import flags, logging

from ddtree_jax.checkpoint import load_target, save_converted
from ddtree_jax.errors import UserError, run_app

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "HF checkpoint directory (config.json + safetensors).")
flags.DEFINE_string("output", None, "Orbax checkpoint directory to create (must not exist).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Dtype of the floating-point params.")
flags.mark_flags_as_required(["target", "output"])


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    if Path(FLAGS.output).exists():
        raise UserError(f"--output {FLAGS.output} already exists")
    model = load_target(FLAGS.target, dtype=jnp.dtype(FLAGS.dtype))
    save_converted(model, FLAGS.output)
    logging.info("wrote %s", FLAGS.output)


if __name__ == "__main__":
    run_app(main)
