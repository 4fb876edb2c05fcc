"""The proxy's HTTP/1.1 client to llama-server: a keep-alive pool of ``proxy.upstream.connection``s.

Why not httpx here (it is still what the supervisor and the tests use): measured on the 2-core target,
``httpx.AsyncClient`` spent about 0.27 ms of CPU per request before any I/O, and httpcore's pool another
~1 ms at 32 concurrent requests (it checks every pooled connection's socket on every request). That made
the proxy's budget (>= 800 requests/s on this host, <= 1.5 ms added latency) unreachable. This client
does only what talking to one llama-server needs: one request at a time per connection, Content-Length
or chunked bodies, and body chunks handed over as they arrive (never buffered whole for a stream).

Keep-alive: llama-server closes idle connections after 5 s; ours are dropped after ``KEEPALIVE_EXPIRY_S``
of idling, and a connection the child closed is discarded as soon as the loop sees the close. A streamed
answer (one the client streams, and every OpenAI chat or completion the proxy assembles for a client
that did not) always ends its connection: the pinned server's chunked provider returns false once it
has called ``sink.done()`` (tools/server/server-http.cpp ``process_handler_response``), which
cpp-httplib takes for a cancelled write, so it closes although the answer was whole and its head
promised ``Keep-Alive``. Such a request costs a fresh connection to 127.0.0.1 (``ss`` shows about one
TIME-WAIT a request on the child's side).

Retry: exactly once, and only when the child cannot have started work on the request: the connection
could not be opened, or a *reused* connection was closed before a single response byte arrived (the
idle-close race above). The retry always opens a fresh connection (the other idle ones may be just as
stale). A fresh connection that dies after the request went out is never retried: generation is not
idempotent, and the child may have died working on it.

Everything that gives a connection back is synchronous (``UpstreamResponse.release``), so it runs in a
``finally`` even while the task is being cancelled; an unfinished response always closes its connection,
which is how llama-server learns that the client left and frees the slot. Connections are kept per
child, so requests to several models' children taking turns keep every child's connections alive; a
restarted child (new generation, port or secret) starts a new epoch: the connections to the child it
replaces are closed, never reused. Every
value written into the request head must be visible ASCII (no CR, LF, space).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from urllib.parse import urlsplit

from proxy.errors import UpstreamFailure, UpstreamGone, UpstreamTimeout, UpstreamUnreachable
from proxy.settings import Timeouts
from proxy.source import UpstreamSnapshot
from proxy.upstream.connection import Connection, UpstreamClosed

KEEPALIVE_EXPIRY_S = 4.0
# Idle connections kept per child; more concurrent requests than this just open more connections.
MAX_IDLE = 64
# What may go into a request line or header value as is: visible ASCII, so no CR, LF, NUL or space.
_SAFE = re.compile(r"[\x21-\x7e]+")


def _require_safe(value: str, what: str) -> None:
    if not _SAFE.fullmatch(value):
        raise ValueError(f"refusing to send an unsafe {what} to llama-server")


class UpstreamResponse:
    """A response whose headers arrived; the body is read with ``next_chunk``/``read``. ``release`` it
    exactly once (idempotent): a complete response gives its connection back, any other closes it."""

    __slots__ = ("_conn", "_key", "_pool", "content_type", "status")

    def __init__(self, conn: Connection, pool: Upstream, key: tuple[str, int]) -> None:
        self._conn: Connection | None = conn
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


class _Child:
    """One child the pool talks to: its address, the constant lines of every request head, and the epoch
    its connections carry."""

    __slots__ = ("base_url", "epoch", "generation", "key", "lines", "model", "secret")

    def __init__(
        self, snap: UpstreamSnapshot, base_url: str, key: tuple[str, int], lines: bytes, epoch: int
    ) -> None:
        self.base_url = base_url
        self.secret = snap.secret
        self.generation = snap.generation
        self.model = snap.model_alias
        self.key = key
        self.lines = lines
        self.epoch = epoch


class Upstream:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._idle: dict[tuple[str, int], deque[Connection]] = {}
        # Each model's child now, and the child at each address. Every new child (generation, URL or
        # secret) gets a new epoch: a connection of another epoch than its address's child is closed
        # instead of pooled, even when the new child listens on the same port. Children of different
        # models keep their connections side by side.
        self._epoch = 0
        self._by_model: dict[str, _Child] = {}
        self._by_key: dict[tuple[str, int], _Child] = {}

    def _target(self, snap: UpstreamSnapshot) -> _Child:
        """The child this snapshot names, with its address, head lines and epoch."""
        known = self._by_model.get(snap.model_alias)
        if (
            known is not None
            and known.base_url == snap.base_url
            and known.secret == snap.secret
            and known.generation == snap.generation
        ):
            return known
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
        # A new child: connections to the one it replaces, and to whatever listened at its address
        # before, are useless.
        for old in (known, self._by_key.get(key)):
            if old is not None:
                self._forget(old)
        self._epoch += 1
        child = _Child(snap, snap.base_url, key, lines.encode(), self._epoch)
        self._by_model[child.model] = self._by_key[key] = child
        return child

    def _forget(self, child: _Child) -> None:
        for conn in self._idle.pop(child.key, ()):
            conn.abort()
        if self._by_key.get(child.key) is child:
            del self._by_key[child.key]
        if self._by_model.get(child.model) is child:
            del self._by_model[child.model]

    async def open(
        self, snap: UpstreamSnapshot, method: str, path: str, body: bytes | None, request_id: str
    ) -> UpstreamResponse:
        """Send the request; return once the response headers are in (body not read yet).
        ``ValueError`` if ``method``, ``path`` or ``request_id`` would not be a safe request head."""
        _require_safe(method, "method")
        _require_safe(path, "path")
        _require_safe(request_id, "request id")
        child = self._target(snap)
        key, fixed, epoch = child.key, child.lines, child.epoch
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
                raise UpstreamGone(f"no answer from llama-server: {exc}") from None
            except BaseException:
                conn.abort()
                raise
            return UpstreamResponse(conn, self, key)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect(self, key: tuple[str, int], epoch: int) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeouts.connect_s):
                _, conn = await loop.create_connection(lambda: Connection(loop, epoch), key[0], key[1])
        except TimeoutError:
            raise UpstreamTimeout(
                f"llama-server did not accept a connection within {self.timeouts.connect_s:g} s"
            ) from None
        return conn

    def _current(self, key: tuple[str, int], conn: Connection) -> bool:
        """``conn`` belongs to the child that listens at ``key`` now."""
        child = self._by_key.get(key)
        return child is not None and conn.epoch == child.epoch

    def _take_idle(self, key: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        expired_before = time.monotonic() - KEEPALIVE_EXPIRY_S
        while idle:
            conn = idle.pop()  # most recently used first: the least likely to be stale
            if conn.usable_since(expired_before) and self._current(key, conn):
                return conn
            conn.abort()
        return None

    def _put_back(self, key: tuple[str, int], conn: Connection) -> None:
        if not self._current(key, conn):
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
