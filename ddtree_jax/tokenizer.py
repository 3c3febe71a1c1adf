"""Checkpoint tokenizers: Kimi's `tiktoken.model` (kimi_k2.md §7) or a Hugging Face `tokenizer.json`."""

from __future__ import annotations

import abc
import ast
import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from ddtree_jax.errors import UserError

NUM_RESERVED_SPECIALS = 256

# `TikTokenTokenizer.pat_str` from Kimi's tokenization_kimi.py, used when the checkpoint ships no such file.
# `&&` is class intersection: tiktoken's regex engine handles it, Python's `re` does not.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Named specials by offset from len(ranks) (kimi_k2.md §7: 163584 + offset in K2); the rest are reserved.
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
KIMI_STOP_NAMES = ("[EOS]", "<|im_end|>")
_HF_STOP_NAMES = ("[EOS]", "<|im_end|>", "</s>", "<|endoftext|>", "<eos>")


class TokenizerError(UserError):
    """A tokenizer file we cannot use; the message names the file."""


CHAT_ROLES = ("system", "user", "assistant")  # the roles a chat message may have
Message = Mapping[str, str]  # {"role": one of CHAT_ROLES, "content": text}


def check_messages(messages: object) -> list[Message]:
    """`messages` as a conversation: a non-empty list of `{"role", "content"}` objects, roles in CHAT_ROLES,
    contents strings, no other keys (nothing a chat format here cannot render). Raises a one-line `UserError`."""
    if not isinstance(messages, list | tuple) or not messages:
        got = "an empty list" if isinstance(messages, list | tuple) else f"a {type(messages).__name__}"
        raise UserError(f"'messages' must be a non-empty list of {{role, content}} objects, got {got}")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise UserError(f"message {i} is a {type(m).__name__}, not a {{role, content}} object")
        if m.get("role") not in CHAT_ROLES:
            raise UserError(f"message {i}: 'role' must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise UserError(f"message {i} ({m['role']}): 'content' must be a string")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise UserError(f"message {i} ({m['role']}): cannot render keys {', '.join(extra)} (only role, content)")
    return list(messages)


# Kimi's chat format opens each message with the role's marker token and name.
_KIMI_ROLE_MARKERS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}


class Tokenizer(abc.ABC):
    """Text <-> ids for one checkpoint. `vocab_size` counts the specials; `stop_ids` end generation;
    `has_chat_format`: whether `encode_messages` / `encode_chat` can render a conversation."""

    vocab_size: int
    stop_ids: tuple[int, ...]
    has_chat_format: bool

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abc.abstractmethod
    def encode_messages(self, messages: Sequence[Message]) -> list[int]:
        """A conversation (as `check_messages` takes it) ready for the assistant's reply; a `TokenizerError` when
        the tokenizer has no chat format."""

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        """One user turn, after an optional system turn, ready for the assistant's reply."""
        turns = [] if system is None else [{"role": "system", "content": system}]
        return self.encode_messages([*turns, {"role": "user", "content": user_text}])


