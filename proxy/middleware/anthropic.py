"""Anthropic's conventions on the Messages routes: credentials in ``x-api-key`` and its error shape.

Anthropic clients send ``x-api-key: <key>`` (not ``Authorization``) and parse errors as
``{"type": "error", "error": {"type": ..., "message": ...}}``. ``AnthropicRoute`` wraps a route's
endpoint: it reads the key from ``x-api-key`` when there is no ``Authorization`` header, and answers
every refusal of the proxy in that shape (status, ``Retry-After`` and ``X-Request-ID`` unchanged).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.asgi.responses import error_message
from proxy.errors import ProxyError
from proxy.streams.anthropic import error_json


class AnthropicRoute:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        if ctx.authorization is None:
            for name, value in scope["headers"]:
                if name == b"x-api-key":
                    ctx.authorization = b"Bearer " + value
                    break
        try:
            await self.app(scope, receive, send)
        except ProxyError as exc:
            if ctx.response_started:
                raise
            ctx.outcome = exc.outcome
            start, body = error_message(exc, error_json(exc.status, exc.message))
            await send(start)
            await send(body)
