"""The child's answer on its way to the client: relayed as a stream (byte for byte, measured on the way),
whole (held up to ``limit`` bytes, then sent with its length), or assembled into one answer from the
child's stream (``proxy.streams.assemble`` says why a non-streamed request is streamed from the child).

Nothing reaches the client before the child's first bytes of answer: a stream's ``200`` waits for them,
a whole or assembled answer goes out at its end, so a child that dies before then leaves the request
free to run on the next one (``proxy.routes.replay``).

Whichever way, ``Exchange`` records what the child is doing for the request, so that the admission gate
knows whether abandoning it leaves the child's slot busy for a while (``Exchange.linger_s``). With an
accounts store, ``usage`` (a ``proxy.streams.usage.UsageTap``) reads what a whole or assembled answer
used, and ``meter`` is left with the last answer's meter: a stream's usage is in the report chunks it
kept, and its count is what a client that left is charged.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import Send

from proxy.asgi import body as bodies
from proxy.asgi.context import RequestContext
from proxy.asgi.disconnect import ClientWatch
from proxy.errors import ProxyError, UpstreamGone
from proxy.streams import privacy
from proxy.streams.assemble import AnswerTooLarge, Assembler, Kind
from proxy.streams.formats import StreamFormat
from proxy.streams.meter import Meter
from proxy.streams.usage import UsageTap
from proxy.upstream.connection import UpstreamClosed
from proxy.upstream.pool import UpstreamResponse

# llama-server notices a closed connection at its next streamed token, or within its 1 s polling interval
# (HTTP_POLLING_SECONDS in server-context.cpp) while nothing is sent; then frees the slot.
CHILD_NOTICE_S = 1.2

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    # Tells nginx-like fronts not to buffer the stream either.
    (b"x-accel-buffering", b"no"),
]


class Exchange:
    """What the child is doing for this request, to know whether abandoning it leaves its slot busy."""

    __slots__ = ("finished", "sent", "tpot_s")

    def __init__(self) -> None:
        self.sent = False
        self.finished = False
        self.tpot_s: float | None = None

    def linger_s(self) -> float:
        if not self.sent or self.finished:
            return 0.0
        if self.tpot_s is not None:  # generating: it notices at its next token write
            return min(CHILD_NOTICE_S, 4 * self.tpot_s + 0.1)
        return CHILD_NOTICE_S


class Relay:
    """One answer on its way back: where it goes (``send``, with ``watch`` on the client), how the
    route's stream is measured and ended (``fmt``), and what it records (``ctx``, ``exchange``)."""

    __slots__ = ("ctx", "exchange", "fmt", "meter", "send", "usage", "watch")

    def __init__(
        self,
        ctx: RequestContext,
        send: Send,
        watch: ClientWatch,
        fmt: StreamFormat,
        exchange: Exchange,
        usage: UsageTap | None = None,
    ) -> None:
        self.ctx = ctx
        self.send = send
        self.watch = watch
        self.fmt = fmt
        self.exchange = exchange
        self.usage = usage
        self.meter: Meter | None = None

    async def stream(
        self, response: UpstreamResponse, deadline: asyncio.Timeout, total_at: float, hide: bool
    ) -> None:
        """Relay the child's stream chunk by chunk; at its first token only the total deadline is left.

        The client's ``200`` waits for the first bytes there are to relay: llama-server sends its headers
        as soon as a slot starts the prompt, long before the first token, and until a byte of the answer
        is out the request may still run again on another child (``proxy.routes.replay``) or end with a
        plain error answer. A child that hangs up before that raises ``UpstreamGone`` (nothing was sent);
        after it, the stream ends with an error event."""
        ctx, watch, exchange = self.ctx, self.watch, self.exchange
        watch.end = self.fmt.end
        meter = self.meter = self.fmt.meter()
        rewriter = privacy.SseRewriter() if hide else None
        send: Send | None = None  # once the response has started
        clock = time.monotonic
        try:
            while (chunk := await response.next_chunk()) is not None:
                if meter.feed(chunk, clock()):
                    ctx.ttft_s = meter.ttft_from(ctx.started)
                    deadline.reschedule(total_at)  # first token in: only the total deadline is left
                out = chunk if rewriter is None else rewriter.feed(chunk)
                if response.at_end:
                    # The child's last chunk ([DONE]) and its end arrived together: one write, not two.
                    if rewriter is not None:
                        out += rewriter.flush()
                    exchange.finished = watch.complete = True
                    send = send or await self._begin()
                    await send({"type": "http.response.body", "body": out, "more_body": False})
                    return
                if out:
                    send = send or await self._begin()
                    watch.last = out  # a client that leaves after the stream's last event had it all
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            exchange.finished = True
            send = send or await self._begin()
            if rewriter is not None and (rest := rewriter.flush()):
                await send({"type": "http.response.body", "body": rest, "more_body": True})
        except UpstreamClosed:
            exchange.finished = True  # the child ended it
            gone = UpstreamGone("llama-server closed the stream before it was complete")
            if send is None:
                raise gone from None  # nothing reached the client
            await self.end_with(gone)
            return
        finally:
            ctx.tokens = meter.tokens
            ctx.tpot_s = exchange.tpot_s = meter.tpot()
        watch.complete = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _begin(self) -> Send:
        """Start the client's stream."""
        await self.send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        return self.send

    async def whole(self, response: UpstreamResponse, hide: bool, limit: int) -> None:
        """The child's whole answer (at most ``limit`` bytes), in the route's error shape when it failed."""
        parts: list[bytes] = []
        size = 0
        try:
            while (chunk := await response.next_chunk()) is not None:
                size += len(chunk)
                if size > limit:
                    raise AnswerTooLarge(
                        f"the answer exceeds the proxy's limit of {limit} bytes for non-streamed answers"
                    )
                parts.append(chunk)
        except UpstreamClosed:
            raise UpstreamGone("llama-server closed the connection before the answer was complete") from None
        content = parts[0] if len(parts) == 1 else b"".join(parts)
        if response.status == 200:
            self.ctx.tokens = self.fmt.count_tokens(content)
            if self.usage is not None:
                self.usage.whole(content)
            if hide:
                content = privacy.strip_json(content)
        else:
            self.ctx.outcome = "upstream_error"
            content = self.fmt.error_body(response.status, content)
        await self._send_whole(response.status, content, response.content_type)

    async def assembled(self, response: UpstreamResponse, kind: Kind, hide: bool, limit: int) -> None:
        """One non-streamed answer of ``kind`` built from the child's stream (at most ``limit`` bytes)."""
        assembler = Assembler(kind, limit)
        meter = self.meter = self.fmt.meter()
        clock = time.monotonic
        try:
            while (chunk := await response.next_chunk()) is not None:
                if meter.feed(chunk, clock()):
                    self.ctx.first_token_s = meter.ttft_from(self.ctx.started)
                assembler.feed(chunk)
        except UpstreamClosed:
            raise UpstreamGone("llama-server closed the connection before the answer was complete") from None
        finally:
            # Known while it generates: how soon the child notices if we abandon it (see ``Exchange``).
            self.exchange.tpot_s = meter.tpot()
        self.exchange.finished = True
        status, answer = assembler.answer()
        if status == 200:
            usage = answer.get("usage")
            tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
            self.ctx.tokens = tokens if isinstance(tokens, int) else meter.tokens
            if self.usage is not None:
                self.usage.answered(answer)
            if hide:
                answer = privacy.strip(answer)
        else:
            self.ctx.outcome = "upstream_error"
        await self._send_whole(status, bodies.dump(answer), b"application/json")

    async def _send_whole(self, status: int, content: bytes, content_type: bytes | None) -> None:
        headers = [
            (b"content-type", content_type or b"application/json"),
            (b"content-length", b"%d" % len(content)),
        ]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        self.watch.complete = True
        await self.send({"type": "http.response.body", "body": content, "more_body": False})

    async def end_with(self, error: ProxyError) -> None:
        """llama-server's own convention for an error after the 200: one error event, no ``[DONE]``."""
        self.ctx.outcome = error.outcome
        self.watch.complete = True
        event = self.fmt.error_event(error)
        await self.send({"type": "http.response.body", "body": event, "more_body": False})
