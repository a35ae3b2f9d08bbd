"""Tokenization for the simulated engine: the built-in byte-level tokenizer by default, or a
local Hugging Face ``tokenizer.json`` (via the ``tokenizers`` library).

Chat messages are rendered with the built-in template (``router.core.bytetok.render_chat``)
and the text is then encoded, with either tokenizer, so the router's fallback tokenization
and the sim's agree exactly in the default mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.core import bytetok


class SimTokenizer:
    """``encode``/``decode``/``render_chat`` plus ``char_id`` (a character's single token id,
    used to spell the generated text)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._tok: Any = None
        if path:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(path)
            self.vocab_size = int(self._tok.get_vocab_size())
            self.name = path
        else:
            self.vocab_size = bytetok.VOCAB_SIZE
            self.name = "builtin-bytes"

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            return bytetok.encode(text)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self._tok is None:
            return bytetok.decode(ids)
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        return bytetok.render_chat(messages, add_generation_prompt)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        if self._tok is None:
            return [bytetok.decode([i]) for i in ids]
        return [self._tok.id_to_token(int(i)) or "" for i in ids]

    def char_id(self, c: str) -> int | None:
        """The id of ``c`` when it encodes to exactly one token that decodes back to ``c``."""
        ids = self.encode(c)
        if len(ids) != 1 or self.decode(ids) != c:
            return None
        return ids[0]
