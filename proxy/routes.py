"""The small routes: probes, model list, admin passthrough, metrics, identity.

``/healthz`` and ``/readyz`` need no credentials and say nothing secret: state names, counts and the
reason the supervisor gave. Admin passthrough routes do not take an admission permit: llama-server
answers them from its HTTP threads, not from a slot.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs, quote

from starlette.types import Receive, Scope, Send

from proxy import body as bodies
from proxy.auth import Principal
from proxy.context import SCOPE_KEY, RequestContext
from proxy.disconnect import ClientWatch
from proxy.errors import Forbidden, NotFound, NotReady, UpstreamFailure, UpstreamTimeout
from proxy.metrics import CONTENT_TYPE
from proxy.readiness import UpstreamSnapshot
from proxy.runtime import ProxyRuntime
from proxy.settings import Scope as KeyScope
from proxy.upstream import UpstreamClosed

if TYPE_CHECKING:
    from proxy.model_router import ModelRouter

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
        if self.rt.router is not None:
            # Several models: ready when every ``always`` model is; each model's own state beside.
            router = self.rt.router
            body["models"] = router.model_states()
            body["not_ready"] = router.not_ready()
            # The door's own gate takes no request then: the totals are the models' sums.
            body["in_flight"] = sum(lane.runtime.in_flight for lane in router.lanes.values())
            body["queued"] = sum(lane.runtime.queued for lane in router.lanes.values())
            # ``slots`` stays the default model's (as its ``model`` and ``ctx_per_slot``); beside the sums
            # above, every model's slots together.
            body["slots_total"] = sum(lane.runtime.snapshot().slots for lane in router.lanes.values())
        if ready:
            await send_json(send, 200, body)
        else:
            scope[SCOPE_KEY].outcome = "not_ready"  # the access log must not call a failed probe ok
            # The child's own estimate (None when FAILED: no retry is coming); when only the door is in
            # trouble (cap, descriptors), it passes within a second or so, as the door's own 503s say.
            retry_after_s = snap.retry_after_s if not snap.ready else 1.0
            headers = NotReady("", retry_after_s).headers
            if retry_after_s is not None:
                body["retry_after_s"] = retry_after_s
            extra = [(k.encode(), v.encode()) for k, v in headers.items()]
            await send_json(send, 503, body, extra)


class Passthrough:
    """A route relayed to the child as is, after auth: the model list and llama.cpp's admin routes.
    ``scope_needed`` "any key": an inference or an admin key (see ``authorize_any``)."""

    def __init__(
        self,
        runtime: ProxyRuntime,
        route: str,
        scope_needed: KeyScope | Literal["any key"],
        need_ready: bool = True,
    ) -> None:
        self.rt = runtime
        self.route = route
        self.scope_needed = scope_needed
        self.need_ready = need_ready

    def authorize(self, ctx: RequestContext) -> Principal:
        if self.scope_needed == "any key":
            return authorize_any(self.rt, ctx, self.route)
        return self.rt.authorize(ctx, self.route, self.scope_needed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        principal = self.authorize(ctx)
        status, content_type, content = await self.fetch(scope, receive, ctx, principal)
        await send_bytes(send, status, content, content_type)

    def check(
        self, rt: ProxyRuntime, principal: Principal, payload: dict[str, Any], snap: UpstreamSnapshot
    ) -> None:
        """Hook for subclasses: refuse a request body before it goes to the child."""

    async def fetch(
        self, scope: Scope, receive: Receive, ctx: RequestContext, principal: Principal
    ) -> tuple[int, bytes, bytes]:
        """Forward the request; (status, content type, body) of the child's whole answer."""
        rt = self.rt
        if rt.router is not None:
            return await self._fetch_routed(rt.router, scope, receive, ctx, principal)
        snap = rt.ready_snapshot() if self.need_ready else rt.snapshot()
        if snap.base_url is None:
            raise NotReady(f"llama-server is not running ({snap.reason or snap.state})", snap.retry_after_s)
        ctx.model = snap.model_alias  # the metrics' model label: the one served model
        raw: bytes | None = None
        if scope["method"] == "POST":
            raw = await bodies.read_body(receive, ctx.content_length, rt.settings.max_body_bytes)
            self.check(rt, principal, bodies.parse_object(raw), snap)
        return await self._relay(rt, snap, scope, receive, ctx, raw)

    async def _fetch_routed(
        self, router: ModelRouter, scope: Scope, receive: Receive, ctx: RequestContext, principal: Principal
    ) -> tuple[int, bytes, bytes]:
        """Several models: the body's ``model`` (POST) or ``?model=`` picks the child, as in
        llama-server's router mode; without one, the first ``always`` model the tenant may use.
        A POST (counting, templating) loads an unloaded ``on_demand`` model as inference does; a GET
        (``/slots``, ``/props``) never loads one: 503 saying it is not loaded."""
        raw: bytes | None = None
        payload: dict[str, Any] = {}
        post = scope["method"] == "POST"
        if post:
            raw = await bodies.read_body(receive, ctx.content_length, self.rt.settings.max_body_bytes)
            payload = bodies.parse_object(raw)
        model = payload.get("model") if "model" in payload else query_model(scope)
        tenant = self.rt.tenants.get(principal.tenant)
        lane = router.resolve(model, tenant) if model is not None else router.default(tenant)
        rt = lane.runtime
        ctx.model = lane.name
        rt.track_active(1)  # an idle unload must not stop the model under this request
        try:
            if post:
                lane.touch()  # as llama-server's router: only POSTs count as use, not monitoring GETs
                await router.load(lane, receive)
            snap = rt.snapshot()
            if snap.base_url is None or (self.need_ready and not snap.ready):
                why = snap.reason or snap.state
                if snap.state == "UNLOADED":
                    why += "; an inference or counting request loads it"
                word = "running" if snap.base_url is None else "ready"
                raise NotReady(f"the model '{lane.name}' is not {word} ({why})", snap.retry_after_s)
            if post:
                self.check(rt, principal, payload, snap)
            return await self._relay(rt, snap, scope, receive, ctx, raw)
        finally:
            rt.track_active(-1)

    async def _relay(
        self,
        rt: ProxyRuntime,
        snap: UpstreamSnapshot,
        scope: Scope,
        receive: Receive,
        ctx: RequestContext,
        raw: bytes | None,
    ) -> tuple[int, bytes, bytes]:
        method = scope["method"]
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
        return response.status, response.content_type or b"application/json", content


