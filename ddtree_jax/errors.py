"""User-facing failures: one line on stderr, exit code 2, no traceback (set DDTREE_DEBUG=1 to see one); `run_app`,
the absl runner every CLI of the project goes through."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from absl import app, flags

from ddtree_jax.config import ConfigError

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user (flags, files); the message is one line and names the problem."""


class NumericsError(RuntimeError):
    """The model produced NaN/inf logits; the message names the round and row. Exit code 3."""


EXIT_NUMERICS = 3


def _user_error_types() -> tuple[type[Exception], ...]:
    # A CheckpointError can only come from an imported checkpoint module; importing it here (jax, orbax)
    # just to catch nothing would slow every early error down.
    checkpoint = sys.modules.get("ddtree_jax.checkpoint")
    extra = getattr(checkpoint, "CheckpointError", None)
    return (UserError, ConfigError) if extra is None else (UserError, ConfigError, extra)


def fail(message: object, code: int = EXIT_USER_ERROR) -> NoReturn:
    """Print `error: <message>` as one line on stderr and exit with `code` (2: bad input)."""
    one_line = " ".join(str(message).split("\n")).strip() or "unknown error"
    print(f"error: {one_line}", file=sys.stderr, flush=True)
    sys.exit(code)


def _debug() -> bool:
    return os.environ.get("DDTREE_DEBUG") == "1"


def cli_main(fn: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    """Wrap an absl main so user errors (UserError, ConfigError, CheckpointError) become `fail(...)`."""

    @functools.wraps(fn)
    def wrapper(argv: list[str]) -> Any:
        try:
            return fn(argv)
        except _user_error_types() as e:
            if _debug():
                raise
            fail(e)
        except NumericsError as e:
            if _debug():
                raise
            fail(e, EXIT_NUMERICS)

    return wrapper


def parse_flags(argv: list[str]) -> list[str]:
    """absl `flags_parser` for `app.run`: a bad flag is a one-line error and exit 2, like any user error."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        if _debug():
            raise
        fail(e)


def _help_for_main_module(main: Callable[[list[str]], Any]) -> None:
    """Make `--help` describe `main`'s module when it is not `__main__` (a console script such as
    `ddtree-generate`): absl's short help lists only the key flags of the module named `sys.argv[0]`, and shows
    `__main__`'s docstring, and a console script's `__main__` is a generated shim with neither."""
    module = sys.modules[main.__module__]
    if module.__name__ == "__main__":
        return
    for flag in flags.FLAGS.get_flags_for_module(module.__name__):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    shim = sys.modules["__main__"]
    if not shim.__doc__:
        shim.__doc__ = module.__doc__


class _DropBackendProbe(logging.Filter):
    """Drops JAX's `Unable to initialize backend 'tpu'` (INFO): a probe for absent hardware, not a problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and record.getMessage().startswith("Unable to initialize backend"))


def _quiet_backend_probes() -> None:
    """Keep JAX's start-up probes for backends the machine lacks off stderr (kept with DDTREE_DEBUG=1)."""
    if not _debug():
        logging.getLogger("jax._src.xla_bridge").addFilter(_DropBackendProbe())


def run_app(main: Callable[[list[str]], Any]) -> None:
    """`app.run` for every CLI of the project: user errors and unparsable flags become one `error:` line, exit 2;
    `--help` lists `main`'s module's flags, and JAX's probes for absent backends stay off stderr."""
    _help_for_main_module(main)
    _quiet_backend_probes()
    app.run(cli_main(main), flags_parser=parse_flags)
