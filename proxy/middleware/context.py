"""The outermost layer of every request: request id, error mapping, access log, metrics.

Pure ASGI (a ``BaseHTTPMiddleware`` would buffer streams). It is the one boundary where ``ProxyError``
becomes an OpenAI-shaped JSON answer, where every response, errors included, gets ``X-Request-ID``
(and the request's ``extra_headers``: a budgeted caller's rate-limit headers), and where the one
access-log line per request is written.

The access log holds ids, names, numbers and outcomes only: never a header value, a body, a prompt, a
completion or a key. Fields travel in ``extra={"fields": {...}}`` (the supervisor's formatters render them).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.asgi.disconnect import ClientGone
from proxy.asgi.responses import error_message
from proxy.errors import ProxyError

access_log = logging.getLogger("llamagate.access")
log = logging.getLogger("llamagate.proxy")

_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")


Observer = Callable[[RequestContext, float, str], None]


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, observe: Observer, active: Callable[[int], None]) -> None:
        self.app = app
        self._observe = observe
        self._active = active

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        incoming_id: bytes | None = None
        ctx = RequestContext("", started)
        for name, value in scope["headers"]:
            if name == b"authorization":
                ctx.authorization = value
            elif name == b"x-request-id":
                incoming_id = value
            elif name == b"content-length":
                ctx.content_length = int(value) if value.isdigit() else None
        if incoming_id is not None and _REQUEST_ID.fullmatch(incoming_id):
            ctx.request_id = incoming_id.decode()
        else:
            ctx.request_id = os.urandom(12).hex()
        client = scope.get("client")
        ctx.client_host = client[0] if client else None
        scope[SCOPE_KEY] = ctx
        id_header = (b"x-request-id", ctx.request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                ctx.status = message["status"]
                ctx.response_started = True
                headers = [*message.get("headers", ()), id_header, *ctx.extra_headers]
                message = {**message, "headers": headers}
            await send(message)

        self._active(1)
        try:
            await self.app(scope, receive, send_with_id)
        except ProxyError as exc:
            ctx.outcome = exc.outcome
            if not ctx.response_started:
                start, body = error_message(exc)
                await send_with_id(start)
                await send(body)
        except ClientGone:
            ctx.outcome = "client_gone"
            if not ctx.response_started:
                ctx.status = 499  # nginx's "client closed request": nothing was sent
        except Exception:
            log.exception("unhandled error", extra={"fields": {"request_id": ctx.request_id}})
            ctx.outcome = "error"
            if not ctx.response_started:
                start, body = error_message(ProxyError())
                await send_with_id(start)
                await send(body)
        finally:
            self._active(-1)
            self._observe(ctx, time.monotonic() - started, scope["method"])


def write_access_log(ctx: RequestContext, duration_s: float, method: str) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    # The route template, never the raw path: a client can put anything in a path, a key included.
    access_log.info(
        "%s %s %d %s",
        method,
        ctx.route,
        ctx.status,
        ctx.outcome,
        extra={
            "fields": {
                "request_id": ctx.request_id,
                "tenant": ctx.tenant,
                "key_id": ctx.key_id,
                "route": ctx.route,
                "status": ctx.status,
                "outcome": ctx.outcome,
                "queue_wait_ms": _ms(ctx.queue_wait_s),
                "ttft_ms": _ms(ctx.ttft_s),
                "tpot_ms": _ms(ctx.tpot_s),
                "tokens": ctx.tokens,
                "duration_ms": _ms(duration_s),
                # 1: run again on the next child (its child died before the answer began); the other
                # fields are the final attempt's.
                "replayed": int(ctx.replayed),
                "client": ctx.client_host,
            }
        },
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)
