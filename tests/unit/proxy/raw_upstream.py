"""A loopback HTTP/1.1 server whose answers each test writes byte for byte, for the upstream client's
framing, pooling and flow-control cases (the fake llama-server only speaks well-formed HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class RawRequest:
    conn: int  # 1-based number of the connection it came on
    nth: int  # 1-based number of the request on that connection
    method: str
    target: str
    headers: dict[str, str]  # lower-cased names
    raw_head: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def body(self) -> bytes:
        return await self.reader.readexactly(int(self.headers.get("content-length", "0")))


# Writes the answer; True keeps the connection open for the next request, False closes it.
Handler = Callable[[RawRequest], Awaitable[bool]]


@dataclass(eq=False)
class RawUpstream:
    handler: Handler
    port: int = 0
    connections: int = 0
    requests: list[RawRequest] = field(default_factory=list)
    # Connections on which the server saw the client hang up (EOF or reset).
    client_closed: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self.writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        conn = self.connections
        self.writers.append(writer)
        try:
            for nth in range(1, 1_000_000):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.client_closed += 1
                    return
                request_line, *lines = head[:-4].decode("latin-1").split("\r\n")
                method, target, _ = request_line.split(" ", 2)
                headers = {}
                for line in lines:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                request = RawRequest(conn, nth, method, target, headers, head, reader, writer)
                self.requests.append(request)
                if not await self.handler(request):
                    break
            writer.close()
        except ConnectionError:
            self.client_closed += 1
        except asyncio.CancelledError:
            pass  # stopped by ``stop``: end quietly (asyncio's stream callback would log a cancelled task)
        finally:
            self._tasks.discard(task)


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


async def answer_ok(request: RawRequest) -> bool:
    await request.body()
    request.writer.write(ok(b"ok %d.%d" % (request.conn, request.nth)))
    return True
