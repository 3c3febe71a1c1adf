"""Stopping: stop strings cut on the host (`stops.cut_at_stop_strings`), stop token ids on device, finish_reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_engine import make_pair

from ddtree_jax import stops
from ddtree_jax.api import Generator

PIECES = {0: "Hello", 1: " wor", 2: "ld", 3: "!\n", 4: "END", 5: "x"}


def decode(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize(
    ("stop_strings", "ids", "text"),
    [
        (["END"], [0, 1, 2, 3, 4], "Hello world!\n"),  # whole tokens
        (["orld"], [0, 1, 2], "Hello w"),  # spans " wor" and "ld"
        (["ell"], [0], "H"),  # inside one token
        (["END", "ld"], [0, 1, 2], "Hello wor"),  # the earliest of several
        (["x", "d!"], [0, 1, 2, 3], "Hello worl"),
        (["Hello"], [0], ""),  # at the very start
    ],
)
def test_cut_at_stop_strings(stop_strings: list[str], ids: list[int], text: str) -> None:
    assert stops.cut_at_stop_strings([0, 1, 2, 3, 4, 5, 4], stop_strings, decode) == (ids, text, True)


def test_no_stop_string_found_keeps_everything() -> None:
    assert stops.cut_at_stop_strings([0, 1, 2], ["END", "\n"], decode) == ([0, 1, 2], "Hello world", False)


def test_cut_with_kimi_tokenizer_and_multibyte_text(tmp_path: Path) -> None:
    """Byte-level BPE: a stop string made of merged tokens, one ending in a two-byte character, one starting inside
    a token; the ids decode to the text up to and including the stop string."""
    from test_tokenizer import write_tiktoken

    from ddtree_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(write_tiktoken(tmp_path))
    ids = tok.encode("hello world, café au lait. hello")
    for stop, before in [("d, caf\u00e9", "hello worl"), ("llo", "he"), ("\u00e9 a", "hello world, caf")]:
        cut, text, hit = stops.cut_at_stop_strings(ids, [stop], tok.decode)
        assert hit and text == before
        assert tok.decode(cut).startswith(before + stop) and stop not in tok.decode(cut[:-1])


@pytest.mark.parametrize("bad", ["END", [""], ["a", 3]])
def test_stop_strings_must_be_non_empty_strings(bad: object) -> None:
    with pytest.raises(ValueError, match="stop strings"):
        stops.check_stop_strings(bad)


class TwoCharTokenizer:
    """Token i decodes to two letters, so any stop string of two letters at an odd offset spans two tokens."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i // 26) + chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def gen() -> Generator:
    target, drafter = make_pair(11)
    return Generator(target, drafter, tokenizer=TwoCharTokenizer())


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_stop_string_spanning_two_tokens_cuts_text_and_ids(gen: Generator, method: str) -> None:
    kw = dict(method=method, budget=6, max_new_tokens=12, ignore_eos=True)
    free = gen.generate([[1, 2, 3], [4, 5]], **kw)
    assert [s["finish_reason"] for s in free.stats] == ["length", "length"]
    stop = free.texts[0][9:11]  # the second letter of token 4 and the first of token 5
    res = gen.generate([[1, 2, 3], [4, 5]], stop_strings=[stop], **kw)
    for full, ids, text, stats in zip(free.tokens, res.tokens, res.texts, res.stats, strict=True):
        whole = TwoCharTokenizer().decode(full)
        if stop not in whole:
            assert (ids, text, stats["finish_reason"]) == (full, whole, "length")
            continue
        shortest = next(n for n in range(len(full) + 1) if stop in TwoCharTokenizer().decode(full[:n]))
        assert ids == full[:shortest] and text == whole[: whole.index(stop)] and stats["finish_reason"] == "stop"
    assert len(res.tokens[0]) <= 6


def test_stop_strings_need_a_tokenizer() -> None:
    target, drafter = make_pair(12)
    with pytest.raises(ValueError, match="stop_strings need the target's tokenizer"):
        Generator(target, drafter).generate([[1, 2]], max_new_tokens=4, stop_strings=["a"])


def test_stop_token_ids_end_rows_at_the_given_id(gen: Generator) -> None:
    """User stop ids end each row at its first occurrence (kept), with or without ignore_eos, alongside the EOS."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, n).tolist() for n in (3, 7, 5, 2)]
    kw = dict(method="ddtree", budget=6, max_new_tokens=16)
    free = gen.generate(prompts, ignore_eos=True, **kw).tokens
    stop = free[1][4]
    for ignore_eos in (True, False):
        res = gen.generate(prompts, ignore_eos=ignore_eos, stop_token_ids=[stop], **kw)
        eos = () if ignore_eos else gen.target_config.stop_token_ids
        assert res.spec.stop_ids == tuple(sorted({stop, *eos}))
        for f, got, stats in zip(free, res.tokens, res.stats, strict=True):
            ends = [i for i, t in enumerate(f) if t in res.spec.stop_ids]
            assert got == (f[: ends[0] + 1] if ends else f)
            assert stats["finish_reason"] == ("stop" if ends else "length")
    with pytest.raises(ValueError, match=r"stop token ids \[97\] outside the vocabulary \[0, 97\)"):
        gen.generate(prompts, stop_token_ids=[97], **kw)


def test_top_k_top_p_refused_with_greedy(gen: Generator) -> None:
    with pytest.raises(ValueError, match="top_k and top_p need temperature > 0"):
        gen.generate([[1, 2]], max_new_tokens=4, top_p=0.9)
    with pytest.raises(ValueError, match="top_k must be >= 0 and top_p in"):
        gen.generate([[1, 2]], max_new_tokens=4, temperature=1.0, top_p=0.0)
