"""Whose address a request comes from: ``X-Forwarded-For``/``-Proto`` believed only from the configured
peers (``proxy.forwarded_allow_ips``, read live so a reload applies), through uvicorn's own
``ProxyHeadersMiddleware``. uvicorn's default trusts loopback, so any local client could otherwise
write an address into the access log."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware


class ForwardedFor:
    """Believe ``X-Forwarded-For``/``-Proto`` only from the configured peers (read live: reloadable)."""

    def __init__(self, app: ASGIApp, trusted: Callable[[], tuple[str, ...]]) -> None:
        self.app = app
        self.trusted = trusted
        self._cache: tuple[tuple[str, ...], ASGIApp] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        trusted = self.trusted()
        if not trusted:
            await self.app(scope, receive, send)
            return
        cached = self._cache
        if cached is None or cached[0] != trusted:
            headers: Any = ProxyHeadersMiddleware(self.app, trusted_hosts=list(trusted))  # type: ignore[arg-type]
            cached = self._cache = (trusted, headers)
        await cached[1](scope, receive, send)
