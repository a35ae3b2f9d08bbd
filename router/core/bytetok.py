"""The built-in byte-level tokenizer: needs no files, shared by the router and the simulator.

One token per UTF-8 byte (ids 0–255), so the router's fallback tokenization and the
simulated engine's tokenization are identical and block boundaries agree exactly (the
condition for exact KV-event tracking). Chat messages are rendered with a fixed,
documented template before encoding. Pure and fast (encoding is a C-level byte copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 256
BOS = ""  # no special tokens: a prompt's tokens are exactly its bytes


def encode(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8", "surrogatepass"))


def decode(ids: Iterable[int]) -> str:
    """Text of token ids (ids wrap modulo 256; invalid UTF-8 is replaced)."""
    return bytes(i & 0xFF for i in ids).decode("utf-8", "replace")


def content_text(content: Any) -> str:
    """The text of an OpenAI message ``content`` (a string or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, Mapping) and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, str):
                parts.append(p)
        return "".join(parts)
    return str(content)


def render_message(msg: Mapping[str, Any]) -> str:
    """One message in the built-in chat template: ``<|role|>\\ncontent<|end|>\\n``."""
    return f"<|{msg.get('role', 'user')}|>\n{content_text(msg.get('content'))}<|end|>\n"


GENERATION_PROMPT = "<|assistant|>\n"


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """A whole conversation in the built-in template (each message renders independently,
    so a conversation's rendering is a prefix of its continuation's)."""
    text = "".join(render_message(m) for m in messages)
    return text + GENERATION_PROMPT if add_generation_prompt else text
