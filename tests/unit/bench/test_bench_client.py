"""One timed streaming exchange against a fake OpenAI-compatible server (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from supervisor.bench.client import Target, stream_chat, time_reply


def sse(*events: Any, done: bool = True) -> list[bytes]:
    out = [b": keep-alive\n\n"]
    out += [f"data: {json.dumps(e)}\n\n".encode() for e in events]
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}
TIMINGS = {
    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    "timings": {"prompt_n": 12, "prompt_ms": 5.5, "predicted_n": 3, "predicted_ms": 30.0, "cache_n": 0},
}


class FakeClock:
    """Advances one second per reading, so every timestamp is distinct and predictable."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def client_for(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def streaming(parts: list[bytes], status: int = 200, headers: dict[str, str] | None = None) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    return httpx.Response(status, content=body(), headers=headers or {"content-type": "text/event-stream"})


TARGET = Target("http://bench.test", "k-123")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_ok_stream_is_timed_and_counted() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streaming(
            sse(
                {"choices": [{"delta": {"role": "assistant"}}]},
                chunk("a"),
                chunk("b"),
                chunk("c"),
                TIMINGS,
                USAGE,
            )
        )

    clock = FakeClock()
    async with client_for(handler) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0, clock)
    assert ex.outcome == "ok" and ex.error is None and ex.status == 200
    assert seen[0].url == "http://bench.test/v1/chat/completions"
    assert seen[0].headers["authorization"] == "Bearer k-123"
    # clock readings: send=101, role event=102, a=103, b=104, c=105, timings, usage, [DONE], end
    assert ex.t_send == 101.0
    assert ex.t_first_content == 103.0
    assert ex.t_last_content == 105.0
    assert ex.t_end is not None and ex.t_end > ex.t_last_content
    assert ex.content_events == 3
    assert (ex.prompt_tokens, ex.completion_tokens) == (12, 3)
    assert ex.server is not None and ex.server.predicted_ms == 30.0


async def test_base_url_with_v1_is_not_doubled() -> None:
    urls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        urls.append(str(request.url))
        return streaming(sse(chunk("x"), USAGE))

    async with client_for(handler) as client:
        await stream_chat(client, Target("http://bench.test/v1/"), BODY, 30.0)
    assert urls == ["http://bench.test/v1/chat/completions"]


async def test_no_key_sends_no_authorization() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return streaming(sse(chunk("x"), USAGE))

    async with client_for(handler) as client:
        await stream_chat(client, Target("http://bench.test"), BODY, 30.0)
    assert "authorization" not in seen[0].headers


async def test_429_is_a_rejection_with_retry_after() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"error": {"message": "tenant queue is full", "type": "rate_limit_error", "code": 429}}
        return httpx.Response(429, json=body, headers={"Retry-After": "3"})

    async with client_for(handler) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert ex.outcome == "rejected"
    assert ex.status == 429
    assert ex.error == "tenant queue is full"
    assert ex.retry_after_s == 3.0
    assert ex.t_first_content is None and ex.t_end is not None


async def test_503_is_a_rejection() -> None:
    async with client_for(lambda r: httpx.Response(503, text="Loading model")) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert (ex.outcome, ex.status, ex.error) == ("rejected", 503, "Loading model")


async def test_400_is_a_failure() -> None:
    body = {"error": {"message": "the request exceeds the available context size", "code": 400}}
    async with client_for(lambda r: httpx.Response(400, json=body)) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert ex.outcome == "failed" and ex.status == 400
    assert ex.error is not None and "context size" in ex.error


async def test_error_event_mid_stream_is_a_failure() -> None:
    parts = sse(chunk("a"), {"error": {"code": 500, "message": "slot died"}}, done=False)
    async with client_for(lambda r: streaming(parts)) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert ex.outcome == "failed"
    assert ex.error == "slot died"
    assert ex.t_first_content is not None


async def test_stream_without_done_is_a_failure() -> None:
    async with client_for(lambda r: streaming(sse(chunk("a"), done=False))) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert ex.outcome == "failed"
    assert ex.error == "stream ended without [DONE]"


async def test_malformed_event_is_a_failure() -> None:
    async with client_for(lambda r: streaming([b"data: {not json\n\n"])) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert (ex.outcome, ex.error) == ("failed", "malformed SSE event")


