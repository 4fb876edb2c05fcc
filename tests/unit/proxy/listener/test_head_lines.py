"""Rendered header lines (``proxy.asgi.head``) through the front door's real uvicorn protocol: written into
the head as they are, with uvicorn's own framing of everything else intact, and the same head lines as
when they go as header pairs through uvicorn's checks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn

from proxy.asgi.head import HEAD_LINES, as_headers, lines_writer
from proxy.listener.guard import FrontDoor, uvicorn_config
from proxy.listener.head import _Splice, send_with_lines
from proxy.settings import DoorSettings
from tests.fakes.fake_upstream import eventually

LINES = (
    b"x-ratelimit-limit-tokens: 100\r\nx-ratelimit-remaining-tokens: 7\r\nx-ratelimit-reset-tokens: 59.5s\r\n"
)
seen: list[bool] = []


async def app(scope: Any, receive: Any, send: Any) -> None:
    """``/lines...`` answers with LINES rendered, ``/pairs...`` with them as header pairs; ``...chunked``
    streams its body in two parts (no length: uvicorn frames it chunked)."""
    if scope["type"] != "http":
        return
    path: str = scope["path"]
    send_lines = lines_writer(scope)
    seen.append(send_lines is not None)
    chunked = path.endswith("chunked")
    headers = [(b"content-type", b"text/plain")] + ([] if chunked else [(b"content-length", b"5")])
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    if path.startswith("/lines") and send_lines is not None:
        await send_lines(send, start, LINES)
    else:
        await send({**start, "headers": headers + as_headers(LINES)})
    if chunked:
        await send({"type": "http.response.body", "body": b"hel", "more_body": True})
        await send({"type": "http.response.body", "body": b"lo", "more_body": False})
    else:
        await send({"type": "http.response.body", "body": b"hello", "more_body": False})


@asynccontextmanager
async def front_door() -> AsyncIterator[int]:
    door = FrontDoor(lambda: DoorSettings())
    config = uvicorn_config(
        app, door, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    await eventually(lambda: server.started or task.done(), 10.0)
    if task.done():
        task.result()
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


async def exchange(port: int, *paths: str) -> list[tuple[list[bytes], bytes]]:
    """The paths asked one after another on one keep-alive connection: each answer's head lines (the
    date left out) and its body, read by the framing uvicorn chose."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers: list[tuple[list[bytes], bytes]] = []
    try:
        for path in paths:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            head = (await reader.readuntil(b"\r\n\r\n"))[:-4].split(b"\r\n")
            fields = dict(h.lower().split(b": ", 1) for h in head[1:])
            if b"content-length" in fields:
                body = await reader.readexactly(int(fields[b"content-length"]))
            else:
                assert fields[b"transfer-encoding"] == b"chunked"
                body = b""
                while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
                    body += (await reader.readexactly(size + 2))[:-2]
                await reader.readuntil(b"\r\n")
            answers.append(([h for h in head if not h.startswith(b"date:")], body))
    finally:
        writer.close()
    return answers


async def test_rendered_lines_are_the_head_lines_uvicorn_writes_for_the_same_pairs() -> None:
    seen.clear()
    async with front_door() as port:
        answers = await exchange(port, "/lines", "/pairs", "/lines-chunked", "/pairs-chunked", "/lines")
    assert seen == [True] * 5  # the front door offers the extension to every request
    (lines, lines_body), (pairs, pairs_body), (c_lines, c_lines_body), (c_pairs, c_pairs_body), again = (
        answers
    )
    assert sorted(lines) == sorted(pairs) and lines_body == pairs_body == b"hello"
    assert sorted(c_lines) == sorted(c_pairs) and c_lines_body == c_pairs_body == b"hello"
    assert lines[-3:] == LINES.split(b"\r\n")[:-1]  # each once, as given, before the blank line
    assert b"transfer-encoding: chunked" in c_lines and again == answers[0]  # framing and keep-alive intact


async def test_the_lines_go_as_header_pairs_without_the_front_doors_protocol() -> None:
    """Under another server (here uvicorn's own protocol) nothing is offered: the same lines arrive as
    pairs through the server's checks."""
    assert lines_writer({"type": "http"}) is None and lines_writer({"extensions": {}}) is None
    assert lines_writer({"extensions": {HEAD_LINES: {"send": send_with_lines}}}) is send_with_lines
    assert as_headers(LINES) == [
        (b"x-ratelimit-limit-tokens", b"100"),
        (b"x-ratelimit-remaining-tokens", b"7"),
        (b"x-ratelimit-reset-tokens", b"59.5s"),
    ]


async def test_lines_are_refused_for_a_send_that_is_not_a_response_cycles() -> None:
    async def send(message: Any) -> None:
        raise AssertionError("not reached")

    with pytest.raises(RuntimeError, match="not a cycle's"):
        await send_with_lines(send, {"type": "http.response.start", "status": 200}, LINES)


def test_the_splice_puts_the_lines_before_the_heads_blank_line_once() -> None:
    """Whether the head comes alone or with a body in the same write; later writes pass untouched."""
    written: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(data)

    head = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n"
    for first in (head, head + b"body"):
        written.clear()
        splice = _Splice(Transport(), LINES)
        splice.write(first)
        splice.write(b"more\r\n\r\n")
        assert written == [first.replace(b"\r\n\r\n", b"\r\n" + LINES + b"\r\n", 1), b"more\r\n\r\n"]