class KimiTokenizer(Tokenizer):
    """tiktoken BPE with Kimi's 256 reserved specials after the ranks.

    Like Kimi's own `encode`, special-token strings in text are encoded as special tokens.
    """

    has_chat_format = True

    def __init__(self, ranks: dict[bytes, int], specials: dict[str, int], pat_str: str, name: str):
        import tiktoken

        self._enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
        self.specials = specials
        self.vocab_size = len(ranks) + NUM_RESERVED_SPECIALS
        self.stop_ids = tuple(sorted(specials[n] for n in KIMI_STOP_NAMES if n in specials))

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))

    def encode_messages(self, messages: Sequence[Message]) -> list[int]:
        """Kimi's chat format (kimi_k2.md §7), hand-written: rendering `chat_template.jinja` needs jinja2.

        Each message is `<|im_user|>user<|im_middle|>{content}<|im_end|>` (`<|im_system|>system...`,
        `<|im_assistant|>assistant...` for the other roles), then `<|im_assistant|>assistant<|im_middle|>` opens
        the reply. No default system prompt (K2.5/K2.6 behaviour), and no `<think>` appended: a thinking model
        opens its own. Contents are encoded as given (special-token strings in them included).
        """
        text = "".join(
            f"{_KIMI_ROLE_MARKERS[m['role']]}{m['role']}<|im_middle|>{m['content']}<|im_end|>"
            for m in check_messages(messages)
        )
        return self.encode(text + "<|im_assistant|>assistant<|im_middle|>")


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json. It has no chat format (its checkpoint's Jinja chat template is not rendered):
    `encode_messages` / `encode_chat` raise `TokenizerError`."""

    has_chat_format = False

    def __init__(self, path: Path):
        self.path = path
        from tokenizers import Tokenizer as RawTokenizer

        try:
            self._tok = RawTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception on any parse error
            raise TokenizerError(f"{path}: cannot load tokenizer ({_first_line(e)})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder().items()
        self.stop_ids = tuple(sorted(i for i, t in added if t.special and t.content in _HF_STOP_NAMES))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_messages(self, messages: Sequence[Message]) -> list[int]:
        raise TokenizerError(f"{self.path}: this tokenizer has no chat format (Kimi's tiktoken.model has one)")


def _first_line(e: Exception) -> str:
    return str(e).strip().split("\n")[0]


def load_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer: `tiktoken.model` (Kimi) if present, else `tokenizer.json`."""
    d = Path(checkpoint_dir)
    if (d / "tiktoken.model").is_file():
        return load_kimi_tokenizer(d)
    if (d / "tokenizer.json").is_file():
        return HFTokenizer(d / "tokenizer.json")
    raise TokenizerError(f"{d}: no tokenizer (neither tiktoken.model nor tokenizer.json)")


def has_tokenizer(checkpoint_dir: str | Path) -> bool:
    d = Path(checkpoint_dir)
    return (d / "tiktoken.model").is_file() or (d / "tokenizer.json").is_file()


def load_kimi_tokenizer(d: Path) -> KimiTokenizer:
    """Ranks from `tiktoken.model`, specials from tokenizer_config.json (else the K2 table), pat_str from
    tokenization_kimi.py (else `KIMI_PAT_STR`)."""
    ranks = read_tiktoken_ranks(d / "tiktoken.model")
    names = _special_names(d / "tokenizer_config.json", len(ranks))
    ids = range(len(ranks), len(ranks) + NUM_RESERVED_SPECIALS)
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
    py = d / "tokenization_kimi.py"
    pat_str = read_pat_str(py) if py.is_file() else KIMI_PAT_STR
    return KimiTokenizer(ranks, specials, pat_str, name=str(d / "tiktoken.model"))


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`<base64 token> <rank>` per line; ranks must be 0..n-1 with all 256 single bytes present."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise TokenizerError(f"{path}:{lineno}: expected '<base64 token> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise TokenizerError(f"{path}: not all 256 single bytes have a rank")
    return ranks


def _special_names(config_path: Path, n_ranks: int) -> dict[int, str]:
    """id -> name from tokenizer_config.json's `added_tokens_decoder`, else the built-in K2 table."""
    if config_path.is_file():
        try:
            added = json.loads(config_path.read_text()).get("added_tokens_decoder")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise TokenizerError(f"{config_path}: malformed JSON ({_first_line(e)})") from None
        if isinstance(added, dict) and added:
            try:
                return {int(i): t["content"] for i, t in added.items()}
            except (ValueError, TypeError, KeyError):
                raise TokenizerError(f"{config_path}: malformed added_tokens_decoder") from None
    return {n_ranks + k: name for k, name in KIMI_SPECIALS.items()}


def read_pat_str(path: Path) -> str:
    """The `pat_str = "|".join([...])` or `pat_str = "..."` in tokenization_kimi.py, read without exec."""
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot parse ({_first_line(e)})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pat_str" for t in node.targets):
            pattern = _literal_pattern(node.value)
            if pattern is None:
                raise TokenizerError(f"{path}:{node.lineno}: pat_str is not a literal or a join of literals")
            return pattern
    raise TokenizerError(f"{path}: no pat_str assignment")


def _literal_pattern(v: ast.expr) -> str | None:
    try:
        if isinstance(v, ast.Call) and getattr(v.func, "attr", None) == "join" and len(v.args) == 1:
            sep, parts = ast.literal_eval(v.func.value), ast.literal_eval(v.args[0])
            ok = isinstance(sep, str) and isinstance(parts, list | tuple)
            return sep.join(parts) if ok and all(isinstance(p, str) for p in parts) else None
        lit = ast.literal_eval(v)
    except (ValueError, TypeError, SyntaxError):
        return None
    return lit if isinstance(lit, str) else None
