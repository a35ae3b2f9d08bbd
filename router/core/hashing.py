"""Token-block hashing: the names the prefix index uses for cached KV blocks.

A prompt of token ids is cut into full blocks of ``block_size`` tokens (a trailing partial
block is never hashed: engines only cache full blocks). Each block's hash chains the
previous one, ``h_i = xxh3_64(tokens of block i, seed=h_{i-1})``, so one 64-bit value
names a whole prefix. The chain starts from a seed derived from the model name, the LoRA
adapter and the request's ``cache_salt``: the same tokens under another model, adapter or
salt never collide.

Pure and allocation-light: the token list is packed to bytes once, then each block is a
slice of that buffer hashed with the parent as the xxhash seed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_MASK64 = (1 << 64) - 1


def seed_hash(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """The chain's starting value for (model, LoRA adapter, cache salt)."""
    key = f"kvrouter\x00{model}\x00{lora or ''}\x00{cache_salt or ''}".encode()
    return xxhash.xxh3_64_intdigest(key)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian 4-byte words (ids outside int32 wrap modulo 2**32)."""
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        return array("I", [int(t) & 0xFFFFFFFF for t in tokens]).tobytes()


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: int,
    *,
    start_block: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of every full block of ``tokens``.

    ``start_block``/``parent`` resume a chain: when the caller already holds the hashes of
    the first ``start_block`` blocks, pass the last of them as ``parent`` and only the new
    blocks are hashed (a growing multi-turn chat pays for its new turn only).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n_full = len(tokens) // block_size
    if start_block >= n_full:
        return []
    begin = start_block * block_size
    buf = pack_tokens(tokens[begin : n_full * block_size])
    step = block_size * 4
    h = seed if parent is None else parent
    out: list[int] = []
    append = out.append
    digest = xxhash.xxh3_64_intdigest
    for off in range(0, len(buf), step):
        h = digest(buf[off : off + step], h)
        append(h)
    return out


def hash_blocks_of(token_blocks: Sequence[Sequence[int]], seed: int) -> list[int]:
    """Chained hashes of already-cut blocks (each one full block of token ids)."""
    h = seed
    out: list[int] = []
    for blk in token_blocks:
        h = xxhash.xxh3_64_intdigest(pack_tokens(blk), h)
        out.append(h)
    return out


def to_signed64(h: int) -> int:
    """An unsigned 64-bit hash as a signed int64 (for stores that only keep signed ints)."""
    h &= _MASK64
    return h - (1 << 64) if h >= (1 << 63) else h
