"""A minimal HTTP/1.1 keep-alive client on asyncio streams, for the proxy cost benchmark.

Why not httpx: on a 2-core host the load generator competes with the proxy for CPU, and httpx spends
several times more per request than the proxy's own hot path. This client does only what the benchmark
needs (one request at a time per connection, Content-Length or chunked bodies, arrival time of every
chunk) and so leaves the cores to the process being measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    body: bytes = b""
    # Arrival time (monotonic) and size of each body chunk of a chunked (streamed) reply.
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    sent_at: float = 0.0
    done_at: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def build_request(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> bytes:
    parts = urlsplit(url)
    lines = [f"{method} {parts.path or '/'} HTTP/1.1", f"Host: {parts.netloc}"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, base_url: str) -> Connection:
        parts = urlsplit(base_url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=1 << 20)
        return cls(reader, writer)

    async def send(self, raw: bytes) -> Reply:
        """Send one prepared request; read the whole reply, timing each chunk of a chunked body."""
        reader = self._reader
        sent = time.monotonic()
        self._writer.write(raw)
        head = await reader.readuntil(b"\r\n\r\n")
        reply = Reply(status=int(head[9:12]), sent_at=sent)
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name:
                reply.headers[name.decode().lower()] = value.strip().decode("latin-1")
        if reply.headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                data = (await reader.readexactly(size + 2))[:-2]
                reply.chunks.append((time.monotonic(), data))
        else:
            length = int(reply.headers.get("content-length", "0"))
            reply.body = await reader.readexactly(length) if length else b""
        reply.done_at = time.monotonic()
        return reply

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()
