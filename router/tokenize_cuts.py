"""Where the router's tokenizer cuts a text into separately cached pieces (pure): after
each chat message's content (:func:`message_cuts`), and inside long stretches at
content-defined boundaries (:func:`split_chunks`). Cuts depend only on the text before them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.tokenize_kinds import content_text


def split_chunks(text: str, chunk_chars: int) -> list[str]:
    """Content-defined chunks: cut after the first newline followed by a non-space character
    at or beyond ``chunk_chars`` characters since the last cut (hard cut at
    ``4 × chunk_chars``). A newline before a word is a pre-token boundary of byte-level BPEs
    (GPT-2 / Llama 3 split patterns), so such cuts do not change the ids."""
    if chunk_chars <= 0 or len(text) <= chunk_chars:
        return [text]
    out = []
    start, n, hard = 0, len(text), 4 * chunk_chars
    while n - start > chunk_chars:
        limit = min(n - 1, start + hard)
        nl = text.find("\n", start + chunk_chars, limit)
        while nl >= 0 and text[nl + 1] in " \t\r\n":
            nl = text.find("\n", nl + 1, limit)
        cut = nl + 1 if nl >= 0 else start + hard
        if cut >= n:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def message_contents(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [m.get("content") for m in messages]
    if set(map(type, out)) != {str}:  # content parts (or none) → their text
        out = [c if type(c) is str else content_text(c) for c in out]
    return out


def cuts_from(text: str, contents: Sequence[str], first: int, pos: int) -> list[tuple[int, int]]:
    """(message index, position right after its content) for ``contents[first:]``, found in
    order from ``pos``; messages with empty or unfound content get no cut."""
    cuts = []
    for i in range(first, len(contents)):
        c = contents[i]
        if c:
            j = text.find(c, pos, pos + len(c) + 1024)  # template glue between contents is short
            if j < 0:
                j = text.find(c, pos)
            if j >= 0:
                pos = j + len(c)
                cuts.append((i, pos))
    return cuts


def message_cuts(text: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Positions in a rendered chat right after each message's content (found in order)."""
    return [c for _, c in cuts_from(text, message_contents(messages), 0, 0)]
