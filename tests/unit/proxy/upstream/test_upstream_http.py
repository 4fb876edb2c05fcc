"""The upstream HTTP/1.1 client against a loopback server that writes raw bytes: framing, the pool,
the retry rule, flow control in both directions and cancellation."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import pytest

from proxy.errors import UpstreamFailure
from proxy.settings import Timeouts
from proxy.source import UpstreamSnapshot
from proxy.upstream import connection as upstream_mod
from proxy.upstream.connection import Connection, UpstreamClosed
from proxy.upstream.pool import Upstream, UpstreamResponse
from tests.fakes.fake_upstream import eventually, snapshot_for
from tests.unit.proxy.raw_upstream import Handler, RawRequest, RawUpstream, answer_ok, ok

MiB = 1024 * 1024
# Any single await in these tests that takes longer than this is a hang, not a slow machine.
DEADLINE_S = 10.0


@pytest.fixture
async def up() -> AsyncIterator[Upstream]:
    client = Upstream(Timeouts(connect_s=2, first_token_s=30, total_s=60))
    yield client
    await client.aclose()


@pytest.fixture
async def servers() -> AsyncIterator[list[RawUpstream]]:
    started: list[RawUpstream] = []
    yield started
    for server in started:
        await server.stop()


async def start(servers: list[RawUpstream], handler: Handler) -> RawUpstream:
    server = await RawUpstream(handler).start()
    servers.append(server)
    return server


def snap(server: RawUpstream, secret: str = "s3cret", generation: int = 1) -> UpstreamSnapshot:
    return snapshot_for(server.base_url, secret, generation=generation)


async def call(up: Upstream, server: RawUpstream, method: str = "POST", **snap_changes: object) -> bytes:
    body = b"{}" if method == "POST" else None
    async with asyncio.timeout(DEADLINE_S):
        response = await up.open(snap(server, **snap_changes), method, "/x", body, "rid")  # type: ignore[arg-type]
        try:
            return await response.read()
        finally:
            response.release()


def conn_of(response: UpstreamResponse) -> Connection:
    conn = response._conn
    assert conn is not None
    return conn


def only_idle(up: Upstream) -> Connection:
    conns = [c for q in up._idle.values() for c in q]
    assert len(conns) == 1
    return conns[0]


def writes(data: bytes, keep: bool = True) -> Handler:
    async def handler(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(data)
        return keep

    return handler


# --- response framing -----------------------------------------------------------------------------------


async def test_body_ended_by_the_close_is_complete(up: Upstream, servers: list[RawUpstream]) -> None:
    """HTTP/1.0 (or any answer without Content-Length or chunking): the close is the end of the body."""
    server = await start(
        servers, writes(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close", False)
    )
    assert await call(up, server) == b"until close"
    assert up.idle_connections() == 0
    close_delimited = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close too"
    server = await start(servers, writes(close_delimited, False))
    assert await call(up, server) == b"until close too"


async def test_chunked_with_extensions_and_trailers_then_reuse(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-T\r\n\r\n"
        b'5;ext=1\r\nhello\r\n6;a=b;c="d"\r\n world\r\n0\r\nX-T: 1\r\n\r\n'
    )
    server = await start(servers, writes(chunked))
    assert await call(up, server) == b"hello world"
    assert await call(up, server) == b"hello world"
    assert server.connections == 1


async def test_statuses_without_a_body_complete_at_their_headers(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    answers = [
        b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
    ]

    async def handler(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(answers[request.nth - 1] if request.nth <= 2 else ok())
        return True

    server = await start(servers, handler)
    assert await call(up, server) == b""
    assert await call(up, server) == b""
    assert await call(up, server) == b"ok"
    assert server.connections == 1


async def test_head_answer_ends_at_its_headers(up: Upstream, servers: list[RawUpstream]) -> None:
    server = await start(servers, writes(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"))
    assert await call(up, server, method="HEAD") == b""


async def test_connection_close_answer_is_not_pooled(up: Upstream, servers: list[RawUpstream]) -> None:
    server = await start(servers, writes(ok(extra=b"Connection: close\r\n")))  # and keeps it open
    assert await call(up, server) == b"ok"
    assert up.idle_connections() == 0
    await call(up, server)
    assert server.connections == 2


async def test_interim_100_continue_is_skipped(up: Upstream, servers: list[RawUpstream]) -> None:
    server = await start(servers, writes(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"real")))
    async with asyncio.timeout(DEADLINE_S):
        response = await up.open(snap(server), "POST", "/x", b"{}", "rid")
        assert response.status == 200
        assert await response.read() == b"real"
        response.release()
    assert await call(up, server) == b"real"
    assert server.connections == 1


async def test_interim_answer_in_its_own_read_is_not_taken_for_the_answer(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    gate = asyncio.Event()

    async def handler(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
        await request.writer.drain()
        await gate.wait()
        request.writer.write(ok(b"real"))
        return True

    server = await start(servers, handler)
    task = asyncio.create_task(up.open(snap(server), "POST", "/x", b"{}", "r"))
    # The interim answer alone must not complete the request (bounded negative wait: no answer yet).
    done, _ = await asyncio.wait({task}, timeout=0.5)
    assert not done
    gate.set()
    async with asyncio.timeout(DEADLINE_S):
        response = await task
        assert response.status == 200
        assert await response.read() == b"real"
        response.release()


async def test_a_second_answer_in_the_same_read_is_not_appended(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    server = await start(servers, writes(ok(b"hi") + ok(b"yo")))
    assert await call(up, server) == b"hi"
    assert up.idle_connections() == 0  # its state is unknown: never reused


async def test_bytes_on_an_idle_connection_discard_it(up: Upstream, servers: list[RawUpstream]) -> None:
    server = await start(servers, answer_ok)
    assert await call(up, server) == b"ok 1.1"
    conn = only_idle(up)
    # An unsolicited, unfinished answer (some servers send 408 before closing an idle connection).
    server.writers[0].write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 50\r\n\r\n")
    await eventually(lambda: conn.closed, DEADLINE_S)
    assert await call(up, server) == b"ok 2.1"


async def test_close_in_the_middle_of_a_sized_body_raises(up: Upstream, servers: list[RawUpstream]) -> None:
    server = await start(servers, writes(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", False))
    with pytest.raises(UpstreamClosed):
        await call(up, server)
    assert up.idle_connections() == 0


async def test_oversized_answer_head_fails_fast(up: Upstream, servers: list[RawUpstream]) -> None:
    async def endless_header(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * MiB)
        await request.writer.drain()
        await asyncio.Event().wait()  # never finishes the head
        return False

    server = await start(servers, endless_header)
    with pytest.raises(UpstreamFailure):
        await call(up, server)
    assert up.idle_connections() == 0


async def test_unsafe_values_are_never_written(up: Upstream, servers: list[RawUpstream]) -> None:
    server = await start(servers, answer_ok)
    injected = "\r\nX-Evil: 1"
    with pytest.raises(ValueError):
        await up.open(snap(server), "GET", "/v1/models", None, "rid" + injected)
    with pytest.raises(ValueError):
        await up.open(snap(server), "GET", "/slots?a=b" + injected, None, "rid")
    with pytest.raises(ValueError):
        await up.open(snap(server), "GET /x HTTP/1.1" + injected, "/slots", None, "rid")
    with pytest.raises(UpstreamFailure):
        await up.open(snap(server, secret="s" + injected), "GET", "/v1/models", None, "rid")
    assert server.requests == []
    assert await call(up, server) == b"ok 1.1"  # nothing was poisoned


# --- pool, retry, restarts -----------------------------------------------------------------------------


async def test_retry_after_a_dead_reused_connection_uses_a_fresh_one(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    async def drops_reused(request: RawRequest) -> bool:
        if request.nth > 1:
            return False  # the idle-close race: closed just as the request arrives
        await request.body()
        request.writer.write(ok(b"fresh %d" % request.conn))
        return True

    server = await start(servers, drops_reused)
    first = await up.open(snap(server), "POST", "/x", b"{}", "r")
    second = await up.open(snap(server), "POST", "/x", b"{}", "r")
    for response in (first, second):
        await response.read()
        response.release()
    assert up.idle_connections() == 2  # both of which the child will drop
    # The newest idle one is tried and dropped; the retry must not try the other stale one.
    assert await call(up, server) == b"fresh 3"
    assert server.connections == 3


async def test_a_closing_idle_connection_is_not_handed_out(up: Upstream, servers: list[RawUpstream]) -> None:
    server = await start(servers, answer_ok)
    assert await call(up, server) == b"ok 1.1"
    conn = only_idle(up)
    assert conn.transport is not None
    # The state a peer's FIN leaves for one loop turn: transport closing, connection_lost not yet run.
    conn.transport.close()
    assert not conn.closed
    assert up._take_idle(("127.0.0.1", server.port)) is None
    assert await call(up, server) == b"ok 2.1"


async def test_new_child_on_the_same_port_drops_old_connections(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    server = await start(servers, answer_ok)
    assert await call(up, server, secret="old", generation=1) == b"ok 1.1"
    assert await call(up, server, secret="new", generation=2) == b"ok 2.1"
    assert server.requests[-1].headers["authorization"] == "Bearer new"
    await eventually(lambda: server.client_closed == 1, DEADLINE_S)  # the old child's connection


async def test_answer_finished_after_a_restart_is_not_pooled(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    server = await start(servers, answer_ok)
    old = await up.open(snap(server, generation=1), "POST", "/x", b"{}", "r")
    assert await call(up, server, generation=2) == b"ok 2.1"
    assert await old.read() == b"ok 1.1"
    old.release()
    assert up.idle_connections() == 1
    assert await call(up, server, generation=2) == b"ok 2.2"


# --- flow control --------------------------------------------------------------------------------------


async def test_a_slow_reader_bounds_what_is_buffered(up: Upstream, servers: list[RawUpstream]) -> None:
    size, piece = 48 * MiB, b"x" * (256 * 1024)

    async def big(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // len(piece)):
            request.writer.write(piece)
            await request.writer.drain()
        return True

    server = await start(servers, big)
    async with asyncio.timeout(DEADLINE_S):
        response = await up.open(snap(server), "POST", "/x", b"{}", "r")
        conn = conn_of(response)
        assert conn.transport is not None
        await eventually(lambda: not conn.transport.is_reading(), DEADLINE_S)  # type: ignore[union-attr]
        # Paused with at most the threshold plus one read (asyncio reads up to 256 KiB at a time).
        assert sum(map(len, conn._chunks)) <= 512 * 1024
        total = 0
        while (chunk := await response.next_chunk()) is not None:
            total += len(chunk)
        assert total == size
        response.release()
    assert up.idle_connections() == 1


async def test_releasing_a_paused_complete_answer_keeps_the_pool_healthy(
    up: Upstream, servers: list[RawUpstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upstream_mod, "_PAUSE_BYTES", 4096)
    monkeypatch.setattr(upstream_mod, "_RESUME_BYTES", 1024)
    many_chunks = b"".join(b"64\r\n" + b"e" * 100 + b"\r\n" for _ in range(100))

    async def handler(request: RawRequest) -> bool:
        await request.body()
        if request.nth == 1:  # one write: the whole answer arrives in one read, and pauses reading
            request.writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + many_chunks + b"0\r\n\r\n"
            )
        else:
            request.writer.write(ok())
        return True

    server = await start(servers, handler)
    async with asyncio.timeout(DEADLINE_S):
        response = await up.open(snap(server), "POST", "/x", b"{}", "r")
        conn = conn_of(response)
        await eventually(lambda: conn.complete, DEADLINE_S)
        assert conn.transport is not None and not conn.transport.is_reading()
        await response.next_chunk()
        response.release()  # the client left with most of the answer unread
    assert await call(up, server) == b"ok"


async def test_a_large_upload_respects_write_flow_control(up: Upstream, servers: list[RawUpstream]) -> None:
    size = 32 * MiB
    gate = asyncio.Event()
    got: dict[str, object] = {}

    async def handler(request: RawRequest) -> bool:
        if request.nth > 1:
            await gate.wait()  # not reading: the upload must wait in the proxy, not pile up in its buffer
        body = await request.body()
        got["size"], got["sha"] = len(body), hashlib.sha256(body).hexdigest()
        request.writer.write(ok())
        return True

    server = await start(servers, handler)
    await call(up, server)
    conn = only_idle(up)
    assert conn.transport is not None
    payload = bytes(range(256)) * (size // 256)
    task = asyncio.create_task(up.open(snap(server), "POST", "/upload", payload, "r"))
    await eventually(lambda: len(server.requests) == 2, DEADLINE_S)
    assert conn.transport.get_write_buffer_size() <= MiB
    gate.set()
    async with asyncio.timeout(DEADLINE_S):
        response = await task
        assert await response.read() == b"ok"
        response.release()
    assert got == {"size": size, "sha": hashlib.sha256(payload).hexdigest()}
    assert up.idle_connections() == 1


async def test_an_early_answer_during_an_upload_is_not_pooled(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    async def refuse_early(request: RawRequest) -> bool:
        request.writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 3\r\n\r\nbig")
        await asyncio.Event().wait()  # keeps the connection open and never reads the body
        return False

    server = await start(servers, refuse_early)
    async with asyncio.timeout(DEADLINE_S):
        response = await up.open(snap(server), "POST", "/x", b"u" * (32 * MiB), "r")
        assert response.status == 413
        assert await response.read() == b"big"
        response.release()
    assert up.idle_connections() == 0  # part of the upload was never sent: the connection is unusable


# --- cancellation --------------------------------------------------------------------------------------


async def test_cancel_while_waiting_for_the_answer_closes_the_connection(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    hung_up = asyncio.Event()

    async def slow(request: RawRequest) -> bool:
        await request.body()
        await request.reader.read()  # returns at EOF: the proxy hung up
        hung_up.set()
        return False

    server = await start(servers, slow)
    task = asyncio.create_task(up.open(snap(server), "POST", "/x", b"{}", "r"))
    await eventually(lambda: len(server.requests) == 1, DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(hung_up.wait(), DEADLINE_S)
    assert up.idle_connections() == 0


async def test_cancel_during_an_upload_closes_the_connection(
    up: Upstream, servers: list[RawUpstream]
) -> None:
    hung_up = asyncio.Event()

    async def never_reads(request: RawRequest) -> bool:
        await hung_up.wait()
        return False

    server = await start(servers, never_reads)
    task = asyncio.create_task(up.open(snap(server), "POST", "/x", b"u" * (32 * MiB), "r"))
    await eventually(lambda: len(server.requests) == 1, DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    reader = server.requests[0].reader
    try:
        async with asyncio.timeout(DEADLINE_S):
            while await reader.read(MiB):
                pass  # the rest of what was sent, then EOF
    except ConnectionResetError:
        pass  # or the proxy's abort arrives as a reset
    hung_up.set()
    assert up.idle_connections() == 0
