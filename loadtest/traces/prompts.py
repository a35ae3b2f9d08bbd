"""Prompts from hash ids: the same id at the same position always becomes the same tokens.

A trace names each block of a prompt by an id; a replay must turn ids back into prompts
whose shared prefixes stay shared after the target tokenizes them. :class:`PromptBuilder`
derives each block's content from ``(seed, id, position)`` with xxhash, so it is
reproducible across processes and machines, and a block cut short (the partial last block
of a prompt) is a prefix of the full block.

Two renderings:

- :meth:`PromptBuilder.token_ids`: token-id prompts (ids in ``[vocab_lo, vocab_hi)``), for
  targets that accept a list of ids as the completions ``prompt`` — exact for any tokenizer.
- :meth:`PromptBuilder.text`: ASCII text of exactly ``block_size`` characters per block.
  With the built-in byte tokenizer (one token per byte) it is block-exact: block ``i`` of
  the text is block ``i`` of the tokens. With a BPE tokenizer shared prefixes still give
  shared token prefixes, but block boundaries drift slightly.

Pure; the per-instance cache of rendered blocks is bounded.
"""

from __future__ import annotations

import random
from array import array

import xxhash

from loadtest.traces.types import TraceRequest

# 64 printable ASCII characters: letters, digits, space and a full stop.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ."
_TABLE = bytes(ord(ALPHABET[b % len(ALPHABET)]) for b in range(256))


class PromptBuilder:
    """Deterministic prompt content for trace blocks (see the module docstring)."""

    def __init__(self, block_size: int, seed: int = 0, vocab_lo: int = 1000, vocab_hi: int = 30000,
                 cache_blocks: int = 65536) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if not 0 <= vocab_lo < vocab_hi <= 1 << 16:
            raise ValueError("need 0 <= vocab_lo < vocab_hi <= 65536")
        self.block_size = block_size
        self.seed = seed
        self.vocab_lo = vocab_lo
        self.vocab_hi = vocab_hi
        self._cache_blocks = cache_blocks
        self._text: dict[tuple[int, int], str] = {}
        self._ids: dict[tuple[int, int], list[int]] = {}

    def _rng(self, hid: int, pos: int) -> random.Random:
        key = f"{self.seed}:{hid}:{pos}".encode()
        return random.Random(xxhash.xxh3_64_intdigest(key))

    def block_text(self, hid: int, pos: int) -> str:
        """The ``block_size`` ASCII characters of block id ``hid`` at position ``pos``."""
        k = (hid, pos)
        t = self._text.get(k)
        if t is None:
            if len(self._text) >= self._cache_blocks:
                self._text.clear()
            t = self._rng(hid, pos).randbytes(self.block_size).translate(_TABLE).decode("ascii")
            self._text[k] = t
        return t

    def block_token_ids(self, hid: int, pos: int) -> list[int]:
        """The ``block_size`` token ids of block id ``hid`` at position ``pos``."""
        k = (hid, pos)
        t = self._ids.get(k)
        if t is None:
            if len(self._ids) >= self._cache_blocks:
                self._ids.clear()
            raw = array("H", self._rng(hid, pos).randbytes(2 * self.block_size))
            span = self.vocab_hi - self.vocab_lo
            t = [self.vocab_lo + v % span for v in raw]
            self._ids[k] = t
        return t

    def _lengths(self, req: TraceRequest) -> list[int]:
        """Characters/tokens each block contributes (the last one may be cut short)."""
        if req.block_size != self.block_size:
            raise ValueError(f"trace block size {req.block_size} != builder block size {self.block_size}")
        bs = self.block_size
        return [max(0, min(bs, req.input_length - i * bs)) for i in range(len(req.hash_ids))]

    def text(self, req: TraceRequest) -> str:
        """The prompt of ``req`` as ASCII text of ``input_length`` characters (when the
        trace's ids cover it; any remainder beyond the last id is filled per request)."""
        parts = []
        for pos, (hid, n) in enumerate(zip(req.hash_ids, self._lengths(req), strict=True)):
            parts.append(self.block_text(hid, pos)[:n])
        out = "".join(parts)
        return out + self._filler(req, req.input_length - len(out))

    def token_ids(self, req: TraceRequest) -> list[int]:
        """The prompt of ``req`` as ``input_length`` token ids."""
        out: list[int] = []
        for pos, (hid, n) in enumerate(zip(req.hash_ids, self._lengths(req), strict=True)):
            out.extend(self.block_token_ids(hid, pos)[:n])
        extra = req.input_length - len(out)
        if extra > 0:
            span = self.vocab_hi - self.vocab_lo
            out.extend(self.vocab_lo + ord(c) % span for c in self._filler(req, extra))
        return out

    def _filler(self, req: TraceRequest, n: int) -> str:
        """Content past the trace's last id (unique to this request's arrival and shape)."""
        if n <= 0:
            return ""
        rng = random.Random(xxhash.xxh3_64_intdigest(
            f"{self.seed}:tail:{req.timestamp_s}:{req.hash_ids[-1] if req.hash_ids else -1}".encode()))
        return rng.randbytes(n).translate(_TABLE).decode("ascii")
