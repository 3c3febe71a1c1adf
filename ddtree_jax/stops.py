"""Stop strings, applied on the host after generation: the program itself stops only at stop token ids or
max_new_tokens (matching text on device would need the tokenizer inside it).

A row's generated text (its prompt excluded) is cut before the first occurrence of any stop string, and its token ids
to the shortest prefix whose decoded text contains a stop string (the tokens that spell it are kept, so the ids
still decode to the text up to and including the stop string).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

STOP = "stop"  # finish reason: a stop token id or a stop string ended the row
LENGTH = "length"  # finish reason: max_new_tokens ended the row


def check_stop_strings(stop_strings: Sequence[str]) -> list[str]:
    """`stop_strings` as a list of non-empty strings; raises ValueError otherwise."""
    if isinstance(stop_strings, str):
        raise ValueError(f"stop strings are a list of strings, got the string {stop_strings!r}")
    if not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"stop strings must be non-empty strings, got {list(stop_strings)!r}")
    return list(stop_strings)


def _first_stop(text: str, stop_strings: Sequence[str]) -> int:
    """Index in `text` where the earliest stop string starts, or -1."""
    found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(found, default=-1)


def cut_at_stop_strings(
    ids: Sequence[int], stop_strings: Sequence[str], decode: Callable[[list[int]], str]
) -> tuple[list[int], str, bool]:
    """One row's generated ids -> (ids cut, text cut, whether a stop string was found).

    The ids are cut to the shortest prefix whose decoded text contains a stop string, found by bisection over
    prefix lengths: exact for a decoder whose text of a prefix is a prefix of the text of the whole (byte-level BPE
    is, up to an incomplete UTF-8 character at the end). Without a stop string the ids and their text come back
    whole.
    """
    ids = list(ids)
    text = decode(ids)
    at = _first_stop(text, stop_strings)
    if at < 0:
        return ids, text, False
    lo, hi = 0, len(ids)  # decode(ids[:lo]) has no stop string, decode(ids[:hi]) has one
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _first_stop(decode(ids[:mid]), stop_strings) >= 0:
            hi = mid
        else:
            lo = mid
    return ids[:hi], text[:at], True
