"""One streaming chat completion, timed per SSE event, against any OpenAI-compatible base URL: the one
stream timer every benchmark uses.

``stream_chat`` sends it over httpx. Plain httpx rather than the openai SDK: the SDK's parsing layers sit
between the socket and the clock, and the load generator needs the arrival time of each event at low
overhead. A benchmark with a leaner transport of its own (the proxy cost benchmark, which must leave the
cores to the proxy) hands the answer it received, with each chunk's arrival time, to ``time_reply``,
which reads it with the same code: every TTFT, token count and failure is read from the wire one way.
Only timings, counts, status and a short error string are kept: never the prompt or the completion text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
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
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the answer says
    content_events: int = 0
    # The answer's text, kept only when asked (``stream_chat(keep_text=True)``: a conversation sends it back).
    text: list[str] | None = None
    server: ServerTimings | None = None
    t_done: float | None = None  # when [DONE] arrived
    # What went wrong, short enough to count by (``error`` says it for a reader): "HTTP 502",
    # "error event mid-stream", "stream ended without [DONE]", "malformed SSE event", "timeout" or the
    # transport error's type ("ReadError").
    reason: str | None = None
    left: bool = False  # the client closed the stream itself after the first token (leave_after_first)

    @property
    def done(self) -> bool:
        return self.t_done is not None

    def fail(self, reason: str, error: str | None = None) -> None:
        self.reason = reason
        self.error = error or reason


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
        ex.fail(
            "error event mid-stream", _short(str(err.get("message", err) if isinstance(err, dict) else err))
        )
        return
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        # reasoning_content counts as output: a thinking model's first token is still the first token.
        if delta.get("content") or delta.get("reasoning_content"):
            if ex.t_first_content is None:
                ex.t_first_content = now
            ex.t_last_content = now
            ex.content_events += 1
            if ex.text is not None and isinstance(delta.get("content"), str):
                ex.text.append(delta["content"])
    usage = event.get("usage")
    if isinstance(usage, dict):
        ex.prompt_tokens = _int(usage.get("prompt_tokens"))
        ex.completion_tokens = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            ex.cached_tokens = _int(details.get("cached_tokens"))
    timings = event.get("timings")
    if isinstance(timings, dict):
        ex.server = ServerTimings(
            prompt_n=_int(timings.get("prompt_n")),
            prompt_ms=_float(timings.get("prompt_ms")),
            predicted_n=_int(timings.get("predicted_n")),
            predicted_ms=_float(timings.get("predicted_ms")),
            cache_n=_int(timings.get("cache_n")),
        )


def _refused(ex: Exchange, status: int, body: bytes, retry_after: str | None) -> None:
    """A non-200 answer: what the server said, and whether it was load shedding (429/503)."""
    ex.status = status
    ex.fail(f"HTTP {status}", _error_message(body))
    ex.retry_after_s = _retry_after(retry_after)
    ex.outcome = "rejected" if status in REJECT_STATUSES else "failed"


def _read_line(ex: Exchange, line: str, now: float, leave_after_first: bool) -> bool:
    """One ``data:`` line of a 200 answer, arrived at ``now``. False: stop reading (a failure, or a
    client that leaves after its first token)."""
    payload = line[5:].strip()
    if payload == "[DONE]":
        # The answer is complete now; read on to the end of the body (the server ends it right after)
        # so the connection is closed cleanly rather than torn down mid-stream.
        ex.t_done = now
        return True
    if ex.t_done is not None:
        return True
    try:
        event = json.loads(payload)
    except ValueError:
        ex.fail("malformed SSE event")
        return False
    if isinstance(event, dict):
        _absorb(ex, event, now)
    ex.left = leave_after_first and ex.t_first_content is not None and ex.error is None
    return ex.error is None and not ex.left


def _settle(ex: Exchange) -> None:
    """A 200 answer's body is over, or the client stopped reading it."""
    if ex.error is None and not ex.done and not ex.left:
        ex.fail("stream ended without [DONE]")
    ex.outcome = "cancelled" if ex.left else "ok" if ex.error is None else "failed"


def _ended(ex: Exchange, clock: Callable[[], float]) -> Exchange:
    ex.t_end = ex.t_done if ex.t_done is not None else clock()
    if ex.completion_tokens is None and ex.server is not None:
        ex.completion_tokens = ex.server.predicted_n
    return ex


async def stream_chat(
    client: httpx.AsyncClient,
    target: Target,
    body: dict[str, Any],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    *,
    leave_after_first: bool = False,
    keep_text: bool = False,
) -> Exchange:
    """Send ``body`` (it asks for a stream) and time it; never raises except for cancellation.

    ``leave_after_first``: close the connection once the first token has arrived, as a client that
    goes away mid-answer does (``left`` is then set and the outcome is ``cancelled``). ``keep_text``:
    keep the answer's text (``Exchange.text``)."""
    ex = Exchange(text=[] if keep_text else None)
    ex.t_send = clock()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST", target.api_root + "/chat/completions", json=body, headers=target.headers()
            ) as response:
                if response.status_code != 200:
                    answer = await response.aread()
                    _refused(ex, response.status_code, answer, response.headers.get("retry-after"))
                    return _ended(ex, clock)
                ex.status = 200
                async for line in response.aiter_lines():
                    # Blank separators and ': keep-alive' comments carry no event (and take no reading).
                    if line.startswith("data:") and not _read_line(ex, line, clock(), leave_after_first):
                        break
                _settle(ex)
    except TimeoutError:
        ex.outcome = "timeout"
        ex.fail("timeout", f"no complete response within {timeout_s:g} s")
    except httpx.HTTPError as exc:
        ex.outcome = "failed"
        ex.fail(type(exc).__name__, _short(f"{type(exc).__name__}: {exc}"))
    return _ended(ex, clock)


def time_reply(
    status: int,
    retry_after: str | None,
    body: bytes,
    chunks: Sequence[tuple[float, bytes]],
    sent_at: float,
    done_at: float,
) -> Exchange:
    """The same reading of an answer another client has already received: ``body`` for a non-200
    answer, else the streamed body as ``chunks`` with the arrival time of each. A line is timed at
    the chunk that completes it."""
    ex = Exchange(t_send=sent_at)
    if status != 200:
        _refused(ex, status, body, retry_after)
        return _ended(ex, lambda: done_at)
    ex.status = 200
    pending = b""
    for at, data in chunks:
        *lines, pending = (pending + data).split(b"\n")
        if not all(
            _read_line(ex, line.decode("utf-8", "replace"), at, False)
            for line in lines
            if line.startswith(b"data:")
        ):
            break
    _settle(ex)
    return _ended(ex, lambda: done_at)
