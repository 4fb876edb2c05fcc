"""The front door: limits the listener enforces before a request reaches the app, and what it says when it
cannot accept.

uvicorn with httptools (the protocol ``auto`` picks here) has no limit on the request head's size or header
count, no deadline for a head that arrives a byte at a time, and arms its keep-alive timer only after a
first response (a connection that never sends a byte stays open for ever). Its ``limit_concurrency``
answers 503 only once a head is parsed and logs one warning per refusal, and asyncio's accept loop logs a
traceback per attempt when file descriptors run out (CPython 3.11 ``_accept_connection`` keeps looping
``backlog`` times after EMFILE: 2,048 tracebacks per tick). So:

- ``GuardedHttpToolsProtocol`` (``proxy.listener.protocol``) subclasses uvicorn's ``HttpToolsProtocol``
  (selected through ``uvicorn.Config(http=...)``) and adds: request line over
  ``max_request_line_bytes``: 414; head over ``max_head_bytes`` or more than ``max_headers`` lines: 431
  (checked while the head arrives, so an unfinished head never holds more than one read beyond the
  limit); a deadline from the head's first byte to its end (408, then close); an idle deadline from the
  connection's start too; one connection over ``max_connections``: 503 with ``Retry-After`` and close.
  Every refusal is counted and logged at most once per ``LOG_INTERVAL_S`` per reason.
- ``FrontDoor`` holds the counters, the rate-limited log lines and ``problem()``: why the door cannot take
  a new connection now (at the cap, or accept failing for want of file descriptors), shown by /readyz.
  Its loop exception handler turns asyncio's accept errors into one line a minute and, with one
  descriptor held in reserve (``guard``), answers each waiting connection 503 instead of leaving it in
  the backlog.
- ``ForwardedFor`` (``proxy.middleware.forwarded``) believes ``X-Forwarded-For`` only from the
  configured peers (uvicorn's own default trusts loopback, so any local client could write an address
  into the access log).

The limits are read from the live settings on each connection, so a SIGHUP reload applies them to new
connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.listener.protocol import GuardedHttpToolsProtocol
from proxy.listener.refusals import LOG_INTERVAL_S, OUT_OF_FDS, RateLimitedLog
from proxy.settings import DoorSettings

log = logging.getLogger("llamagate.door")

# /readyz says "cannot accept" for this long after the last failed accept (failures come in bursts).
ACCEPT_ERROR_MEMORY_S = 10.0
_ACCEPT_ERROR = "socket.accept() out of system resource"


def _retry_on_a_closed_listener(context: dict[str, Any]) -> bool:
    """After an accept error asyncio retries with ``call_later(..., _start_serving, ..., sock, ...)``,
    and ``Server.close()`` does not cancel that timer (CPython 3.11): when the daemon stops while file
    descriptors are short, the retry runs on the closed socket and raises ``ValueError`` (fd -1). The
    listener is gone on purpose, so there is nothing to report."""
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    if getattr(callback, "__name__", "") != "_start_serving":
        return False
    if not isinstance(context.get("exception"), ValueError):
        return False
    return any(isinstance(arg, socket.socket) and arg.fileno() == -1 for arg in getattr(handle, "_args", ()))


class FrontDoor:
    def __init__(
        self,
        settings: Callable[[], DoorSettings],
        *,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.log = RateLimitedLog(logger, LOG_INTERVAL_S, clock)
        self.open = 0
        self.refused: dict[str, int] = {}
        self._accept_error_at: float | None = None
        self._listeners: dict[int, socket.socket] = {}
        self._reserve: int | None = None

    def refuse(self, reason: str, message: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self.log.event(reason, message)

    def guard(self, listener: socket.socket) -> None:
        """Hold one descriptor in reserve for ``listener``: when the process runs out, the reserve is
        let go for a moment to accept a waiting connection, answer it 503 and close it, instead of
        leaving it unanswered in the backlog (the trick libuv and nginx use)."""
        self._listeners[listener.fileno()] = listener
        if self._reserve is None:
            self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        self._listeners.clear()

    def accept_failed(self, exc: BaseException | None, listener_fd: int | None = None) -> None:
        self._accept_error_at = self.clock()
        what = getattr(exc, "strerror", None) or type(exc).__name__
        self.refuse(
            "accept_failed",
            f"cannot accept new connections: {what} (open file descriptors exhausted?);"
            f" {self.open} connections open",
        )
        listener = self._listeners.get(listener_fd) if listener_fd is not None else None
        if listener is not None and self._reserve is not None:
            self._refuse_one(listener)

    def _refuse_one(self, listener: socket.socket) -> None:
        assert self._reserve is not None
        os.close(self._reserve)
        self._reserve = None
        try:
            conn, _ = listener.accept()
        except OSError:
            conn = None  # nothing waiting (or another thread took the descriptor): nothing to refuse
        if conn is not None:
            with conn, contextlib.suppress(OSError):
                conn.setblocking(False)
                conn.send(OUT_OF_FDS)
        with contextlib.suppress(OSError):
            self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def problem(self) -> str | None:
        """Why a new connection would not be served now, or None. Shown by /readyz (no secrets)."""
        cap = self.settings().max_connections
        if self.open >= cap:
            return f"the proxy is at its connection cap ({self.open} open, proxy.max_connections {cap})"
        at = self._accept_error_at
        if at is not None and self.clock() - at < ACCEPT_ERROR_MEMORY_S:
            return "the proxy cannot accept new connections (out of file descriptors)"
        return None

    def exception_handler(
        self, previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None
    ) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
        """A loop exception handler that turns asyncio's per-attempt accept tracebacks into one counted,
        rate-limited line (and remembers the failure for /readyz); anything else goes to ``previous``."""

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if context.get("message") == _ACCEPT_ERROR:
                sock = context.get("socket")
                self.accept_failed(context.get("exception"), sock.fileno() if sock is not None else None)
            elif _retry_on_a_closed_listener(context):
                return
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        return handle

    def protocol(self) -> type[HttpToolsProtocol]:
        """The uvicorn protocol class bound to this door, for ``uvicorn.Config(http=...)``."""
        return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"door": self})


def uvicorn_config(app: ASGIApp, door: FrontDoor, **kwargs: Any) -> uvicorn.Config:
    """A ``uvicorn.Config`` with the guarded protocol and no header trust of uvicorn's own (``ForwardedFor``
    does that from the settings). The caller adds lifespan, logging and shutdown options."""
    return uvicorn.Config(
        app,
        http=door.protocol(),
        proxy_headers=False,
        ws="none",  # the proxy serves no websocket route
        forwarded_allow_ips="",
        timeout_keep_alive=door.settings().keep_alive_timeout_s,  # type: ignore[arg-type]
        server_header=False,
        **kwargs,
    )
