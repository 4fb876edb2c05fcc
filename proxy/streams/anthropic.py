"""Anthropic's error shape on the Messages routes: ``{"type": "error", "error": {"type": ..., "message":
...}}``, for the proxy's own refusals (``proxy.middleware.anthropic``), for the error event that ends a
broken stream, and for errors the child answers in OpenAI's shape (``convert_error_body``; see
``proxy.streams.formats.ANTHROPIC``).
"""

from __future__ import annotations

import json

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
