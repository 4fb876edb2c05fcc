"""The uvicorn protocol of the front door: uvicorn's ``HttpToolsProtocol`` plus the head limits, the head
and idle deadlines and the connection cap (see ``proxy.listener.guard`` for why, and for the
``FrontDoor`` it reports to, seen here only as the small ``DoorState``). Every refusal answers with a
status line (unless an answer is still being written) and closes the connection: after a broken head
the byte stream cannot be trusted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.listener.refusals import refusal
from proxy.settings import DoorSettings


class DoorState(Protocol):
    """What the protocol needs of the door it reports to (``proxy.listener.guard.FrontDoor``)."""

    settings: Callable[[], DoorSettings]
    open: int

    def refuse(self, reason: str, message: str) -> None: ...


class _Refuse(Exception):
    """Raised inside a parser callback: httptools stops parsing and ``feed_data`` raises."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    door: ClassVar[DoorState]

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = self.door.settings()
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._head_open = True  # waiting for (the rest of) a request head
        self._head_bytes = 0
        self._header_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._over_cap = False
        self._counted = False

    # --- connection --------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        door = self.door
        self._over_cap = door.open >= self.limits.max_connections
        door.open += 1
        self._counted = True
        super().connection_made(transport)
        if self._over_cap:
            door.refuse(
                "connection_cap",
                f"refusing connections: {self.limits.max_connections} open (proxy.max_connections)",
            )
        # uvicorn arms its idle timer only after a response: a silent new connection would stay for ever.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self.door.open -= 1
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        counted = self._head_open
        if counted:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # e.g. curl's "Upgrade: h2c": the request was already dispatched as plain HTTP/1.1 (no
            # websockets here: ws="none"), as uvicorn does, minus its warning line per request.
            pass
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, _Refuse) else None
            self._refuse(cause or _Refuse(400, "bad_head", "invalid HTTP request"))
        else:
            # A chunk that began inside a body is not counted (it may end with the next head's start);
            # the head's exact size is checked again when it completes.
            if counted and self._head_open and self._head_bytes > self.limits.max_head_bytes:
                self._refuse(self._head_too_large())

    # --- parser callbacks --------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timeout)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_request_line_bytes:
            limit = self.limits.max_request_line_bytes
            raise _Refuse(414, "request_line", f"request target longer than {limit} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            limit = self.limits.max_headers
            raise _Refuse(431, "header_count", f"more than {limit} header lines")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_head_bytes:
            raise self._head_too_large()
        if self._over_cap:
            raise _Refuse(503, "connection_cap", "too many open connections; retry shortly")
        self._head_open = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open = True

    # --- refusals ----------------------------------------------------------------------------------------
    def _head_too_large(self) -> _Refuse:
        limit = self.limits.max_head_bytes
        return _Refuse(431, "head_size", f"request head larger than {limit} bytes")

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._head_open and not self.transport.is_closing():
            limit = self.limits.head_timeout_s
            self._refuse(_Refuse(408, "head_timeout", f"request head not complete within {limit:g} s"))

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, r: _Refuse) -> None:
        """Answer with the refusal and close: after a broken head the byte stream cannot be trusted."""
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        if r.reason != "connection_cap":  # counted once, when the connection came in
            self.door.refuse(r.reason, f"refused request heads ({r.status} {r.message})")
        if self.cycle is None or self.cycle.response_complete:
            extra = (b"retry-after: 1\r\n",) if r.status == 503 else ()
            self.transport.write(refusal(r.status, r.message, extra))
        # else: a pipelined head behind an answer still being written; a status line now would land
        # inside that answer, so the connection just closes.
        self.transport.close()
