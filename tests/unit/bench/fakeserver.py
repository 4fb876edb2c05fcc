"""A fake OpenAI-compatible streaming server for the harness's unit tests (httpx.MockTransport).

It admits ``slots`` requests at once; with ``reject_over`` it answers 429 to requests beyond that many
in flight (like llamagate's admission), otherwise they wait (like bare llama-server). Every request
streams ``tokens`` content events ``gap_s`` apart.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


class FakeServer:
    def __init__(
        self, slots: int = 2, tokens: int = 4, gap_s: float = 0.002, reject_over: int | None = None
    ) -> None:
        self.slots = asyncio.Semaphore(slots)
        self.tokens = tokens
        self.gap_s = gap_s
        self.reject_over = reject_over
        self.in_flight = 0
        self.requests: list[dict[str, Any]] = []
        self.rejected = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model", "meta": {}}]})
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, json={"error": {"message": "not found", "code": 404}})
        body = json.loads(request.content)
        self.requests.append(body)
        if self.reject_over is not None and self.in_flight >= self.reject_over:
            self.rejected += 1
            return httpx.Response(
                429, json={"error": {"message": "queue full", "code": 429}}, headers={"Retry-After": "1"}
            )
        self.in_flight += 1
        return httpx.Response(200, content=self._stream(), headers={"content-type": "text/event-stream"})

    async def _stream(self) -> AsyncIterator[bytes]:
        try:
            async with self.slots:
                for i in range(self.tokens):
                    await asyncio.sleep(self.gap_s)
                    event = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
                    yield f"data: {json.dumps(event)}\n\n".encode()
                usage = {"prompt_tokens": 7, "completion_tokens": self.tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
