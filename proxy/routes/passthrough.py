"""Routes relayed to the child after auth, without an admission permit (llama-server answers them from
its HTTP threads, not from a slot): llama.cpp's admin routes (``/slots``), ``/props`` (trimmed for
inference keys) and the counting and templating routes (a per-tenant rate instead of a slot).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qs, quote

from starlette.types import Receive, Scope, Send

from proxy.asgi import body as bodies
from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.asgi.disconnect import ClientWatch
from proxy.asgi.responses import send_bytes, send_json
from proxy.auth import Principal
from proxy.errors import NotReady, UpstreamFailure, UpstreamTimeout
from proxy.models.lane import Lane
from proxy.schema import check_request
from proxy.source import UpstreamSnapshot
from proxy.state import ProxyState
from proxy.upstream.connection import UpstreamClosed

# Printable ASCII but space: what may stay as is in a forwarded query string ('%' keeps escapes intact).
_QUERY_SAFE = "".join(chr(c) for c in range(0x21, 0x7F))


class Passthrough:
    """A route relayed to the child as is: llama.cpp's admin routes, and the base of the others here.
    ``need_ready``: only a READY child answers (else any running one does)."""

    def __init__(
        self, state: ProxyState, route: str, need_ready: bool = True, schema: str | None = None
    ) -> None:
        self.state = state
        self.route = route
        self.need_ready = need_ready
        # A POST's body is checked against this request schema (``proxy.schema``) before it is relayed.
        self.schema = schema

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        status, content_type, content = await self.fetch(scope, receive, ctx, who)
        await send_bytes(send, status, content, content_type)

    async def fetch(
        self, scope: Scope, receive: Receive, ctx: RequestContext, principal: Principal
    ) -> tuple[int, bytes, bytes]:
        """Forward the request; (status, content type, body) of the child's whole answer.

        The body's ``model`` (POST) or ``?model=`` picks the child, as in llama-server's router mode;
        without one, the first ``always`` model the tenant may use (the only one, when one is served).
        A POST (counting, templating) loads an unloaded ``on_demand`` model as inference does; a GET
        (``/slots``, ``/props``) never loads one: 503 saying it is not loaded."""
        state = self.state
        router = state.router
        only = router.only()
        snap: UpstreamSnapshot | None = None
        if only is not None and not only.on_demand:
            ctx.model = only.name
            snap = self._running(only)  # one model: a child that cannot answer is known before the body
        raw: bytes | None = None
        payload: dict[str, Any] = {}
        post = scope["method"] == "POST"
        if post:
            raw = await bodies.read_body(receive, ctx.content_length, state.settings.max_body_bytes)
            payload = bodies.parse_object(raw)
        model = payload.get("model") if "model" in payload else query_model(scope)
        tenant = state.tenants.get(principal.tenant)
        # The only one when ``snap`` is set.
        only_models = principal.models
        lane = (
            router.resolve(model, tenant, only_models)
            if model is not None
            else router.default(tenant, only_models)
        )
        ctx.model = lane.name
        if post and self.schema is not None:
            raw = self._checked(principal, lane, payload, raw)
        lane.track_active(1)  # an idle unload must not stop the model under this request
        try:
            if post:
                lane.touch()  # as llama-server's router: only POSTs count as use, not monitoring GETs
                await router.load(lane, receive)
            if snap is None:
                snap = self._running(lane)  # after a load: the loaded child
            return await self._relay(snap, scope, receive, ctx, raw)
        finally:
            lane.track_active(-1)

    def _checked(
        self, principal: Principal, lane: Lane, payload: dict[str, Any], raw: bytes | None
    ) -> bytes | None:
        """The request schema, as on the generation routes: a 400 naming a bad or undeclared field."""
        assert self.schema is not None
        state = self.state
        tenant, admin = state.tenant(principal.tenant), "admin" in principal.scopes
        changed = check_request(self.schema, payload, state.settings, tenant, admin, lane.snapshot())
        return bodies.dump(payload) if changed else raw

    def _running(self, lane: Lane) -> UpstreamSnapshot:
        """The lane's child, when it can answer this route; else 503 saying why."""
        snap = lane.snapshot()
        if snap.base_url is None or (self.need_ready and not snap.ready):
            why = snap.reason or snap.state
            if snap.state == "UNLOADED":
                why += "; an inference or counting request loads it"
            word = "running" if snap.base_url is None else "ready"
            raise NotReady(f"the model '{lane.name}' is not {word} ({why})", snap.retry_after_s)
        return snap

    async def _relay(
        self,
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
        timeouts = self.state.settings.timeouts
        limit = min(timeouts.first_token_s, timeouts.total_s)
        async with ClientWatch(receive) as watch:
            try:
                async with asyncio.timeout(limit):
                    response = await self.state.upstream.open(snap, method, path, raw, ctx.request_id)
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


class Counting(Passthrough):
    """Tokenizing and templating (``kind: count``): no slot, a per-tenant rate bound instead, the model
    name resolved like on the generation routes (an alias is accepted and left for the child to ignore)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        self.state.count_rate.allow(who.tenant)
        await super().__call__(scope, receive, send, who)


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

    def __init__(self, state: ProxyState, route: str) -> None:
        super().__init__(state, route, need_ready=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        status, content_type, content = await self.fetch(scope, receive, ctx, who)
        if "admin" not in who.scopes and status == 200:
            try:
                props = json.loads(content)
            except ValueError:
                raise UpstreamFailure("llama-server answered /props with invalid JSON") from None
            if not isinstance(props, dict):
                raise UpstreamFailure("llama-server answered /props with something else than an object")
            await send_json(send, 200, {k: v for k, v in props.items() if k in PROPS_FOR_INFERENCE})
            return
        await send_bytes(send, status, content, content_type)
