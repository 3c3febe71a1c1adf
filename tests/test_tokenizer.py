"""Tokenizer backends on tiny files written in the real formats."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from ddtree_jax.errors import UserError
from ddtree_jax.tokenizer import KimiTokenizer, TokenizerError, load_tokenizer, read_pat_str

MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", "文a".encode()]
N_RANKS = 256 + len(MERGES)
TEXTS = ["hello world", "Hello, World! 12345", "中文English混合\n\n  tabs\tand  spaces ", "naïve café ☕", ""]


def write_tiktoken(d: Path) -> Path:
    tokens = [bytes([b]) for b in range(256)] + MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture
def kimi(tmp_path: Path) -> KimiTokenizer:
    tok = load_tokenizer(write_tiktoken(tmp_path))
    assert isinstance(tok, KimiTokenizer)
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_kimi_round_trip(kimi: KimiTokenizer, text: str) -> None:
    ids = kimi.encode(text)
    assert all(0 <= i < N_RANKS for i in ids)
    assert kimi.decode(ids) == text


def test_kimi_uses_merges(kimi: KimiTokenizer) -> None:
    assert kimi.encode("hello world") == [256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")]


def test_kimi_pattern_splits_han_from_latin(kimi: KimiTokenizer) -> None:
    # "文a" has a rank, but the built-in pattern puts Han and Latin in different pieces.
    assert 256 + MERGES.index("文a".encode()) not in kimi.encode("文a")


def test_pat_str_from_checkpoint_file(tmp_path: Path) -> None:
    write_tiktoken(tmp_path)
    (tmp_path / "tokenization_kimi.py").write_text(
        'import os\nclass T:\n    pat_str = "|".join(\n'
        '        [r"""\\p{L}+""", r"""\\s+""", r"""[^\\s\\p{L}]+"""]\n    )\n'
    )
    assert read_pat_str(tmp_path / "tokenization_kimi.py") == r"\p{L}+|\s+|[^\s\p{L}]+"
    assert load_tokenizer(tmp_path).encode("文a") == [256 + MERGES.index("文a".encode())]


def test_pat_str_not_literal_is_an_error(tmp_path: Path) -> None:
    write_tiktoken(tmp_path)
    (tmp_path / "tokenization_kimi.py").write_text("pat_str = make_pattern()\n")
    with pytest.raises(TokenizerError, match=r"tokenization_kimi.py:1: pat_str is not a literal"):
        load_tokenizer(tmp_path)


def test_kimi_special_ids(kimi: KimiTokenizer) -> None:
    n = N_RANKS
    assert kimi.vocab_size == n + 256
    expected = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4}
    expected |= {"<|im_system|>": 10, "<|im_middle|>": 17, "<think>": 22, "[UNK]": 254, "[PAD]": 255}
    for name, k in expected.items():
        assert kimi.specials[name] == n + k
        assert kimi.encode(name) == [n + k]
    assert kimi.specials[f"<|reserved_token_{n + 5}|>"] == n + 5
    assert kimi.stop_ids == (n + 1, n + 2)
    assert kimi.decode([n + 2]) == "<|im_end|>"


def test_kimi_special_names_from_tokenizer_config(tmp_path: Path) -> None:
    n = N_RANKS
    write_tiktoken(tmp_path)
    added = {str(n + k): {"content": name} for k, name in enumerate(["[BOS]", "[EOS]", "<|im_end|>"])}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("[EOS]") == [n + 1]
    assert n + 22 not in tok.encode("<think>")  # not a special here, as in K2-Thinking
    assert tok.decode(tok.encode("<think>")) == "<think>"


def test_kimi_chat_format(kimi: KimiTokenizer) -> None:
    n, enc = N_RANKS, kimi.encode
    user = [n + 3, *enc("user"), n + 17, *enc("hello"), n + 2, n + 4, *enc("assistant"), n + 17]
    assert kimi.encode_chat("hello") == user
    system = [n + 10, *enc("system"), n + 17, *enc("be brief"), n + 2]
    assert kimi.encode_chat("hello", system="be brief") == system + user


def test_kimi_messages(kimi: KimiTokenizer) -> None:
    n, enc = N_RANKS, kimi.encode
    convo = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "hello"},
    ]
    system = [n + 10, *enc("system"), n + 17, *enc("be brief"), n + 2]
    user = [n + 3, *enc("user"), n + 17, *enc("hello"), n + 2]
    assistant = [n + 4, *enc("assistant"), n + 17, *enc("world"), n + 2]
    reply = [n + 4, *enc("assistant"), n + 17]
    assert kimi.has_chat_format
    assert kimi.encode_messages(convo) == system + user + assistant + user + reply
    with pytest.raises(UserError, match=r"^message 1: 'role' must be one of system, user, assistant, got 'tool'$"):
        kimi.encode_messages([{"role": "tool", "content": "x"}])


def test_no_tokenizer_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer \(neither tiktoken.model nor tokenizer.json\)"):
        load_tokenizer(tmp_path)


def test_bad_rank_line_names_file_and_line(tmp_path: Path) -> None:
    write_tiktoken(tmp_path)
    with open(tmp_path / "tiktoken.model", "a") as f:
        f.write("not-base64!! 999\n")
    with pytest.raises(TokenizerError, match=rf"tiktoken.model:{N_RANKS + 1}: expected"):
        load_tokenizer(tmp_path)


def test_hf_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["hello world", "hello there", "the world is round"] * 10, trainer=trainer)
    raw.save(str(tmp_path / "tokenizer.json"))

    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tok.stop_ids == (raw.token_to_id("</s>"),)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("hello world")) < len("hello world")
    assert not tok.has_chat_format
    with pytest.raises(TokenizerError, match=r"tokenizer.json: this tokenizer has no chat format"):
        tok.encode_chat("hello world")  # never a plain encode in disguise
