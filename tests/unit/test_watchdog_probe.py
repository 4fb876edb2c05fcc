"""The watchdog's probe (``probes.loop_answers`` through ``HttpProbes.loop``) against small loopback servers:
an answer, a transport hiccup retried within the deadline, the ``/metrics`` fallback of a child started with
``--no-slots``, and a loop that never answers. Plus the deadline as ``llamagate plan`` prints it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx

from supervisor.child.gate import HttpProbes
from supervisor.commands.plan import _watchdog, _watchdog_line
from supervisor.config.schema import Config, SupervisionConfig

Handler = Callable[[str, asyncio.StreamWriter], Awaitable[bool]]  # path -> answered (False: hold it)


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[str]]]:
    """A loopback HTTP/1.1 server: each request's path goes to ``handler``, which writes the answer or
    returns False to hold the connection open without a byte (a held loop)."""
    paths: list[str] = []
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ", 2)[1].decode()
        paths.append(path)
        if await handler(path, writer):
            await writer.drain()
            writer.close()
        else:
            held.append(writer)

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", paths
    finally:
        for w in held:
            w.close()
        srv.close()


def answer(writer: asyncio.StreamWriter, status: int, body: bytes = b"[]") -> bool:
    writer.write(
        f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    )
    return True


async def test_a_loop_that_answers_slots_answered() -> None:
    async def handler(path: str, w: asyncio.StreamWriter) -> bool:
        return answer(w, 200)

    async with server(handler) as (url, paths):
        probes = HttpProbes()
        assert await probes.loop(url, "secret", 2.0) is True
        await probes.aclose()
    assert paths == ["/slots"]


async def test_a_connection_closed_without_an_answer_is_retried_within_the_deadline() -> None:
    # The child's 5 s idle close of a keep-alive connection looks like this: not a held loop.
    async def handler(path: str, w: asyncio.StreamWriter) -> bool:
        if len(paths) == 1:
            w.close()  # no byte: a transport error
            return True
        return answer(w, 200)

    async with server(handler) as (url, paths):
        probes = HttpProbes()
        assert await probes.loop(url, "secret", 5.0) is True
        await probes.aclose()
    assert paths == ["/slots", "/slots"]


async def test_no_slots_endpoint_falls_back_to_metrics() -> None:
    async def handler(path: str, w: asyncio.StreamWriter) -> bool:
        return (
            answer(w, 501, b'{"error":{"message":"no slots"}}') if path == "/slots" else answer(w, 200, b"")
        )

    async with server(handler) as (url, paths):
        probes = HttpProbes()
        assert await probes.loop(url, "secret", 2.0) is True
        await probes.aclose()
    assert paths == ["/slots", "/metrics"]


async def test_a_held_loop_is_not_answered_and_the_probe_stops_at_its_deadline() -> None:
    async def handler(path: str, w: asyncio.StreamWriter) -> bool:
        return False  # the HTTP thread took the request; the loop never answers the task

    async with server(handler) as (url, paths):
        probes = HttpProbes()
        started = time.monotonic()
        assert await probes.loop(url, "secret", 0.3) is False
        waited = time.monotonic() - started
        await probes.aclose()
    assert paths[0] == "/slots"
    assert waited < 5.0  # bounded by the deadline, not by httpx's default or the server


async def test_an_answer_no_loop_gives_is_no_answer() -> None:
    async def handler(path: str, w: asyncio.StreamWriter) -> bool:
        return answer(w, 503, b'{"error":{"message":"Loading model"}}')

    async with server(handler) as (url, _):
        probes = HttpProbes(httpx.AsyncClient(trust_env=False))
        assert await probes.loop(url, "secret", 1.0) is False
        await probes.aclose()


def test_plan_prints_the_deadline() -> None:
    cfg = Config(supervision=SupervisionConfig(loop_deadline_s=12.5, health_interval_s=3.0))
    assert _watchdog(cfg) == {"probe_interval_s": 3.0, "loop_deadline_s": 12.5}
    line = _watchdog_line(cfg)
    assert "12.5 s (supervision.loop_deadline_s)" in line and "every 3 s" in line
