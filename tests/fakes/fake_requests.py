"""A stand-in for the requests API of issue 26 in front of a proxy app, for the page's browser test:
``GET /admin/requests`` -> ``{"requests": [...]}`` and ``DELETE /admin/requests/{id}`` (``200``, or
``404`` for an unknown id), admin key only, everything else passed to the app. It follows the real
routes' contract (``proxy.routes.requests``) with rows the test scripts, so the page's table and its
Cancel can be driven on cue without real requests in flight."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/admin/requests"


class RequestsApi:
    """``requests``: what GET lists (the test changes it as it goes); ``finished``: ids that GET still
    lists but that finished meanwhile (DELETE answers 404, as for a request that ended just before the
    operator's click); ``cancelled``: the ids DELETE took, in order."""

    def __init__(self, app: ASGIApp, admin_key: str, requests: list[dict[str, Any]]) -> None:
        self.app = app
        self.admin_key = admin_key
        self.requests = requests
        self.finished: set[str] = set()
        self.cancelled: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if headers.get(b"authorization") != f"Bearer {self.admin_key}".encode():
            await _json(send, 401, _error("unknown or revoked API key", "invalid_api_key"))
            return
        method = scope["method"]
        if path == PREFIX and method == "GET":
            await _json(send, 200, {"requests": self.requests})
            return
        request_id = path[len(PREFIX) + 1 :]
        if method != "DELETE" or not request_id:
            await _json(send, 405, _error("Method Not Allowed", "method_not_allowed"))
            return
        known = [r for r in self.requests if r["id"] == request_id]
        if not known or request_id in self.finished:
            self.requests[:] = [r for r in self.requests if r["id"] != request_id]
            await _json(
                send, 404, _error(f"no queued or running request has the id '{request_id}'", "not_found")
            )
            return
        self.requests[:] = [r for r in self.requests if r["id"] != request_id]
        self.cancelled.append(request_id)
        await _json(send, 200, {"id": request_id, "cancelled": True})


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})
