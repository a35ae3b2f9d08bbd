"""The fake backends of ``loadtest.bench_scale``: many replicas in one asyncio process
(``python -m loadtest.bench_scale --serve-backends PORT,PORT,...``), answering fixed bytes,
holding a request for its ``delay_ms`` when the body asks, and sampling every replica's
in-flight count every ``SAMPLE_S`` in one loop (one clock for all replicas) for the balance
part. ``POST /_sampling/on`` / ``off`` start and stop sampling; ``GET /_stats`` returns and
resets the samples.
"""

from __future__ import annotations

import asyncio
import re

import orjson

SAMPLE_S = 0.01


_OK = b'{"id":"cmpl-b","object":"text_completion","model":"bench-model","choices":[{"index":0,"text":" ok",' \
      b'"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}'
_DELAY = re.compile(rb'"delay_ms"\s*:\s*([0-9.]+)')


def _response(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: " + \
        str(len(body)).encode() + b"\r\n\r\n" + body


class Backends:
    """Many fake replicas in one event loop: fixed answers, optional per-request delay, and an
    in-flight sampler shared by all (``GET /_stats`` returns and resets the samples)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.inflight = [0] * len(ports)
        self.samples: list[list[int]] = []
        self.sampling = False

    def stats(self) -> bytes:
        out = orjson.dumps({"samples": self.samples})
        self.samples = []
        return out

    async def sampler(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_S)
            if self.sampling:
                self.samples.append(list(self.inflight))

    def protocol(self, idx: int) -> asyncio.Protocol:
        be = self

        class P(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.t: asyncio.Transport = transport  # type: ignore[assignment]
                self.buf = b""

            def data_received(self, data: bytes) -> None:
                self.buf += data
                while True:
                    end = self.buf.find(b"\r\n\r\n")
                    if end < 0:
                        return
                    head = self.buf[:end]
                    m = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                    n = int(m.group(1)) if m else 0
                    if len(self.buf) < end + 4 + n:
                        return
                    body = self.buf[end + 4: end + 4 + n]
                    self.buf = self.buf[end + 4 + n:]
                    self.handle(head, body)

            def handle(self, head: bytes, body: bytes) -> None:
                line = head.split(b"\r\n", 1)[0]
                if line.startswith(b"GET /_stats"):
                    self.t.write(_response(be.stats()))
                elif line.startswith(b"POST /_sampling/on"):
                    be.samples, be.sampling = [], True
                    self.t.write(_response(b"{}"))
                elif line.startswith(b"POST /_sampling/off"):
                    be.sampling = False
                    self.t.write(_response(b"{}"))
                elif line.startswith(b"GET"):
                    self.t.write(_response(b"", b"text/plain"))
                else:
                    m = _DELAY.search(body)
                    if m is None:
                        self.t.write(_response(_OK))
                        return
                    be.inflight[idx] += 1
                    asyncio.get_running_loop().call_later(float(m.group(1)) / 1000, self.done)

            def done(self) -> None:
                be.inflight[idx] -= 1
                if not self.t.is_closing():
                    self.t.write(_response(_OK))

        return P()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for i, port in enumerate(self.ports):
            await loop.create_server(lambda i=i: self.protocol(i), "127.0.0.1", port, backlog=4096)
        await self.sampler()


def serve_backends(ports: list[int]) -> None:
    try:
        import uvloop

        uvloop.run(Backends(ports).run())
    except ImportError:
        asyncio.run(Backends(ports).run())
