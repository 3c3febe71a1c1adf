"""`--help` of the console scripts (`ddtree-generate`, `ddtree-calibrate`, `ddtree-inspect`: `run()` called from a
generated `__main__`) lists each script's own flags and its docstring."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("module", "flag_names"),
    [
        (
            "ddtree_jax.generate",
            ["target", "drafter", "method", "budget", "temperature", "max_new_tokens", "prompts", "output"]
            + ["batch_size", "dtype", "ignore_eos", "seed", "resume", "overwrite", "chat", "mesh"],
        ),
        (
            "ddtree_jax.calibrate",
            ["target", "drafter", "prompts", "output", "candidates", "batches", "contexts", "max_new_tokens"]
            + ["repeats", "dtype", "mesh", "compile_workers", "overwrite"],
        ),
        (
            "ddtree_jax.inspect",
            ["target", "drafter", "batch_size", "max_len", "prompt_len", "method", "budget", "mesh", "device_gb"],
        ),
    ],
)
def test_console_script_help_lists_its_flags(module: str, flag_names: list[str]) -> None:
    # The console-script case: `run` is imported into a `__main__` that defines no flags and has no docstring.
    proc = subprocess.run(
        [sys.executable, "-c", f"from {module} import run; run()", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    shown = proc.stdout + proc.stderr
    for name in flag_names:
        assert f"  --{name}:" in shown or f"  --[no]{name}:" in shown, (name, shown)
    assert f"`ddtree-{module.split('.')[-1]}" in shown  # the module's docstring
