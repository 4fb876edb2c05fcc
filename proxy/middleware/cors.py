"""CORS for browser apps, off by default (``proxy.cors``).

Pure ASGI, outermost: a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
from an allowed origin, for a path the proxy serves, is answered here before any authentication (a
browser never sends credentials on a preflight). Real answers to an allowed origin, errors and streams
included, get ``Access-Control-Allow-Origin`` on their first message (headers), so nothing is buffered.
Any other origin gets no CORS header at all, and its preflight goes on to the router like any
``OPTIONS`` (``405``): the browser then refuses the call.

``Access-Control-Allow-Credentials`` is never sent: keys travel in ``Authorization`` / ``x-api-key``,
which a browser app sets itself, so cookies are never needed; hence ``*`` (any origin) is never combined
with credentials.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.settings import CorsSettings

_EXPOSE = b"x-request-id, retry-after"


class CorsMiddleware:
    def __init__(self, app: ASGIApp, settings: Callable[[], CorsSettings], paths: frozenset[str]) -> None:
        self.app = app
        self._settings = settings  # read per request: a reload (SIGHUP) applies at once
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cors = self._settings()
        origin = _header(scope, b"origin") if cors.allowed_origins else None
        if origin is None or not _allowed(cors, origin):
            await self.app(scope, receive, send)
            return
        await self._with_cors(scope, receive, send, cors, origin)

    async def _with_cors(
        self, scope: Scope, receive: Receive, send: Send, cors: CorsSettings, origin: bytes
    ) -> None:
        value = b"*" if "*" in cors.allowed_origins else origin
        if (
            scope["method"] == "OPTIONS"
            and _header(scope, b"access-control-request-method") is not None
            and scope["path"] in self._paths
        ):
            headers = [
                (b"access-control-allow-origin", value),
                (b"access-control-allow-methods", ", ".join(cors.allowed_methods).encode()),
                (b"access-control-allow-headers", _allow_headers(cors, scope)),
                (b"access-control-max-age", b"%d" % cors.max_age_s),
                (b"vary", b"Origin"),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [
                    (b"access-control-allow-origin", value),
                    (b"access-control-expose-headers", _EXPOSE),
                    (b"vary", b"Origin"),
                ]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _allow_headers(cors: CorsSettings, scope: Scope) -> bytes:
    """The configured list; with "*" in it, whatever the preflight asks for (browser SDKs add their own
    headers, e.g. ``x-stainless-*``), echoed, since a literal "*" never covers ``Authorization``."""
    if "*" in cors.allowed_headers:
        return _header(scope, b"access-control-request-headers") or b""
    return ", ".join(cors.allowed_headers).encode()


def _allowed(cors: CorsSettings, origin: bytes) -> bool:
    text = origin.decode("latin-1")
    return "*" in cors.allowed_origins or text in cors.allowed_origins
