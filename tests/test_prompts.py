"""Prompt-file validation, length checks and the atomic, ordered, resumable output writer."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from ddtree_jax.errors import UserError
from ddtree_jax.prompts import OutputWriter, Prompt, check_lengths, read_prompts
from ddtree_jax.tokenizer import Message, Tokenizer, check_messages

VOCAB = 300


class ByteTokenizer(Tokenizer):
    """ids = UTF-8 bytes; a chat message is 256, its role's first letter, its content, 257."""

    vocab_size = VOCAB
    stop_ids = (257,)
    has_chat_format = True

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode()

    def encode_messages(self, messages: Sequence[Message]) -> list[int]:
        return [i for m in check_messages(messages) for i in (256, *self.encode(m["role"][0] + m["content"]), 257)]


class PlainByteTokenizer(ByteTokenizer):
    has_chat_format = False


def write(tmp_path: Path, content: str | bytes) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    return p


def lines(*recs: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


def read(tmp_path: Path, content: str | bytes, vocab: int = VOCAB, tokenizer: Tokenizer | None = None):
    return read_prompts(write(tmp_path, content), tokenizer or ByteTokenizer(), vocab)


def test_reads_text_and_ids_skipping_blank_lines(tmp_path: Path) -> None:
    content = lines({"id": "a", "prompt": "hi"}) + "\n  \n" + lines({"id": 7, "prompt_ids": [1, 2]})
    got = read(tmp_path, content)
    assert got == [Prompt("a", (104, 105), "hi"), Prompt(7, (1, 2), None)]


def test_chat_wraps_text_prompts_only(tmp_path: Path) -> None:
    p = write(tmp_path, lines({"id": "a", "prompt": "hi"}, {"id": "b", "prompt_ids": [5]}))
    got = read_prompts(p, ByteTokenizer(), VOCAB, chat=True)
    assert [g.token_ids for g in got] == [(256, ord("u"), 104, 105, 257), (5,)]


def test_messages_rows_use_the_chat_format(tmp_path: Path) -> None:
    convo = [{"role": "system", "content": "b"}, {"role": "user", "content": "hi"}]
    content = lines({"id": "m", "messages": convo}, {"id": "t", "prompt": "hi"})
    got = read(tmp_path, content)  # without chat=True: messages rows are chat either way, text rows are not
    sys_ids, user_ids = (256, ord("s"), ord("b"), 257), (256, ord("u"), 104, 105, 257)
    assert got == [Prompt("m", sys_ids + user_ids, None), Prompt("t", (104, 105), "hi")]


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("hello", "'messages' must be a non-empty list of {role, content} objects, got a str"),
        ([], "'messages' must be a non-empty list of {role, content} objects, got an empty list"),
        (["hello"], "message 1 is a str, not a {role, content} object"),
        ([{"content": "x"}], "message 1: 'role' must be one of system, user, assistant, got None"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}], "message 2: 'role' must be one of"),
        ([{"role": "user"}], "message 1 (user): 'content' must be a string"),
        ([{"role": "user", "content": [{"type": "text"}]}], "message 1 (user): 'content' must be a string"),
        ([{"role": "user", "content": "x", "name": "n"}], "message 1 (user): cannot render keys name"),
    ],
)
def test_bad_messages_name_the_line(tmp_path: Path, messages: object, problem: str) -> None:
    content = lines({"id": "ok", "prompt": "a"}, {"id": "m", "messages": messages})
    with pytest.raises(UserError) as e:
        read(tmp_path, content)
    assert f"prompts.jsonl:2: prompt 'm': {problem}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("rec", "chat", "what"),
    [
        ({"id": "m", "messages": [{"role": "user", "content": "x"}]}, False, "prompt 'm' has 'messages'"),
        ({"id": "t", "prompt": "x"}, True, "prompt 't' is text for --chat"),
    ],
)
def test_chat_needs_a_chat_format(tmp_path: Path, rec: dict, chat: bool, what: str) -> None:
    path = write(tmp_path, lines(rec))
    with pytest.raises(UserError, match=rf":1: {what}, but the checkpoint's tokenizer has no chat format"):
        read_prompts(path, PlainByteTokenizer(), VOCAB, chat=chat)
    with pytest.raises(UserError, match=rf":1: {what}, but the checkpoint has no tokenizer"):
        read_prompts(path, None, VOCAB, chat=chat)


def test_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"missing.jsonl: prompts file not found"):
        read_prompts(tmp_path / "missing.jsonl", ByteTokenizer(), VOCAB)


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    with pytest.raises(UserError, match=r"prompts.jsonl: no prompts"):
        read(tmp_path, content)


def test_line_not_json(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"prompts.jsonl:2: not JSON"):
        read(tmp_path, lines({"id": 1, "prompt": "a"}) + "{oops\n")


def test_line_not_an_object(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"prompts.jsonl:1: expected a JSON object, got list"):
        read(tmp_path, "[1, 2]\n")


def test_missing_id(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"prompts.jsonl:1: missing 'id'"):
        read(tmp_path, lines({"prompt": "a"}))


