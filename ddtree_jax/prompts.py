"""Prompt files in, result files out (JSON Lines), with every bad input a one-line `UserError`."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ddtree_jax.errors import UserError
from ddtree_jax.tokenizer import Tokenizer, check_messages

PromptId = str | int
PROMPT_KINDS = ("prompt", "prompt_ids", "messages")  # a prompt line has exactly one of these


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: PromptId
    token_ids: tuple[int, ...]
    text: str | None  # None for `prompt_ids` and `messages` input


def _is_id(v: Any) -> bool:
    return isinstance(v, str | int) and not isinstance(v, bool)


def read_prompts(path: str | Path, tokenizer: Tokenizer | None, vocab_size: int, chat: bool = False) -> list[Prompt]:
    """Read `{"id", "prompt": text}` / `{"id", "prompt_ids": [...]}` / `{"id", "messages": [{"role", "content"},
    ...]}` lines (the last in the OpenAI chat convention); blank lines are skipped.

    Text goes through `tokenizer` (its chat format when `chat`), messages always through its chat format; a
    tokenizer without one is an error, never a plain encode. Every id must lie in [0, vocab_size).
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{p}: prompts file not found") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read prompts file ({e.strerror})") from None
    prompts: list[Prompt] = []
    seen: dict[PromptId, int] = {}
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        where = f"{p}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not valid UTF-8 (byte {e.start})") from None
        if not line.strip():
            continue
        prompt = _parse_line(line, where, tokenizer, vocab_size, chat)
        if prompt.id in seen:
            raise UserError(f"{where}: duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        seen[prompt.id] = lineno
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"{p}: no prompts (the file is empty)")
    return prompts


def _parse_line(line: str, where: str, tokenizer: Tokenizer | None, vocab_size: int, chat: bool) -> Prompt:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "id" not in rec or not _is_id(rec["id"]):
        raise UserError(f"{where}: missing 'id' (a string or an integer)")
    pid = rec["id"]
    kinds = [k for k in PROMPT_KINDS if k in rec]
    if len(kinds) != 1:
        raise UserError(f"{where}: prompt {pid!r} needs exactly one of 'prompt', 'prompt_ids' and 'messages'")
    text = None
    if kinds == ["prompt_ids"]:
        ids = rec["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UserError(f"{where}: prompt {pid!r}: 'prompt_ids' must be a list of integers")
    elif kinds == ["messages"]:
        try:
            messages = check_messages(rec["messages"])
        except UserError as e:
            raise UserError(f"{where}: prompt {pid!r}: {e}") from None
        _check_chat_format(tokenizer, where, f"prompt {pid!r} has 'messages'")
        ids = tokenizer.encode_messages(messages)
    else:
        text = rec["prompt"]
        if not isinstance(text, str):
            raise UserError(f"{where}: prompt {pid!r}: 'prompt' must be a string")
        if not text:
            ids = []
        elif chat:
            _check_chat_format(tokenizer, where, f"prompt {pid!r} is text for --chat")
            ids = tokenizer.encode_chat(text)
        elif tokenizer is None:
            raise UserError(f"{where}: prompt {pid!r} is text, but the checkpoint has no tokenizer")
        else:
            ids = tokenizer.encode(text)
    if not ids:
        raise UserError(f"{where}: prompt {pid!r} is empty")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise UserError(f"{where}: prompt {pid!r}: token id {bad} outside the vocabulary [0, {vocab_size})")
    return Prompt(pid, tuple(ids), text)


def _check_chat_format(tokenizer: Tokenizer | None, where: str, what: str) -> None:
    if tokenizer is None:
        raise UserError(f"{where}: {what}, but the checkpoint has no tokenizer")
    if not tokenizer.has_chat_format:
        raise UserError(f"{where}: {what}, but the checkpoint's tokenizer has no chat format")


def check_lengths(prompts: Iterable[Prompt], max_new_tokens: int, context_limit: int, extra: int = 0) -> None:
    """Every prompt + max_new_tokens + extra (the engine's look-ahead slots) must fit the context limit."""
    for p in prompts:
        need = len(p.token_ids) + max_new_tokens + extra
        if need > context_limit:
            raise UserError(
                f"prompt {p.id!r}: {len(p.token_ids)} prompt tokens + {max_new_tokens} new tokens"
                + (f" + {extra} draft slots" if extra else "")
                + f" = {need} exceeds the context limit {context_limit}"
            )


class OutputWriter:
    """JSON Lines results, rewritten atomically (temp file, fsync, rename) after each batch.

    `order` lists the input ids: the file is always sorted in that order (ids not in it go last, in the order
    they were written). With `resume` the existing file's records are kept and `done_ids()` reports them;
    without it the existing file is replaced at the first `write_batch`, never partially.
    """

    def __init__(self, path: str | Path, order: Sequence[PromptId], resume: bool):
        self.path = Path(path)
        self._rank = {pid: i for i, pid in enumerate(order)}
        self._records: dict[PromptId, dict[str, Any]] = self._read_existing() if resume else {}

    def _read_existing(self) -> dict[PromptId, dict[str, Any]]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        records: dict[PromptId, dict[str, Any]] = {}
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                rec = None
            if not isinstance(rec, dict) or not _is_id(rec.get("id")):
                raise UserError(f"{self.path}:{lineno}: existing output is corrupt (cannot resume from it)")
            records[rec["id"]] = rec
        return records

    def done_ids(self) -> set[PromptId]:
        return set(self._records)

    def write_batch(self, records: Iterable[dict[str, Any]]) -> None:
        """Add (or replace, by id) `records` and atomically rewrite the whole file."""
        for rec in records:
            self._records[rec["id"]] = rec
        last = len(self._rank)
        ordered = sorted(self._records.values(), key=lambda r: self._rank.get(r["id"], last))
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered)
        atomic_write(self.path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` at once: a temp file beside it, fsynced, renamed over it (no partial file)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
