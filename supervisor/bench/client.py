"""One streaming chat completion, timed per SSE event, against any OpenAI-compatible base URL.

Plain httpx rather than the openai SDK: the SDK's parsing layers sit between the socket and the clock,
and the load generator needs the arrival time of each event at low overhead. Only timings, counts,
status and a short error string are kept: never the prompt or the completion text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from supervisor.bench.records import REJECT_STATUSES, Outcome, ServerTimings

ERROR_CHARS = 300


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8080 (with or without a trailing /v1)
    api_key: str | None = None

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root if root.endswith("/v1") else root + "/v1"

    @property
    def server_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Exchange:
    """What happened on the wire; monotonic seconds (absolute, the caller rebases them)."""

    outcome: Outcome = "failed"
    t_send: float | None = None
    t_first_content: float | None = None
    t_last_content: float | None = None
    t_end: float | None = None
    status: int | None = None
    error: str | None = None
    retry_after_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content_events: int = 0
    server: ServerTimings | None = None
    t_done: float | None = None  # when [DONE] arrived

    @property
    def done(self) -> bool:
        return self.t_done is not None


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def _error_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return _short(body.decode("utf-8", "replace"))
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return _short(str(obj["error"].get("message", obj["error"])))
    return _short(json.dumps(obj))


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None  # an HTTP-date; rare enough not to parse


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _absorb(ex: Exchange, event: dict[str, Any], now: float) -> None:
    if "error" in event:
        err = event["error"]
        ex.error = _short(str(err.get("message", err) if isinstance(err, dict) else err))
        return
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        # reasoning_content counts as output: a thinking model's first token is still the first token.
        if delta.get("content") or delta.get("reasoning_content"):
            if ex.t_first_content is None:
                ex.t_first_content = now
            ex.t_last_content = now
            ex.content_events += 1
    usage = event.get("usage")
    if isinstance(usage, dict):
        ex.prompt_tokens = _int(usage.get("prompt_tokens"))
        ex.completion_tokens = _int(usage.get("completion_tokens"))
    timings = event.get("timings")
    if isinstance(timings, dict):
        ex.server = ServerTimings(
            prompt_n=_int(timings.get("prompt_n")),
            prompt_ms=_float(timings.get("prompt_ms")),
            predicted_n=_int(timings.get("predicted_n")),
            predicted_ms=_float(timings.get("predicted_ms")),
            cache_n=_int(timings.get("cache_n")),
        )


async def _consume(response: httpx.Response, ex: Exchange, clock: Callable[[], float]) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators and ': keep-alive' comments
        now = clock()
        payload = line[5:].strip()
        if payload == "[DONE]":
            # The answer is complete now; read on to the end of the body (the server ends it right
            # after) so the connection is closed cleanly rather than torn down mid-stream.
            ex.t_done = now
            continue
        if ex.t_done is not None:
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            ex.error = "malformed SSE event"
            return
        if isinstance(event, dict):
            _absorb(ex, event, now)
            if ex.error is not None:
                return


async def stream_chat(
    client: httpx.AsyncClient,
    target: Target,
    body: dict[str, Any],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> Exchange:
    """Send ``body`` (stream forced on) and time it; never raises except for cancellation."""
    ex = Exchange()
    ex.t_send = clock()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST", target.api_root + "/chat/completions", json=body, headers=target.headers()
            ) as response:
                ex.status = response.status_code
                if response.status_code != 200:
                    ex.error = _error_message(await response.aread())
                    ex.retry_after_s = _retry_after(response.headers.get("retry-after"))
                    ex.outcome = "rejected" if response.status_code in REJECT_STATUSES else "failed"
                    return ex
                await _consume(response, ex, clock)
        if ex.error is None and not ex.done:
            ex.error = "stream ended without [DONE]"
        ex.outcome = "ok" if ex.error is None else "failed"
    except TimeoutError:
        ex.outcome = "timeout"
        ex.error = f"no complete response within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        ex.outcome = "failed"
        ex.error = _short(f"{type(exc).__name__}: {exc}")
    finally:
        ex.t_end = ex.t_done if ex.t_done is not None else clock()
    if ex.completion_tokens is None and ex.server is not None:
        ex.completion_tokens = ex.server.predicted_n
    return ex