@pytest.mark.parametrize(
    "rec",
    [
        {"id": 1},
        {"id": 1, "prompt": "a", "prompt_ids": [1]},
        {"id": 1, "prompt": "a", "messages": [{"role": "user", "content": "a"}]},
    ],
)
def test_not_exactly_one_prompt_field(tmp_path: Path, rec: dict) -> None:
    with pytest.raises(UserError, match=r":1: prompt 1 needs exactly one of 'prompt', 'prompt_ids' and 'messages'"):
        read(tmp_path, lines(rec))


@pytest.mark.parametrize("ids", [[1, "2"], [1.0], [True], "12"])
def test_prompt_ids_not_ints(tmp_path: Path, ids: object) -> None:
    with pytest.raises(UserError, match=r":1: prompt 'x': 'prompt_ids' must be a list of integers"):
        read(tmp_path, lines({"id": "x", "prompt_ids": ids}))


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 5])
def test_prompt_ids_outside_vocab(tmp_path: Path, bad: int) -> None:
    with pytest.raises(UserError, match=rf":1: prompt 'x': token id {bad} outside the vocabulary \[0, 300\)"):
        read(tmp_path, lines({"id": "x", "prompt_ids": [3, bad]}))


def test_text_tokens_outside_vocab(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"token id 104 outside the vocabulary \[0, 100\)"):
        read(tmp_path, lines({"id": "x", "prompt": "h"}), vocab=100)


def test_non_utf8(tmp_path: Path) -> None:
    content = lines({"id": 1, "prompt": "ok"}).encode() + b'{"id": 2, "prompt": "caf\xe9"}\n'
    with pytest.raises(UserError, match=r"prompts.jsonl:2: not valid UTF-8"):
        read(tmp_path, content)


def test_duplicate_ids(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"prompts.jsonl:3: duplicate id 'a' \(first on line 1\)"):
        read(
            tmp_path,
            lines({"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}),
        )


@pytest.mark.parametrize("rec", [{"id": "e", "prompt": ""}, {"id": "e", "prompt_ids": []}])
def test_empty_prompt(tmp_path: Path, rec: dict) -> None:
    with pytest.raises(UserError, match=r":1: prompt 'e' is empty"):
        read(tmp_path, lines(rec))


def test_text_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r":1: prompt 'x' is text, but the checkpoint has no tokenizer"):
        read_prompts(write(tmp_path, lines({"id": "x", "prompt": "hi"})), None, VOCAB)


def test_check_lengths() -> None:
    prompts = [Prompt("short", (1,) * 10, None), Prompt("long", (1,) * 20, None)]
    check_lengths(prompts[:1], max_new_tokens=5, context_limit=20, extra=5)  # 10 + 5 + 5 fits exactly
    with pytest.raises(UserError, match=r"prompt 'long': 20 prompt tokens \+ 5 new tokens \+ 1 draft slots = 26 "):
        check_lengths(prompts, max_new_tokens=5, context_limit=25, extra=1)


# ---- output writer ---------------------------------------------------------------------------------------


def rec(pid: str) -> dict:
    return {"id": pid, "token_ids": [1, 2], "text": None}


def ids_in(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_writer_keeps_input_order_across_batches(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, order=["a", "b", "c", "d"], resume=False)
    w.write_batch([rec("c"), rec("d")])
    assert ids_in(out) == ["c", "d"]
    w.write_batch([rec("b"), rec("a")])
    assert ids_in(out) == ["a", "b", "c", "d"]


def test_writer_crash_mid_batch_keeps_previous_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, order=["a", "b"], resume=False)
    w.write_batch([rec("a")])
    first = out.read_bytes()

    def crash(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        w.write_batch([rec("b")])
    assert out.read_bytes() == first
    assert ids_in(out) == ["a"]
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]  # no temp file left behind


def test_writer_without_resume_replaces_old_output_at_first_batch(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(rec("old")) + "\n")
    w = OutputWriter(out, order=["a"], resume=False)
    assert w.done_ids() == set()
    assert ids_in(out) == ["old"]  # untouched until a batch finishes
    w.write_batch([rec("a")])
    assert ids_in(out) == ["a"]


def test_writer_resume(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    first = OutputWriter(out, order=["a", "b", "c"], resume=False)
    first.write_batch([rec("b")])
    again = OutputWriter(out, order=["a", "b", "c"], resume=True)
    assert again.done_ids() == {"b"}
    again.write_batch([rec("a"), rec("c")])
    assert ids_in(out) == ["a", "b", "c"]


def test_writer_resume_without_output_starts_empty(tmp_path: Path) -> None:
    assert OutputWriter(tmp_path / "none.jsonl", order=["a"], resume=True).done_ids() == set()


CORRUPT = ['{"id": "a"}\n{"id": "b", "tok\n', '{"id": "a"}\n[1]\n', b'{"id": "\xff"}\n']


@pytest.mark.parametrize("content", CORRUPT)
def test_writer_resume_from_corrupt_output(tmp_path: Path, content: str | bytes) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(content.encode() if isinstance(content, str) else content)
    line = 1 if isinstance(content, bytes) else 2
    with pytest.raises(UserError, match=rf"out.jsonl:{line}: existing output is corrupt"):
        OutputWriter(out, order=["a"], resume=True)
