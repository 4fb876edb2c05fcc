"""A fast fake of llama-server's HTTP API, for the proxy cost benchmark and the proxy's unit tests.

It speaks just enough of the real thing (same routes, same SSE event shapes, same error shape, same
``Authorization: Bearer`` check) and costs almost no CPU, so that what a benchmark measures is the proxy.
It is not a model: the "tokens" are a fixed word. Per-request switches ride in the JSON body (the proxy
forwards bodies untouched), so a test can ask one request to misbehave:

- ``fake_status``: answer with this HTTP status and llama-server's error shape;
- ``fake_delay_ms``: wait this long before the answer starts (a long prompt);
- ``fake_token_interval_ms``: time between streamed tokens (default: the server's setting);
- ``fake_die_after``: abort the connection after this many token events (a child killed mid-stream);
- ``fake_end_after_ms``: wait this long between a stream's last event and its end (llama-server writes
  them apart, so a client may have ``[DONE]`` well before the proxy reads the end).

A fault of the fake itself (not of one request: a request run again on another fake carries the same
body) is an attribute: ``die_at_token`` aborts the connection of every streamed answer after that many
token events (0: after the headers, before any event, as a child killed during the prompt), calling
``on_death`` first (a test's stand-in for the supervisor noticing); ``deaths`` counts them.

It counts what a test wants to observe: requests in progress (and the maximum seen), requests whose
client went away, and the headers of the last request.

Run standalone: ``python -m tests.fakes.fake_llama --port N [--secret S] [--token-interval-ms X]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

_WORD = "tok"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeLlama:
    def __init__(
        self,
        *,
        secret: str | None = None,
        alias: str = "gemma-3-270m",
        slots: int = 4,
        ctx_per_slot: int = 4096,
        tokens: int = 16,
        token_interval_s: float = 0.0,
    ) -> None:
        self.secret = secret
        self.alias = alias
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.tokens = tokens
        self.token_interval_s = token_interval_s
        # A chat stream's answer as this text, cut into pieces at spaces (the pieces are the tokens),
        # instead of the fixed word: for a client that must show any text safely (the page's test).
        self.answer: str | None = None
        self.active = 0
        self.max_active = 0
        self.requests = 0
        self.client_gone = 0
        self.last_headers: dict[str, str] = {}
        self.last_body = b""
        # Connection-level faults: "drop_reused" closes a kept-alive connection when its second request
        # arrives, unanswered (llama-server's idle close racing a reuse); "drop_all": every request.
        self.drop: str | None = None
        # Close each connection once its answer is sent, as the real child does (a new one a request).
        self.close_after_answer = False
        self.connections = 0
        self.die_at_token: int | None = None
        self.on_death: Callable[[], None] | None = None
        self.deaths = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Close the listener and every open connection (as a killed child would)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            # Let each connection handler see its closed socket and return (a cancelled one is logged
            # as an error by asyncio's stream callback).
            if self._handlers:
                await asyncio.wait(set(self._handlers), timeout=2.0)
            await self._server.wait_closed()

    # --- one connection, keep-alive ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self.connections += 1
        served = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                self.last_headers = headers
                self.last_body = body
                served += 1
                if self.drop == "drop_all" or (self.drop == "drop_reused" and served > 1):
                    return
                if not await self._dispatch(method, path, headers, body, reader, writer):
                    return
                if self.close_after_answer:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            if task is not None:
                self._handlers.discard(task)
            writer.transport.abort()

    async def _dispatch(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        path = path.split("?", 1)[0]
        if path == "/health":
            return self._json(writer, 200, {"status": "ok"})
        if self.secret is not None and headers.get("authorization") != f"Bearer {self.secret}":
            return self._error(writer, 401, "Invalid API Key", "authentication_error")
        if path == "/v1/models" and method == "GET":
            model = {
                "id": self.alias,
                "object": "model",
                "owned_by": "llamacpp",
                "meta": {"n_ctx": self.ctx_per_slot},
            }
            return self._json(writer, 200, {"object": "list", "data": [model]})
        if path == "/slots":
            slots = [
                {"id": i, "n_ctx": self.ctx_per_slot, "is_processing": i < self.active}
                for i in range(self.slots)
            ]
            return self._json(writer, 200, slots)
        if path == "/props":
            return self._json(writer, 200, {"total_slots": self.slots, "build_info": "fake"})
        if path == "/metrics":
            text = f"llamacpp:requests_processing {self.active}\n".encode()
            return self._send(writer, 200, text, b"text/plain; version=0.0.4")
        try:
            payload: Any = json.loads(body) if body else {}
        except ValueError:
            return self._error(writer, 500, "invalid JSON", "server_error")
        if path == "/tokenize":
            return self._json(
                writer, 200, {"tokens": list(range(len(str(payload.get("content", "")).split())))}
            )
        if path == "/v1/chat/completions/input_tokens":
            words = sum(len(str(m.get("content", "")).split()) for m in payload.get("messages", []))
            return self._json(writer, 200, {"input_tokens": words + 8})
        if path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
            return await self._complete(path, payload, reader, writer)
        return self._error(writer, 404, "File Not Found", "not_found_error")

    # --- responses ---------------------------------------------------------------------------------------
    def _send(self, writer: asyncio.StreamWriter, status: int, data: bytes, content_type: bytes) -> bool:
        writer.write(
            b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\nKeep-Alive: timeout=5\r\n\r\n%s"
            % (status, content_type, len(data), data)
        )
        return True

    def _json(self, writer: asyncio.StreamWriter, status: int, obj: object) -> bool:
        data = json.dumps(obj, separators=(",", ":")).encode()
        return self._send(writer, status, data, b"application/json; charset=utf-8")

    def _error(self, writer: asyncio.StreamWriter, status: int, message: str, kind: str) -> bool:
        return self._json(writer, status, {"error": {"code": status, "message": message, "type": kind}})

    async def _complete(
        self, path: str, payload: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        self.requests += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            status = int(payload.get("fake_status", 200))
            if status != 200:
                return self._error(writer, status, "fake error", "invalid_request_error")
            delay = float(payload.get("fake_delay_ms", 0)) / 1000.0
            if delay and not await self._wait(delay, reader, writer):
                return False
            n = int(payload.get("max_tokens") or self.tokens)
            if payload.get("stream") is True:
                return await self._stream(path, payload, n, reader, writer)
            chat = path == "/v1/chat/completions"
            text = " ".join([_WORD] * n)
            choice: dict[str, object] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            usage = {
                "completion_tokens": n,
                "prompt_tokens": 8,
                "total_tokens": n + 8,
                "prompt_tokens_details": {"cached_tokens": 3},
            }
            answer = {"choices": [choice], "model": self.alias, "object": "x", "usage": usage, "id": "fake"}
            return self._json(writer, 200, answer)
        finally:
            self.active -= 1

    async def _wait(self, seconds: float, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Sleep, but notice a client that goes away meanwhile (llama-server does, within about 1 s)."""
        deadline = time.monotonic() + seconds
        while True:
            if reader.at_eof() or writer.transport.is_closing():
                self.client_gone += 1
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            await asyncio.sleep(min(left, 0.02))

    async def _stream(
        self,
        path: str,
        payload: dict[str, Any],
        n: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        chat = path == "/v1/chat/completions"
        interval = float(payload.get("fake_token_interval_ms", self.token_interval_s * 1000.0)) / 1000.0
        die_after = payload.get("fake_die_after")
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        tail = b'],"created":1,"id":"chatcmpl-fake","model":"%s","object":"%s"' % (self.alias.encode(), obj)
        if self.die_at_token is not None:
            die_after = self.die_at_token
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Keep-Alive: timeout=5\r\n\r\n"
        )
        if die_after is not None and int(die_after) == 0:
            await writer.drain()  # the headers are out, as llama-server's are when the prompt starts
            return self._die(writer)
        if chat:
            first = b'{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}'
            writer.write(_chunk(b'data: {"choices":[' + first + tail + b"}\n\n"))
        # The pieces join to the non-streamed text ("tok tok tok"), as the real server's deltas do.
        events = [
            _chunk(
                b'data: {"choices":['
                + (
                    b'{"finish_reason":null,"index":0,"delta":{"content":"%s"}}' % word
                    if chat
                    else b'{"text":"%s","index":0,"logprobs":null,"finish_reason":null}' % word
                )
                + tail
                + b"}\n\n"
            )
            for word in (_WORD.encode(), b" " + _WORD.encode())
        ]
        if chat and self.answer is not None:
            pieces = re.findall(r"\s*\S+", self.answer) or [""]
            delta = b'{"finish_reason":null,"index":0,"delta":{"content":%s}}'
            events = [
                _chunk(b'data: {"choices":[' + delta % json.dumps(p).encode() + tail + b"}\n\n")
                for p in pieces
            ]
            n = len(events)
        for i in range(n):
            event = events[min(i, len(events) - 1)]
            if die_after is not None and i >= int(die_after):
                await writer.drain()
                return self._die(writer)
            if interval:
                await writer.drain()
                if not await self._wait(interval, reader, writer):
                    return False
            writer.write(event)
            if i % 16 == 15:
                await writer.drain()
        usage = (
            b'"usage":{"completion_tokens":%d,"prompt_tokens":8,"total_tokens":%d,'
            b'"prompt_tokens_details":{"cached_tokens":3}}' % (n, n + 8)
        )
        timings = b'"timings":{"cache_n":3,"prompt_n":5,"predicted_n":%d,"predicted_ms":1.0}' % n
        last = (
            b'{"finish_reason":"length","index":0,"delta":{}}'
            if chat
            else b'{"text":"","index":0,"finish_reason":"length"}'
        )
        # As llama-server: the timings go on the last chunk, which is the usage chunk when one is asked for.
        if (payload.get("stream_options") or {}).get("include_usage"):
            writer.write(_chunk(b'data: {"choices":[' + last + tail + b"}\n\n"))
            writer.write(_chunk(b'data: {"choices":[' + tail + b"," + usage + b"," + timings + b"}\n\n"))
        else:
            writer.write(_chunk(b'data: {"choices":[' + last + tail + b"," + timings + b"}\n\n"))
        end_after = float(payload.get("fake_end_after_ms", 0)) / 1000.0
        if end_after:
            writer.write(_chunk(b"data: [DONE]\n\n"))
            await writer.drain()
            if not await self._wait(end_after, reader, writer):
                return False
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        return True

    def _die(self, writer: asyncio.StreamWriter) -> bool:
        self.deaths += 1
        if self.on_death is not None:
            self.on_death()
        writer.transport.abort()
        return False


async def _main(args: argparse.Namespace) -> None:
    fake = FakeLlama(
        secret=args.secret,
        tokens=args.tokens,
        token_interval_s=args.token_interval_ms / 1000.0,
        slots=args.slots,
    )
    fake.answer = args.answer
    port = await fake.start(port=args.port)
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="fake llama-server for benchmarks and tests")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--token-interval-ms", type=float, default=0.0)
    parser.add_argument("--answer", default=None, help="every chat stream answers this text")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
