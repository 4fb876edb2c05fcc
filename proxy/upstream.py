"""The proxy's HTTP/1.1 client to llama-server: a keep-alive pool of asyncio protocols parsed by httptools.

Why not httpx here (it is still what the supervisor and the tests use): measured on the 2-core target,
``httpx.AsyncClient`` spent about 0.27 ms of CPU per request before any I/O, and httpcore's pool another
~1 ms at 32 concurrent requests (it checks every pooled connection's socket on every request). That made
the proxy's budget (>= 800 requests/s on this host, <= 1.5 ms added latency) unreachable. This client
does only what talking to one llama-server needs: one request at a time per connection, Content-Length
or chunked bodies, and body chunks handed over as they arrive (never buffered whole for a stream).

Keep-alive: llama-server closes idle connections after 5 s; ours are dropped after ``KEEPALIVE_EXPIRY_S``
of idling, and a connection the child closed is discarded as soon as the loop sees the close.

Retry: exactly once, and only when the child cannot have started work on the request: the connection
could not be opened, or a *reused* connection was closed before a single response byte arrived (the
idle-close race above). The retry always opens a fresh connection (the other idle ones may be just as
stale). A fresh connection that dies after the request went out is never retried: generation is not
idempotent, and the child may have died working on it.

Everything that gives a connection back is synchronous (``UpstreamResponse.release``), so it runs in a
``finally`` even while the task is being cancelled; an unfinished response always closes its connection,
which is how llama-server learns that the client left and frees the slot. So does any connection whose
state is not exactly "between two messages": an answer that came before the whole request body was sent,
a second answer to one request, bytes arriving while it sits idle, a HEAD answer. A restarted child (new
generation, port or secret) starts a new pool epoch: older connections are closed, never reused.

Flow control both ways: request bodies are written in pieces that wait while the transport is paused
(``pause_writing``), and reading from the child pauses while more than ``_PAUSE_BYTES`` of body wait
for a slow client. Every value written into the request head must be visible ASCII (no CR, LF, space).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

from proxy.errors import UpstreamFailure, UpstreamTimeout, UpstreamUnreachable
from proxy.readiness import UpstreamSnapshot
from proxy.settings import Timeouts

KEEPALIVE_EXPIRY_S = 4.0
# Idle connections kept per child; more concurrent requests than this just open more connections.
MAX_IDLE = 64
# Unread body bytes before we stop reading from the child (a client reading slower than it generates),
# and the level at which reading resumes.
_PAUSE_BYTES, _RESUME_BYTES = 256 * 1024, 64 * 1024
# A response head (status line and headers) larger than this is refused; llama-server's are < 1 KiB.
_MAX_HEAD_BYTES = 64 * 1024
# Request bodies larger than this are written piece by piece, waiting whenever the transport is paused.
_WRITE_PIECE = 64 * 1024
# What may go into a request line or header value as is: visible ASCII, so no CR, LF, NUL or space.
_SAFE = re.compile(r"[\x21-\x7e]+")


class UpstreamClosed(Exception):
    """The child closed the connection, or sent what is not HTTP, before the response was complete."""


class _Unexpected(Exception):
    """A response the client did not ask for (raised inside the parser to stop it)."""


def _require_safe(value: str, what: str) -> None:
    if not _SAFE.fullmatch(value):
        raise ValueError(f"refusing to send an unsafe {what} to llama-server")


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, epoch: int) -> None:
        self._loop = loop
        self.epoch = epoch
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
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


class UpstreamResponse:
    """A response whose headers arrived; the body is read with ``next_chunk``/``read``. ``release`` it
    exactly once (idempotent): a complete response gives its connection back, any other closes it."""

    __slots__ = ("_conn", "_key", "_pool", "content_type", "status")

    def __init__(self, conn: _Connection, pool: Upstream, key: tuple[str, int]) -> None:
        self._conn: _Connection | None = conn
        self._pool = pool
        self._key = key
        self.status = conn.status
        self.content_type = conn.content_type

    async def next_chunk(self) -> bytes | None:
        """The next body chunk as it arrived, or None at the end. Raises ``UpstreamClosed``."""
        assert self._conn is not None
        return await self._conn.next_chunk()

    @property
    def at_end(self) -> bool:
        """True once the whole body has arrived and been taken: the last chunk can close the reply."""
        conn = self._conn
        return conn is not None and conn.complete and not conn._chunks

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete and conn.keep_alive and conn.reusable and not conn.closed:
            self._pool._put_back(self._key, conn)
        else:
            conn.abort()


class Upstream:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        # Bumped for every new child (generation, URL or secret): a connection of an older epoch is closed
        # instead of pooled, even when the new child listens on the same port.
        self._epoch = 0
        self._target_cache: tuple[str, str | None, int, tuple[str, int], bytes] | None = None

    def _target(self, snap: UpstreamSnapshot) -> tuple[tuple[str, int], bytes, int]:
        """(host, port), the constant header lines and the pool epoch for this child."""
        cached = self._target_cache
        if (
            cached is not None
            and cached[0] == snap.base_url
            and cached[1] == snap.secret
            and cached[2] == snap.generation
        ):
            return cached[3], cached[4], self._epoch
        if snap.base_url is None:
            raise UpstreamUnreachable("llama-server is not listening")
        parts = urlsplit(snap.base_url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        if not _SAFE.fullmatch(parts.netloc) or (snap.secret and not _SAFE.fullmatch(snap.secret)):
            # Never echo the values: one of them is the secret.
            raise UpstreamFailure("llama-server's address or per-boot secret is not a valid header value")
        lines = f"Host: {parts.netloc}\r\nUser-Agent: llamagate\r\n"
        if snap.secret:
            lines += f"Authorization: Bearer {snap.secret}\r\n"
        # A new child: connections to the old one are useless, whatever port it had.
        self._epoch += 1
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
        self._target_cache = (snap.base_url, snap.secret, snap.generation, key, lines.encode())
        return key, lines.encode(), self._epoch

    async def open(
        self, snap: UpstreamSnapshot, method: str, path: str, body: bytes | None, request_id: str
    ) -> UpstreamResponse:
        """Send the request; return once the response headers are in (body not read yet).
        ``ValueError`` if ``method``, ``path`` or ``request_id`` would not be a safe request head."""
        _require_safe(method, "method")
        _require_safe(path, "path")
        _require_safe(request_id, "request id")
        key, fixed, epoch = self._target(snap)
        head = b"%s %s HTTP/1.1\r\n%sX-Request-ID: %s\r\n" % (
            method.encode(),
            path.encode(),
            fixed,
            request_id.encode(),
        )
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        head += b"\r\n"
        for attempt in (1, 2):
            # The retry always opens a fresh connection: other idle ones may be just as stale.
            conn = self._take_idle(key) if attempt == 1 else None
            reused = conn is not None
            if conn is None:
                try:
                    conn = await self._connect(key, epoch)
                except OSError:
                    if attempt == 1:
                        continue
                    # Refused twice: the child is gone or not listening yet, and nothing was sent.
                    raise UpstreamUnreachable("llama-server is not accepting connections") from None
            try:
                await conn.send(head, body, method == "HEAD")
                await conn.headers()
            except UpstreamClosed as exc:
                conn.abort()
                if attempt == 1 and reused and not conn.received:
                    continue  # the child closed this idle connection as we reused it
                raise UpstreamFailure(f"no answer from llama-server: {exc}") from None
            except BaseException:
                conn.abort()
                raise
            return UpstreamResponse(conn, self, key)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect(self, key: tuple[str, int], epoch: int) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeouts.connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop, epoch), key[0], key[1])
        except TimeoutError:
            raise UpstreamTimeout(
                f"llama-server did not accept a connection within {self.timeouts.connect_s:g} s"
            ) from None
        return conn

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        expired_before = time.monotonic() - KEEPALIVE_EXPIRY_S
        while idle:
            conn = idle.pop()  # most recently used first: the least likely to be stale
            if conn.usable_since(expired_before) and conn.epoch == self._epoch:
                return conn
            conn.abort()
        return None

    def _put_back(self, key: tuple[str, int], conn: _Connection) -> None:
        if conn.epoch != self._epoch:
            conn.abort()  # it belongs to a child that has been replaced since
            return
        idle = self._idle.setdefault(key, deque())
        now = time.monotonic()
        # The oldest sit at the left; drop the ones the child has closed or is about to close.
        while idle and not idle[0].usable_since(now - KEEPALIVE_EXPIRY_S):
            idle.popleft().abort()
        if len(idle) >= MAX_IDLE:
            conn.abort()
            return
        conn.park()
        conn.idle_since = now
        idle.append(conn)

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
