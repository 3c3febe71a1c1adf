"""User-facing failures: one line on stderr, exit code 2, no traceback (set DDTREE_DEBUG=1 to see one)."""

from __future__ import annotations

import functools
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


def run_app(main: Callable[[list[str]], Any]) -> None:
    """`app.run` for every CLI of the project: user errors and unparsable flags become one `error:` line, exit 2."""
    app.run(cli_main(main), flags_parser=parse_flags)
