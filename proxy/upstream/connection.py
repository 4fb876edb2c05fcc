"""One HTTP/1.1 connection to llama-server: an asyncio protocol parsed by httptools, one request at a
time, Content-Length or chunked bodies, body chunks handed over as they arrive (never buffered whole
for a stream). ``proxy.upstream.pool`` says why the proxy does not use httpx here.

A connection is reusable only while its state is exactly "between two messages": an answer that came
before the whole request body was sent, a second answer to one request, bytes arriving while it sits
idle, a HEAD answer: each makes it unusable, and it is closed instead of pooled.

Flow control both ways: request bodies are written in pieces that wait while the transport is paused
(``pause_writing``), and reading from the child pauses while more than ``_PAUSE_BYTES`` of body wait
for a slow client.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast

import httptools

# Unread body bytes before we stop reading from the child (a client reading slower than it generates),
# and the level at which reading resumes.
_PAUSE_BYTES, _RESUME_BYTES = 256 * 1024, 64 * 1024
# A response head (status line and headers) larger than this is refused; llama-server's are < 1 KiB.
_MAX_HEAD_BYTES = 64 * 1024
# Request bodies larger than this are written piece by piece, waiting whenever the transport is paused.
_WRITE_PIECE = 64 * 1024


class UpstreamClosed(Exception):
    """The child closed the connection, or sent what is not HTTP, before the response was complete."""


class _Unexpected(Exception):
    """A response the client did not ask for (raised inside the parser to stop it)."""


class Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, epoch: int) -> None:
        self._loop = loop
        self.epoch = epoch
        self.transport: asyncio.Transport | None = None
        # The parser calls back into this connection, so the two hold each other: ``connection_lost``
        # drops it, else every connection (one a request when the child closes them) and its socket
        # would wait for the garbage collector.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.closed = False
        self._aborted = False
        # False once its state is not exactly "between two messages": then it is closed, never reused.
        self.reusable = True
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._can_write = True
        self._paused = False
        self._reset(head_only=False)

    def _reset(self, head_only: bool) -> None:
        self.status = 0
        self.content_type = b""
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received = False
        self.error: UpstreamClosed | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._head_bytes = 0
        self._head_only = head_only
        self._interim = False
        # Content-Length or chunked: the end of the body is not the end of the connection.
        self._framed = False

    # --- asyncio.Protocol ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, but have its interface.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._parser is None:  # lost: nothing more is read
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.reusable = False
            if not isinstance(exc.__context__, _Unexpected):
                self._fail(UpstreamClosed(f"malformed HTTP from llama-server: {exc}"))
            self.abort()
            return
        if not self.headers_done:
            # Everything fed so far is head (an interim answer's included): bound it.
            self._head_bytes += len(data)
            if self._head_bytes > _MAX_HEAD_BYTES:
                self._fail(UpstreamClosed(f"llama-server sent a response head over {_MAX_HEAD_BYTES} bytes"))
                self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._parser = None
        if not self.complete:
            if (
                exc is None
                and not self._aborted
                and self.error is None
                and self.headers_done
                and not self._framed
            ):
                # No Content-Length, not chunked (HTTP/1.0 style): the close is the end of the body.
                self.complete = True
                self.keep_alive = False
            else:
                self._fail(UpstreamClosed("llama-server closed the connection"))
        self._can_write = True
        self._wake()

    def pause_writing(self) -> None:
        self._can_write = False

    def resume_writing(self) -> None:
        self._can_write = True
        self._wake()

    # --- httptools callbacks -------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.headers_done:
            # A second answer to one request, or bytes while idle: nothing we can relate to a request.
            raise _Unexpected
        self.content_type = b""
        self._framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        n = len(name)
        if n == 12 and name.lower() == b"content-type":
            self.content_type = value
        elif (n == 14 and name.lower() == b"content-length") or (
            n == 17 and name.lower() == b"transfer-encoding"
        ):
            self._framed = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None  # called from inside ``feed_data``
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue, 103 Early Hints: the answer follows
            return
        self.status = status
        self.headers_done = True
        if self._head_only:
            # A HEAD answer has a length but no body; the parser cannot be told, so it is not reused.
            self.complete = True
            self.reusable = False
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not body or self._head_only:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered >= _PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        assert self._parser is not None  # called from inside ``feed_data``
        self.keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._wake()

    # --- used by the pool and the response -----------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamClosed) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def send(self, head: bytes, body: bytes | None, head_only: bool = False) -> None:
        """Write one request; a large body in pieces, each after the transport has room for it."""
        self._reset(head_only)
        transport = self.transport
        assert transport is not None
        if body is None or len(body) <= _WRITE_PIECE:
            transport.write(head + body if body else head)  # the common case: one write, one segment
            return
        transport.write(head)
        view = memoryview(body)
        for start in range(0, len(view), _WRITE_PIECE):
            while not self._can_write or self.closed or self.headers_done:
                if self.error is not None:
                    raise self.error
                if self.headers_done or self.closed:
                    # Answered before taking the whole body (an early 413, say): the rest is never sent,
                    # so the connection is out of step and must not be reused.
                    self.reusable = False
                    return
                await self._wait()
            transport.write(view[start : start + _WRITE_PIECE])

    async def headers(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def next_chunk(self) -> bytes | None:
        while not self._chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self._wait()
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= _RESUME_BYTES:
            self._resume()
        return chunk

    def _resume(self) -> None:
        self._paused = False
        if self.transport is not None:
            self.transport.resume_reading()

    def park(self) -> None:
        """Between two requests: drop what the last client did not read, and read again (a close or
        unsolicited bytes must be seen while idle)."""
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._resume()

    def usable_since(self, expired_before: float) -> bool:
        """Idle, open and not about to close: a peer's FIN closes the transport one loop turn before
        ``connection_lost`` runs."""
        transport = self.transport
        return (
            not self.closed
            and self.idle_since > expired_before
            and transport is not None
            and not transport.is_closing()
        )

    def abort(self) -> None:
        self.closed = True
        self._aborted = True
        if self.transport is not None:
            self.transport.abort()
