"""Anthropic's conventions on the Messages routes: credentials in ``x-api-key`` and its error shape.

Anthropic clients send ``x-api-key: <key>`` (not ``Authorization``) and parse errors as
``{"type": "error", "error": {"type": ..., "message": ...}}``. ``AnthropicRoute`` wraps a route's
endpoint: it reads the key from ``x-api-key`` when there is no ``Authorization`` header, and answers
every refusal of the proxy in that shape (status, ``Retry-After`` and ``X-Request-ID`` unchanged).
Errors the child answers are converted by ``convert_error_body`` (see ``proxy.streams.ANTHROPIC``).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.context import SCOPE_KEY, RequestContext
from proxy.errors import ProxyError

# https://docs.anthropic.com/en/api/errors: the error type a status stands for.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_json(status: int, message: str) -> bytes:
    body = {"type": "error", "error": {"type": error_type(status), "message": message}}
    return json.dumps(body, separators=(",", ":")).encode()


def error_event(error: ProxyError) -> bytes:
    """llama-server's own mid-stream error on this route is ``event: error`` (format_anthropic_sse)."""
    return b"event: error\ndata: " + error_json(error.status, error.message) + b"\n\n"


def convert_error_body(status: int, content: bytes) -> bytes:
    """The child's OpenAI-shaped error (``{"error": {"message", ...}}``) in Anthropic's shape."""
    try:
        parsed = json.loads(content)
        message = parsed["error"]["message"]
    except (ValueError, TypeError, KeyError):
        return content
    if not isinstance(message, str):
        return content
    return error_json(status, message)


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
            body = error_json(exc.status, exc.message)
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
            headers += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
            await send({"type": "http.response.start", "status": exc.status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
