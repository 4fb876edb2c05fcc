"""The upstream client against the fake llama-server on a loopback socket: reuse, the one retry, faults."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from proxy.errors import UpstreamFailure, UpstreamUnreachable
from proxy.settings import Timeouts
from proxy.upstream import pool as upstream_mod
from proxy.upstream.connection import UpstreamClosed
from proxy.upstream.pool import Upstream
from tests.fakes.fake_upstream import FakeLlama, eventually, snapshot_for

BODY = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}'


@pytest.fixture
async def fake() -> AsyncIterator[FakeLlama]:
    server = FakeLlama(secret="s3cret", tokens=3)
    await server.start()
    yield server
    await server.stop()


async def call(
    up: Upstream, fake: FakeLlama, body: bytes = BODY, path: str = "/v1/chat/completions"
) -> bytes:
    response = await up.open(snapshot_for(fake.base_url, "s3cret"), "POST", path, body, "rid-1")
    try:
        assert response.status == 200, await response.read()
        return await response.read()
    finally:
        response.release()


async def test_sends_secret_and_request_id_and_reuses_the_connection(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    for _ in range(3):
        assert b"tok" in await call(up, fake)
    assert fake.connections == 1
    assert fake.last_headers["authorization"] == "Bearer s3cret"
    assert fake.last_headers["x-request-id"] == "rid-1"
    assert "x-conversation-id" not in fake.last_headers
    await up.aclose()


async def test_streamed_body_arrives_in_pieces(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    body = b'{"stream":true,"max_tokens":40,"fake_token_interval_ms":1}'
    response = await up.open(snapshot_for(fake.base_url, "s3cret"), "POST", "/v1/completions", body, "r")
    assert response.content_type == b"text/event-stream"
    pieces = []
    while (chunk := await response.next_chunk()) is not None:
        pieces.append(chunk)
    response.release()
    assert len(pieces) > 10  # not buffered into one
    assert b"".join(pieces).endswith(b"data: [DONE]\n\n")
    await up.aclose()


async def test_stale_keepalive_is_retried_once_on_a_new_connection(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    await call(up, fake)
    fake.drop = "drop_reused"  # the child closes the idle connection just as we reuse it
    assert b"tok" in await call(up, fake)
    assert fake.connections == 2
    await up.aclose()


async def test_a_fresh_connection_that_dies_is_not_retried(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    fake.drop = "drop_all"
    with pytest.raises(UpstreamFailure) as info:
        await call(up, fake)
    assert info.value.status == 502
    assert fake.connections == 1  # the request may have reached the child: no second attempt
    await up.aclose()


async def test_reused_then_fresh_failure_is_retried_exactly_once(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    await call(up, fake)
    fake.drop = "drop_all"
    with pytest.raises(UpstreamFailure):
        await call(up, fake)
    assert fake.connections == 2
    await up.aclose()


async def test_unreachable_child() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        up = Upstream(Timeouts())
        with pytest.raises(UpstreamUnreachable) as info:
            await up.open(snapshot_for(f"http://127.0.0.1:{port}", None), "GET", "/v1/models", None, "r")
        assert "not accepting connections" in info.value.message
        # Nothing was sent: a 503 a load balancer may retry elsewhere, unlike a 502 after sending.
        assert info.value.status == 503 and info.value.headers == {"retry-after": "1"}
    await up.aclose()


async def test_expired_idle_connections_are_not_reused(
    fake: FakeLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upstream_mod, "KEEPALIVE_EXPIRY_S", 0.0)
    up = Upstream(Timeouts())
    await call(up, fake)
    await call(up, fake)
    assert fake.connections == 2
    await up.aclose()


async def test_connection_closed_by_the_child_while_idle_is_dropped(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    await call(up, fake)
    for writer in list(fake._writers):
        writer.transport.abort()
    await eventually(lambda: all(c.closed for q in up._idle.values() for c in q))
    await call(up, fake)
    assert fake.connections == 2
    await up.aclose()


async def test_releasing_an_unfinished_stream_closes_its_connection(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    body = b'{"stream":true,"max_tokens":1000,"fake_token_interval_ms":5}'
    response = await up.open(snapshot_for(fake.base_url, "s3cret"), "POST", "/v1/completions", body, "r")
    await response.next_chunk()
    response.release()
    response.release()  # idempotent
    await eventually(lambda: fake.client_gone == 1)
    assert up.idle_connections() == 0
    await up.aclose()


async def test_child_dying_mid_body_raises_closed(fake: FakeLlama) -> None:
    up = Upstream(Timeouts())
    body = b'{"stream":true,"max_tokens":50,"fake_die_after":3}'
    response = await up.open(snapshot_for(fake.base_url, "s3cret"), "POST", "/v1/completions", body, "r")
    with pytest.raises(UpstreamClosed):
        while await response.next_chunk() is not None:
            pass
    response.release()
    await up.aclose()


async def test_a_new_child_drops_connections_to_the_old_one(fake: FakeLlama) -> None:
    other = FakeLlama(secret="s3cret")
    await other.start()
    up = Upstream(Timeouts())
    await call(up, fake)
    assert up.idle_connections() == 1
    await call(up, other)
    assert up.idle_connections() == 1
    assert list(up._idle) == [("127.0.0.1", other.port)]
    await up.aclose()
    await other.stop()


async def test_two_models_children_taking_turns_keep_their_connections(fake: FakeLlama) -> None:
    # One pool for every model (the door's): requests to two children in turn must not close each
    # other's idle connections, as a pool that knew one child at a time did on every switch.
    other = FakeLlama(secret="s3cret", tokens=3)
    await other.start()
    up = Upstream(Timeouts())
    chat, embed = (
        snapshot_for(fake.base_url, "s3cret", model_alias="chat"),
        snapshot_for(other.base_url, "s3cret", model_alias="embed"),
    )
    try:
        for _ in range(3):
            for snap in (chat, embed):
                response = await up.open(snap, "POST", "/v1/chat/completions", BODY, "r")
                assert response.status == 200 and b"tok" in await response.read()
                response.release()
        assert (fake.connections, other.connections) == (1, 1)
        assert up.idle_connections() == 2
        # A child of one model replaced (a new generation): only that model's connections go.
        up._target(snapshot_for(other.base_url, "s3cret", model_alias="embed", generation=2))
        assert list(up._idle) == [("127.0.0.1", fake.port)]
    finally:
        await up.aclose()
        await other.stop()


async def test_malformed_http_from_the_child() -> None:
    handled = asyncio.Event()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SPLAT nonsense\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the proxy hangs up on the nonsense
        writer.close()
        handled.set()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    up = Upstream(Timeouts())
    with pytest.raises(UpstreamFailure):
        await up.open(snapshot_for(f"http://127.0.0.1:{port}", None), "GET", "/v1/models", None, "r")
    await up.aclose()
    await asyncio.wait_for(handled.wait(), 5)
    server.close()
    await server.wait_closed()