def query_model(scope: Scope) -> str | None:
    """The ``model`` query parameter (the last one when repeated), or None."""
    raw = scope.get("query_string") or b""
    values = parse_qs(raw.decode("latin-1"), keep_blank_values=True).get("model")
    return values[-1] if values else None


def authorize_any(rt: ProxyRuntime, ctx: RequestContext, route: str) -> Principal:
    """Like ``ProxyRuntime.authorize`` for a route open to inference and admin keys alike."""
    ctx.route = route
    principal = rt.keys.authenticate(ctx.authorization, ctx.client_host)
    ctx.tenant, ctx.key_id = principal.tenant, principal.key_id
    if not principal.scopes & {"inference", "admin"}:
        raise Forbidden("this key lacks the 'inference' or 'admin' scope required by this route")
    return principal


class Counting(Passthrough):
    """Tokenizing and templating (``kind: count``): no slot, a per-tenant rate bound instead, the model
    name checked like on the generation routes (an alias is accepted and left for the child to ignore)."""

    def __init__(self, runtime: ProxyRuntime, route: str) -> None:
        super().__init__(runtime, route, "any key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        principal = self.authorize(ctx)
        self.rt.count_rate.allow(principal.tenant)
        status, content_type, content = await self.fetch(scope, receive, ctx, principal)
        await send_bytes(send, status, content, content_type)

    def check(
        self, rt: ProxyRuntime, principal: Principal, payload: dict[str, Any], snap: UpstreamSnapshot
    ) -> None:
        bodies.check_model(payload, snap.model_alias, rt.settings.model_aliases)


# What /props shows an inference key: what a client needs to talk to the model (context, template,
# special tokens, modalities). Everything else (model_path, build_info, model_ftype, endpoint_* flags,
# ui settings...) describes the machine and stays for admin keys; an allowlist, so a field added by a
# later llama-server is hidden until someone decides otherwise.
PROPS_FOR_INFERENCE = frozenset(
    {
        "default_generation_settings",
        "total_slots",
        "model_alias",
        "modalities",
        "media_marker",
        "chat_template",
        "chat_template_caps",
        "chat_template_tool_use",
        "bos_token",
        "eos_token",
    }
)


class Props(Passthrough):
    """``GET /props``: llama-server's whole answer for admin keys; for inference keys the allowlisted
    fields only. Answered while the child runs, even when not ready (as before, for operators)."""

    def __init__(self, runtime: ProxyRuntime) -> None:
        super().__init__(runtime, "/props", "any key", need_ready=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        principal = self.authorize(ctx)
        status, content_type, content = await self.fetch(scope, receive, ctx, principal)
        if "admin" not in principal.scopes and status == 200:
            try:
                props = json.loads(content)
            except ValueError:
                raise UpstreamFailure("llama-server answered /props with invalid JSON") from None
            if not isinstance(props, dict):
                raise UpstreamFailure("llama-server answered /props with something else than an object")
            await send_json(send, 200, {k: v for k, v in props.items() if k in PROPS_FOR_INFERENCE})
            return
        await send_bytes(send, status, content, content_type)


class Health:
    """llama-server's ``/health`` (and ``/v1/health``), answered from readiness without credentials, in
    the child's own words: ``200 {"status":"ok"}`` when ready, else ``503`` with its loading error shape
    (plus ``Retry-After``). Monitoring written for llama-server keeps working through the proxy."""

    def __init__(self, runtime: ProxyRuntime, route: str) -> None:
        self.rt = runtime
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SCOPE_KEY].route = self.route
        snap = self.rt.snapshot()
        if snap.ready:
            await send_json(send, 200, {"status": "ok"})
            return
        retry = NotReady("", snap.retry_after_s).headers["retry-after"].encode()
        # The reason is public already (/readyz shows it); "Loading model" is llama-server's own word.
        message = (
            "Loading model"
            if snap.state == "STARTING"
            else f"llama-server is not ready ({snap.reason or snap.state})"
        )
        error = {"message": message, "type": "unavailable_error", "code": 503}
        await send_json(send, 503, {"error": error}, [(b"retry-after", retry)])


class RefusedRoute:
    """A llama-server path the proxy does not serve on purpose (``route_table.REFUSED``): 404 with why."""

    def __init__(self, route: str, reason: str) -> None:
        self.route = route
        self.reason = reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SCOPE_KEY].route = self.route
        raise NotFound(f"{self.route} is not served through llamagate: {self.reason}")


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
