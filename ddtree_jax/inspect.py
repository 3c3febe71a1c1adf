"""`ddtree-inspect --target=DIR`: model sizes from a checkpoint's config.json alone, printed as JSON.

Keys: total_params, active_params_per_token, weight_bytes, kv_cache_bytes_per_token, decode_bytes_per_token,
decode_fixed_bytes, expert_bytes (see `ddtree_jax.sizing.model_sizes`). No weight file is opened.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from absl import app, flags

from ddtree_jax.config import load_kimi_config
from ddtree_jax.errors import UserError, cli_main, parse_flags
from ddtree_jax.sizing import model_sizes

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "Target checkpoint directory (or its config.json).")
flags.mark_flag_as_required("target")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    print(json.dumps(model_sizes(load_kimi_config(FLAGS.target)), indent=2))


def run() -> None:
    app.run(cli_main(main), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
