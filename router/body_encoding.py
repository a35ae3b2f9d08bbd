"""Request bodies sent with ``Content-Encoding``: decoded here, bounded, before routing. Pure.

The router must read a body to route it (``model``, the prompt's prefix), and engines
(vLLM, SGLang) do not decode compressed request bodies, so a compressed body is decoded
once here and forwarded as plain bytes *without* its ``Content-Encoding`` header
(:data:`router.proxy.REQUEST_DROP`). The aiohttp server's own decompression is turned off
(``auto_decompress=False`` in :func:`router.server.runner_for`) so that every outcome is
decided here:

* ``identity`` (or no header): the body as it came;
* ``gzip`` / ``x-gzip`` (several members allowed) and ``deflate`` (zlib-wrapped, or raw
  deflate as some clients send it): decoded, stacked codings in reverse order;
* decoded size over ``limits.max_body_bytes`` → 413 ``body_too_large``; decoding stops
  one byte past the limit, so a gzip bomb costs at most that much memory;
* a body that is not valid for its coding (garbage, truncated, trailing bytes) → 400
  ``invalid_content_encoding``;
* any other coding (``br``, ``zstd``, ``compress``, unknown) → 415
  ``unsupported_content_encoding``.
"""

from __future__ import annotations

import zlib
from typing import Any

SUPPORTED = ("gzip", "x-gzip", "deflate", "identity")
MAX_CODINGS = 2  # e.g. "deflate, gzip"; longer chains are refused
MAX_GZIP_MEMBERS = 64


class BodyEncodingError(Exception):
    """Why a body cannot be decoded: ``status`` (400/413/415), OpenAI error ``code``, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def codings(header: str | None) -> list[str]:
    """The codings of a ``Content-Encoding`` header in the order they were applied, without
    ``identity``; 415 for an unsupported one or too many."""
    if not header:
        return []
    out = [c.strip().lower() for c in header.split(",")]
    out = [c for c in out if c and c != "identity"]
    for c in out:
        if c not in SUPPORTED:
            raise BodyEncodingError(415, "unsupported_content_encoding",
                                    f"Unsupported Content-Encoding {c!r} (supported: gzip, deflate, identity)")
    if len(out) > MAX_CODINGS:
        raise BodyEncodingError(415, "unsupported_content_encoding",
                                f"Too many stacked Content-Encodings ({len(out)}; at most {MAX_CODINGS})")
    return out


def decode_body(body: bytes, header: str | None, max_bytes: int) -> bytes:
    """``body`` decoded according to its ``Content-Encoding`` header, at most ``max_bytes``
    long; raises :class:`BodyEncodingError` (see the module docstring)."""
    for coding in reversed(codings(header)):
        body = _gunzip(body, max_bytes) if coding in ("gzip", "x-gzip") else _inflate(body, max_bytes)
    return body


def _too_large(max_bytes: int) -> BodyEncodingError:
    return BodyEncodingError(413, "body_too_large", f"Request body too large once decoded (limit {max_bytes} bytes)")


def _invalid(coding: str, why: str) -> BodyEncodingError:
    return BodyEncodingError(400, "invalid_content_encoding", f"Request body is not valid {coding}: {why}")


def _run(d: Any, data: bytes, room: int, max_bytes: int, coding: str) -> bytes:
    """One zlib stream, at most ``room`` bytes out (413 past that, 400 when invalid or cut short)."""
    try:
        out = d.decompress(data, room + 1)
    except zlib.error as exc:
        raise _invalid(coding, str(exc)) from None
    if len(out) > room:
        raise _too_large(max_bytes)
    if not d.eof:
        raise _invalid(coding, "the compressed data ends early")
    return out


def _gunzip(data: bytes, max_bytes: int) -> bytes:
    if not data:
        raise _invalid("gzip", "empty body")
    parts: list[bytes] = []
    size = 0
    rest = data
    for _ in range(MAX_GZIP_MEMBERS):
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out = _run(d, rest, max_bytes - size, max_bytes, "gzip")
        parts.append(out)
        size += len(out)
        rest = d.unused_data
        if not rest:
            return b"".join(parts)
    raise _invalid("gzip", f"more than {MAX_GZIP_MEMBERS} members")


def _inflate(data: bytes, max_bytes: int) -> bytes:
    if not data:
        raise _invalid("deflate", "empty body")
    try:
        d = zlib.decompressobj(zlib.MAX_WBITS)
        out = _run(d, data, max_bytes, max_bytes, "deflate")
    except BodyEncodingError as exc:
        if exc.status != 400:
            raise
        d = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, no zlib header
        out = _run(d, data, max_bytes, max_bytes, "deflate")
    if d.unused_data:
        raise _invalid("deflate", "bytes after the end of the compressed data")
    return out
