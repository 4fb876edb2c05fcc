"""The few ways an endpoint answers: a whole body with its length, a JSON object, and a ``ProxyError``
as the two ASGI messages of its OpenAI-shaped answer."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from starlette.types import Message, Send

from proxy.errors import ProxyError


async def send_bytes(
    send: Send, status: int, content: bytes, content_type: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(content)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": content, "more_body": False})


async def send_json(
    send: Send, status: int, obj: Mapping[str, object], headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    content = json.dumps(obj, separators=(",", ":"), default=str).encode()
    await send_bytes(send, status, content, b"application/json", headers)


def error_message(exc: ProxyError, body: bytes | None = None) -> tuple[Message, Message]:
    """The answer to ``exc``: its status and headers, its OpenAI-shaped body unless given another."""
    body = exc.body() if body is None else body
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers.items()]
    return (
        {"type": "http.response.start", "status": exc.status, "headers": headers},
        {"type": "http.response.body", "body": body, "more_body": False},
    )