async def test_connection_error_is_a_failure_not_an_exception() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with client_for(handler) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert ex.outcome == "failed" and ex.status is None
    assert ex.error is not None and ex.error.startswith("ConnectError")
    assert ex.t_end is not None


async def test_client_deadline_gives_timeout_record() -> None:
    async def slow() -> AsyncIterator[bytes]:
        yield b"data: " + json.dumps(chunk("a")).encode() + b"\n\n"
        await asyncio.sleep(30)
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=slow())

    async with client_for(handler) as client:
        ex = await stream_chat(client, TARGET, BODY, 0.2)
    assert ex.outcome == "timeout"
    assert ex.error == "no complete response within 0.2 s"
    assert ex.t_first_content is not None


async def test_completion_tokens_fall_back_to_server_timings() -> None:
    async with client_for(lambda r: streaming(sse(chunk("a"), TIMINGS))) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert ex.outcome == "ok"
    assert ex.completion_tokens == 3 and ex.prompt_tokens is None


async def test_reasoning_content_counts_as_first_token() -> None:
    thinking = {"choices": [{"delta": {"reasoning_content": "hmm"}}]}
    clock = FakeClock()
    async with client_for(lambda r: streaming(sse(thinking, chunk("a"), USAGE))) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0, clock)
    assert ex.t_first_content == 102.0
    assert ex.content_events == 2


async def test_long_error_bodies_are_truncated() -> None:
    async with client_for(lambda r: httpx.Response(500, text="x" * 5000)) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0)
    assert ex.error is not None and len(ex.error) <= 300


@pytest.mark.parametrize(
    ("url", "api", "server"),
    [
        ("http://h:1", "http://h:1/v1", "http://h:1"),
        ("http://h:1/", "http://h:1/v1", "http://h:1"),
        ("http://h:1/v1", "http://h:1/v1", "http://h:1"),
    ],
)
def test_target_roots(url: str, api: str, server: str) -> None:
    t = Target(url)
    assert (t.api_root, t.server_root) == (api, server)


def test_an_answer_read_by_another_client_is_timed_the_same_way() -> None:
    """``time_reply`` (the proxy cost benchmark's lean transport) reads what ``stream_chat`` reads: a line
    is timed at the chunk that completes it, even when an event is split across chunks."""
    first, second = (f"data: {json.dumps(chunk(t))}\n\n".encode() for t in ("a", "b"))
    chunks = [
        (1.0, b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'),
        (2.0, first[:10]),
        (3.0, first[10:]),
        (4.0, second + f"data: {json.dumps(TIMINGS)}\n\n".encode()),
        (5.0, b"data: [DONE]\n\n"),
    ]
    ex = time_reply(200, None, b"", chunks, 0.5, 6.0)
    assert (ex.outcome, ex.status, ex.error) == ("ok", 200, None)
    assert (ex.t_send, ex.t_first_content, ex.t_last_content, ex.t_end) == (0.5, 3.0, 4.0, 5.0)
    assert ex.content_events == 2 and ex.completion_tokens == 3


def test_a_refusal_and_a_cut_stream_read_by_another_client() -> None:
    body = json.dumps({"error": {"message": "tenant queue is full", "code": 429}}).encode()
    refused = time_reply(429, "2", body, [], 1.0, 1.25)
    assert (refused.outcome, refused.reason) == ("rejected", "HTTP 429")
    assert refused.error == "tenant queue is full"
    assert (refused.retry_after_s, refused.t_end) == (2.0, 1.25)
    cut = time_reply(200, None, b"", [(2.0, f"data: {json.dumps(chunk('a'))}\n\n".encode())], 1.0, 3.0)
    assert (cut.outcome, cut.reason, cut.t_end) == ("failed", "stream ended without [DONE]", 3.0)


async def test_a_client_that_leaves_after_the_first_token_closes_the_stream() -> None:
    sent: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        for i, text in enumerate(("a", "b", "c")):
            sent.append(i)
            yield f"data: {json.dumps(chunk(text))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async with client_for(lambda r: httpx.Response(200, content=body())) as client:
        ex = await stream_chat(client, TARGET, BODY, 30.0, leave_after_first=True)
    assert ex.left and ex.outcome == "cancelled" and ex.content_events == 1
    assert sent == [0]  # nothing more was read off the connection
