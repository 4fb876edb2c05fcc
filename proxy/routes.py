"""The small routes: probes, model list, admin passthrough, metrics, identity.

``/healthz`` and ``/readyz`` need no credentials and say nothing secret: state names, counts and the
reason the supervisor gave. Admin passthrough routes do not take an admission permit: llama-server
answers them from its HTTP threads, not from a slot.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from urllib.parse import quote

from starlette.types import Receive, Scope, Send

from proxy import body as bodies
from proxy.context import SCOPE_KEY, RequestContext
from proxy.disconnect import ClientWatch
from proxy.errors import NotReady, UpstreamFailure, UpstreamTimeout
from proxy.metrics import CONTENT_TYPE
from proxy.runtime import ProxyRuntime
from proxy.settings import Scope as KeyScope
from proxy.upstream import UpstreamClosed

# Printable ASCII but space: what may stay as is in a forwarded query string ('%' keeps escapes intact).
_QUERY_SAFE = "".join(chr(c) for c in range(0x21, 0x7F))


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


class Healthz:
    """Liveness: the event loop that serves this also runs the supervisor, so an answer means both live."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SCOPE_KEY].route = "/healthz"
        await send_json(send, 200, {"status": "ok"})


class Readyz:
    def __init__(self, runtime: ProxyRuntime) -> None:
        self.rt = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SCOPE_KEY].route = "/readyz"
        snap = self.rt.snapshot()
        # The child may be fine while the proxy itself cannot take a new connection (at its cap, out of
        # file descriptors): a load balancer must hear that too.
        door = self.rt.door.problem() if self.rt.door is not None else None
        ready = snap.ready and door is None
        body: dict[str, object] = {
            "state": snap.state,
            "ready": ready,
            "reason": door or snap.reason,
            "model": snap.model_alias,
            "slots": snap.slots,
            "ctx_per_slot": snap.ctx_per_slot,
            "generation": snap.generation,
            "in_flight": self.rt.in_flight,
            "queued": self.rt.queued,
        }
        body.update({k: v for k, v in snap.info.items() if k not in body})
        if ready:
            await send_json(send, 200, body)
        else:
            scope[SCOPE_KEY].outcome = "not_ready"  # the access log must not call a failed probe ok
            headers = NotReady("", snap.retry_after_s).headers
            if snap.retry_after_s is not None:
                body["retry_after_s"] = snap.retry_after_s
            extra = [(k.encode(), v.encode()) for k, v in headers.items()]
            await send_json(send, 503, body, extra)


class Passthrough:
    """A route relayed to the child as is, after auth: the model list and llama.cpp's admin routes."""

    def __init__(
        self, runtime: ProxyRuntime, route: str, scope_needed: KeyScope, need_ready: bool = True
    ) -> None:
        self.rt = runtime
        self.route = route
        self.scope_needed = scope_needed
        self.need_ready = need_ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = self.rt
        ctx: RequestContext = scope[SCOPE_KEY]
        rt.authorize(ctx, self.route, self.scope_needed)
        snap = rt.ready_snapshot() if self.need_ready else rt.snapshot()
        if snap.base_url is None:
            raise NotReady(f"llama-server is not running ({snap.reason or snap.state})", snap.retry_after_s)
        method = scope["method"]
        raw: bytes | None = None
        if method == "POST":
            raw = await bodies.read_body(receive, ctx.content_length, rt.settings.max_body_bytes)
            bodies.parse_object(raw)
        path = self.route
        if scope.get("query_string"):
            # Bytes a lenient HTTP parser let through go on percent-encoded, never raw.
            path += "?" + quote(scope["query_string"], safe=_QUERY_SAFE)
        # Answered by the child's HTTP threads, not a slot: no reason to wait longer than for a first token.
        limit = min(rt.settings.timeouts.first_token_s, rt.settings.timeouts.total_s)
        async with ClientWatch(receive) as watch:
            try:
                async with asyncio.timeout(limit):
                    response = await rt.upstream.open(snap, method, path, raw, ctx.request_id)
                    try:
                        content = await response.read()
                    except UpstreamClosed:
                        raise UpstreamFailure("llama-server closed the connection before answering") from None
                    finally:
                        response.release()
            except TimeoutError:
                raise UpstreamTimeout(
                    f"llama-server did not answer {self.route} within {limit:g} s"
                ) from None
            if response.status >= 400:
                ctx.outcome = "upstream_error"
            watch.complete = True
            await send_bytes(send, response.status, content, response.content_type or b"application/json")


class Metrics:
    def __init__(self, runtime: ProxyRuntime) -> None:
        self.rt = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        self.rt.authorize(ctx, "/metrics", "admin")
        await send_bytes(send, 200, await self.rt.metrics.render_fresh(), CONTENT_TYPE.encode())


class Identity:
    """``GET /admin/identity``: what is served (build, binary and model digests, host); admin only."""

    def __init__(self, runtime: ProxyRuntime) -> None:
        self.rt = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        self.rt.authorize(ctx, "/admin/identity", "admin")
        await send_json(send, 200, dict(self.rt.source.identity()))
