"""The inference routes: check, admit, forward, relay.

Order matters and is cheapest-refusal first: credentials (no body read for a stranger), then, when one
model is served, its readiness and the route's feature (503 or 404 before reading); the request's own
priority and queue wait (headers, ``proxy.admission.asks``: a 400 before the body is read); body size and
JSON; the model the body names picks its lane (``proxy.models.router``: name or alias, 404 otherwise).

1. **Check** (``_checked``): a key cooling down after poison requests, or a body that killed two children,
   is a 429 (``proxy.admission.poison``); then the body against the route's declared schema
   (``proxy.schema``: every field's type, range and who may send it, the tenant's bounds among them; a 400
   naming the field, or a rewrite such as the token cap). Only then is an unloaded on_demand model loaded
   (the wait counts toward TTFT) and the request sized (``proxy.admission.cost``: how many slots at once).
2. **Admit** (``_admitted``): the body as the child gets it (``_for_child``); the request, described once
   (``_ask``: ``proxy.admission.pipeline.Ask``), enters the door's pipeline (``state.pipeline``), one list
   of steps: the budgets (a 429 before any queue or slot), the optional prompt-size check
   (``proxy.routes.prompt_tokens``: a 400 before any wait), the tenant's total, its leases shared with the
   other replicas when there are any, and last the slots of the lane's gate; the steps are the door's
   business, not this module's.
3. **Forward** (``_attempts``), then relay the answer.

Every step that can wait (queue, first token, the stream) runs under the client watch, so a client that
leaves releases what it held at once (not the on-demand load wait: the load is shared with other
requests and goes on; a client that left during it is noticed at admission).

From the client watch on, the request is listed in the door's registry (``proxy.admission.inflight``:
``GET /admin/requests``), queued until its permit, then running; an operator's cancel comes through the
watch as a client that leaves does, and ends the request with ``Cancelled`` (an error event once its
stream began).

Deadlines (``proxy.timeouts``): ``first_token_s`` from admission to the first generated token of a
stream; ``total_s`` from arrival to the last byte. A non-streamed answer only has the total deadline.

A generation whose child dies (exit, liveness kill, a hang's kill, restart) before any byte of its answer
reached the client is admitted again, at the head of its tenant's queue, and runs once more on the next
READY child within the same deadlines, alone with it (``_attempts``, the loop around forward: one attempt
per turn; only the slots are taken again, with ``Pipeline.retake_slot``). The request's part in that is
``proxy.routes.replay.Recovery``'s (when and how long it waits, when it is poison instead, the verdict's
metric and log); ``proxy.admission.poison`` says why alone and what a second death means. Each attempt
goes through its model's disk tier (``proxy.routes.tier_turn``).

Non-streamed chat and completions are asked of the child as streams and assembled here
(``proxy.streams.assemble`` says why: it is how a client that leaves stops the child's work at once).
Answers to keys that may not see prompt-cache hits go through ``proxy.streams.privacy``; the answer's way
back is ``proxy.streams.relay``. With a store or budgets, the request's account (``proxy.routes.charge``)
wraps the attempts and charges the child's reported usage at the end, to the ledger and every budget
hold of the grant.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import Receive, Scope, Send

from proxy.admission import cost
from proxy.admission.asks import Asked, asked
from proxy.admission.gate import Permit
from proxy.admission.inflight import Tracked
from proxy.admission.pipeline import Ask, Grant
from proxy.admission.settle import SlotsSettled
from proxy.asgi import body
from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.asgi.disconnect import ClientWatch
from proxy.auth import Principal
from proxy.conversations.key import KEY_HEADER, conversation_id, conversation_key, named
from proxy.errors import (
    NotFound,
    Rejected,
    UpstreamFailure,
    UpstreamTimeout,
)
from proxy.models.lane import Lane
from proxy.routes.charge import Account, NoAccount, open_account
from proxy.routes.prompt_tokens import PromptTokens
from proxy.routes.replay import Recovery
from proxy.routes.table import RouteSpec
from proxy.routes.tier_turn import TierTurn
from proxy.schema import check_request
from proxy.settings import TenantSettings, Timeouts
from proxy.source import UpstreamSnapshot
from proxy.state import ProxyState
from proxy.streams.assemble import AnswerTooLarge, assembled_as
from proxy.streams.assemble import Kind as AssembledKind
from proxy.streams.formats import StreamFormat
from proxy.streams.relay import Exchange, Relay
from proxy.telemetry.request import genai_for, read_params


class _Plan:
    """How this request goes to the child and back."""

    __slots__ = ("assemble", "hide", "reuse", "stream")

    def __init__(self, stream: bool, assemble: AssembledKind | None, hide: bool, reuse: bool = True) -> None:
        self.stream = stream  # the client asked for a stream
        self.assemble = assemble  # non-streamed for the client, streamed from the child
        self.hide = hide  # strip prompt-cache detail from the answer
        self.reuse = reuse  # may reuse cached state (not "cache_prompt": false): the disk tier keeps it


class _Request:
    """One generation request on its way through the endpoint: who sent it, which model's lane it
    chose, the body as the child gets it and how it goes there (``plan``), the client's side of the
    connection, its account, and (once admission started) its client watch and registry entry."""

    __slots__ = (
        "account",
        "ctx",
        "entry",
        "headers",
        "lane",
        "plan",
        "raw",
        "receive",
        "received",
        "rewritten",
        "send",
        "tenant",
        "watch",
        "who",
    )

    def __init__(
        self, ctx: RequestContext, who: Principal, tenant: TenantSettings, send: Send, receive: Receive
    ) -> None:
        self.ctx = ctx
        self.who = who
        self.tenant = tenant
        self.send = send
        self.receive = receive
        self.headers: list[tuple[bytes, bytes]] = []
        self.lane: Lane
        self.raw: bytes
        self.rewritten = False  # the schema's check changed the body (``Inference._checked``)
        self.received = b""  # the body as the client sent it (a poison body is refused by its digest)
        self.plan: _Plan
        self.account: Account | NoAccount
        self.watch: ClientWatch
        self.entry: Tracked


class _Deadlines:
    """A request's deadlines on the loop's clock, set at its first admission; a replay keeps them:
    ``first_token_s`` from admission to a stream's first token, ``total_s`` from arrival to the end."""

    __slots__ = ("first_at", "total_at")

    def __init__(self, timeouts: Timeouts, started: float) -> None:
        now = asyncio.get_running_loop().time()
        self.total_at = now + timeouts.total_s - (time.monotonic() - started)
        self.first_at = now + timeouts.first_token_s


class Inference:
    """The endpoint of one generation row of ``proxy.routes.table``, forwarded to the same path on the
    child. Everything route-specific comes from the row: the child feature it needs, how its stream is
    measured (``stream``), how ``proxy.admission.cost`` counts it (``cost``), what is assembled for a
    non-streamed request (``assembled``); a route that generates no tokens (embeddings, rerank) has no
    token cap and no stream."""

    def __init__(self, state: ProxyState, spec: RouteSpec) -> None:
        assert spec.stream is not None and spec.cost is not None, spec.path
        self.state = state
        self.route = spec.path
        self.spec = spec
        self.fmt: StreamFormat = spec.stream
        self.cost_kind: cost.CostKind = spec.cost
        self.needs = spec.needs

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        state = self.state
        ctx: RequestContext = scope[SCOPE_KEY]
        req = _Request(ctx, who, state.tenant(who.tenant), send, receive)
        req.headers = scope["headers"]
        if state.telemetry is not None:
            ctx.genai = genai_for(self.spec.kind, scope["headers"])
        asks = asked(scope["headers"])  # None for nearly every request: it asks nothing
        only = state.router.only()
        snap: UpstreamSnapshot | None = None
        if only is not None and not only.on_demand:
            # One model: it is known before the body, so a request it cannot serve is refused unread.
            ctx.model = only.name
            snap = only.ready_snapshot()
            self._servable(only, snap)
        raw = await body.read_body(receive, ctx.content_length, state.settings.max_body_bytes)
        payload = body.parse_object(raw)
        ctx.request_params = read_params(payload)
        # The only one when ``snap`` is set; a store key may be limited to some models (``who.models``).
        lane = req.lane = state.router.resolve(payload.get("model"), req.tenant, who.models)
        ctx.model = lane.name
        requested = payload.get("model")
        ctx.request_model = requested if isinstance(requested, str) and requested else lane.name
        lane.touch()
        if snap is None:
            self._servable(lane, lane.snapshot())
        req.received = raw
        req.rewritten = self._checked(req, snap or lane.snapshot(), payload)
        lane.track_active(1)  # the lane is busy from here: an idle unload must not pick it
        try:
            await state.router.load(lane, receive)
            snap = snap or lane.ready_snapshot()  # after a load: the loaded child
            await self._admitted(req, snap, payload, asks)
        finally:
            lane.track_active(-1)
            lane.touch()

    def _checked(self, req: _Request, snap: UpstreamSnapshot, payload: dict[str, Any]) -> bool:
        """The request schema (``proxy.schema``), before anything else is done for the body: a field of
        the wrong type, out of range or undeclared is a 400 naming it; the tenant's bounds rewrite the
        rest. True when the body changed."""
        state = self.state
        try:
            state.poison.check(req.who.key_id, req.received)
        except Rejected as refused:
            state.metrics.observe_poison_refusal(
                req.lane.name, req.tenant.name, req.who.key_id, refused.reason
            )
            raise
        admin = "admin" in req.who.scopes
        return check_request(
            self.spec.body, payload, state.settings, req.tenant, admin, snap, generates=self.spec.generates
        )

    def _servable(self, lane: Lane, snap: UpstreamSnapshot) -> None:
        if self.needs is not None and not getattr(snap, self.needs, False):
            raise NotFound(f"{self.route} is not enabled for the model '{lane.name}' ({self.needs}: false)")

    async def _admitted(
        self, req: _Request, snap: UpstreamSnapshot, payload: dict[str, Any], asks: Asked | None
    ) -> None:
        """Admit the checked request and forward it: the body as its child gets it (``_for_child``), its
        prompt for the two that count it (``PromptTokens``), its account and its ``Ask``; then, under the
        client watch and listed in the registry, the attempts inside the pipeline's grant."""
        state, ctx, lane = self.state, req.ctx, req.lane
        req.raw, req.plan = self._for_child(req, snap, payload)
        prompt = PromptTokens(state, lane, self.route, payload, ctx.request_id)
        ask = self._ask(req, snap, payload, asks, prompt)
        req.account = open_account(state, ctx, req.who, lane.name, self.spec.kind, prompt)
        async with ClientWatch(req.receive) as watch:
            req.watch = watch
            req.entry = Tracked(ctx.request_id, req.tenant.name, ctx.key_id, lane.name, self.route, watch)
            state.inflight.add(req.entry)
            try:
                ctx.admit_at = time.monotonic()
                async with (
                    state.pipeline.admit(ask, ctx, lane.gate) as grant,
                    req.account.charging(grant),
                ):
                    await self._attempts(req, grant)
            finally:
                state.inflight.remove(req.entry)

    def _for_child(
        self, req: _Request, snap: UpstreamSnapshot, payload: dict[str, Any]
    ) -> tuple[bytes, _Plan]:
        """The body as the child gets it, and how it goes there and back (``_Plan``). ``payload`` keeps
        the request as checked, but for the model's name: a non-streamed answer assembled here is asked of
        the child as a stream in its body only, so the prompt is counted as the client sent it."""
        # An alias becomes the child's own name for the model.
        model = payload.get("model")
        rewrite = model is not None and model != snap.model_alias
        if rewrite:
            payload["model"] = snap.model_alias
        rewrite = req.rewritten or rewrite
        stream = payload.get("stream") is True and self.spec.generates
        assemble = None if stream else assembled_as(self.spec.assembled, payload)
        sent = payload
        if assemble is not None:
            sent = {
                **payload,
                "stream": True,
                "stream_options": {"include_usage": True},
                # Progress events while the prompt is processed: the child writes, so it notices a client
                # that left during a long prompt too, not only once it generates (consumed here, never sent).
                "return_progress": True,
            }
            rewrite = True
        admin = "admin" in req.who.scopes
        plan = _Plan(
            stream,
            assemble,
            hide=not (admin or req.tenant.show_cache_details),
            reuse=payload.get("cache_prompt") is not False,  # disk tier
        )
        return body.dump(sent) if rewrite else req.received, plan

    def _ask(
        self,
        req: _Request,
        snap: UpstreamSnapshot,
        payload: dict[str, Any],
        asks: Asked | None,
        prompt: PromptTokens,
    ) -> Ask:
        """The request as every step of the pipeline sees it: its size (``proxy.admission.cost``: a 400
        for one wider than its tenant may ever hold, before anything is done for it), its own wait and
        priority, its conversation, and its prompt's check when its tenant asks for one."""
        tenant = req.tenant
        size = cost.size(self.cost_kind, payload, tenant, capacity=snap.slots)
        return Ask(
            tenant,
            req.who.key_id,
            req.lane.name,
            size.slots,
            # An upper bound of the tokens it can use (``proxy.accounts.budgets``): every sequence at
            # most fills its slot's context (llama-server stops a sequence there: context shift is off).
            reserve=max(1, size.sequences) * snap.ctx_per_slot if snap.ctx_per_slot > 0 else None,
            priority=asks.priority if asks is not None else None,
            max_wait_s=asks.max_wait_s if asks is not None else None,
            key_budgets=req.who.budgets,
            conversation=self._conversation(req, payload),
            # An admin's own ``id_slot`` (``proxy.schema``) is the child's to honour, not ours.
            placeable=self.spec.generates and "id_slot" not in payload,
            check=prompt if tenant.check_prompt_size else None,
        )

    def _conversation(self, req: _Request, payload: dict[str, Any]) -> str | None:
        """Its conversation's key, for the slot it runs on (``proxy.conversations``); the answer shows it."""
        if not self.spec.generates:
            return None
        cid = conversation_id(req.headers, payload)
        if cid is None:
            return None
        conversation = conversation_key(req.tenant.name, cid)
        req.ctx.extra_headers.append((KEY_HEADER, conversation.encode()))
        if named(cid):
            req.lane.tier.named(conversation)  # disk tier: its state is written when it leaves a slot
        return conversation

    # --- forward; once more on the next child (``proxy.routes.replay``) ----------------------------------
    async def _attempts(self, req: _Request, grant: Grant) -> None:
        """Forward the admitted request; when its child dies (or hangs and is killed) before any byte of
        the answer reached the client, do it once more on the next READY child, alone with it
        (``proxy.routes.replay.Recovery`` says when, and when it is poison instead)."""
        ctx = req.ctx
        deadlines = _Deadlines(self.state.settings.timeouts, ctx.started)
        recovery = Recovery(
            self.state,
            req.lane,
            ctx,
            grant,
            req.received,
            self._deadline(req, deadlines),
            replayable=self.spec.replayable,
            entry=req.entry,
        )
        permit = grant.permit
        assert permit is not None
        ctx.admitted_at = time.monotonic()
        try:
            while True:
                permit = await recovery.before_attempt(permit)
                exchange = Exchange()
                snap: UpstreamSnapshot | None = None
                child_gone = False
                try:
                    # The child may have restarted while we queued: never mix its old address and new secret.
                    snap = req.lane.ready_snapshot()
                    await self._attempt(req, grant, permit, snap, exchange, deadlines)
                    return
                except UpstreamFailure as exc:
                    await recovery.failed(exc, snap)  # returns when the request is replayed, else raises
                    child_gone = True
                finally:
                    self._release(req, permit, exchange, snap, child_gone)
        finally:
            recovery.close()

    async def _attempt(
        self,
        req: _Request,
        grant: Grant,
        permit: Permit,
        snap: UpstreamSnapshot,
        exchange: Exchange,
        deadlines: _Deadlines,
    ) -> None:
        """One attempt on the child ``snap`` names, through its model's disk tier
        (``proxy.routes.tier_turn``), on the slot its permit pins when it pins one."""
        ctx, pin = req.ctx, permit.pin
        async with TierTurn(
            req.lane.tier,
            self.state.upstream,
            snap,
            pin,
            key=grant.ask.conversation if req.plan.reuse else None,
            tenant=req.tenant.name,
            request_id=ctx.request_id,
            tap=req.account.tap(self.fmt),
            fmt=self.fmt,
        ) as tier:
            relay = tier.relay = Relay(ctx, req.send, req.watch, self.fmt, exchange, tier.tap)
            req.account.relay = relay  # charged at the end: the last attempt's usage
            req.entry.running(relay)
            raw = (
                req.raw if pin is None or pin.slot is None else body.with_field(req.raw, "id_slot", pin.slot)
            )
            await self._forward(snap, req, raw, relay, deadlines)

    def _deadline(self, req: _Request, deadlines: _Deadlines) -> float:
        """The loop-clock deadline of a wait before the request's (next) attempt."""
        if req.plan.stream:
            return min(deadlines.first_at, deadlines.total_at)
        return deadlines.total_at

    def _release(
        self,
        req: _Request,
        permit: Permit,
        exchange: Exchange,
        snap: UpstreamSnapshot | None,
        child_gone: bool,
    ) -> None:
        """Give the attempt's permit back: at once when the child is gone or left nothing running (a dead
        child has no slot to free), else after the child noticed (``Exchange.linger_s``)."""
        linger_s = 0.0 if child_gone else exchange.linger_s()
        if linger_s > 0 and snap is not None:
            lane = req.lane
            settled = SlotsSettled(
                lane.snapshot, lane.gate, self.state.upstream, snap, permit.slots, req.ctx.request_id
            )
            permit.release(linger_s, settled.wait)
        else:
            permit.release()

    async def _forward(
        self, snap: UpstreamSnapshot, req: _Request, raw: bytes, relay: Relay, deadlines: _Deadlines
    ) -> None:
        ctx, plan = req.ctx, req.plan
        stream = plan.stream
        exchange = relay.exchange
        limit_bytes = self.state.settings.max_response_bytes
        timeouts = self.state.settings.timeouts
        first_at, total_at = deadlines.first_at, deadlines.total_at
        try:
            async with asyncio.timeout_at(min(first_at, total_at) if stream else total_at) as deadline:
                exchange.sent = True
                try:
                    response = await self.state.upstream.open(snap, "POST", self.route, raw, ctx.request_id)
                except UpstreamFailure:
                    exchange.sent = False  # never reached the child, or the child hung up: no slot busy
                    raise
                try:
                    if stream and response.status == 200:
                        await relay.stream(response, deadline, total_at, plan.hide)
                    elif (
                        plan.assemble is not None
                        and response.status == 200
                        and (response.content_type or b"").startswith(b"text/event-stream")
                    ):
                        await relay.assembled(response, plan.assemble, plan.hide, limit_bytes)
                    else:
                        await relay.whole(response, plan.hide, limit_bytes)
                    exchange.finished = True
                except AnswerTooLarge:
                    raise  # we hang up on a child still generating: its slot lingers like an abandon
                except UpstreamFailure:
                    exchange.finished = True  # the child hung up: it holds no slot for us any more
                    raise
                finally:
                    response.release()
        except TimeoutError:
            first_token = stream and ctx.ttft_s is None and first_at < total_at
            phase, limit = (
                ("first token", timeouts.first_token_s) if first_token else ("total", timeouts.total_s)
            )
            error = UpstreamTimeout(f"llama-server exceeded the {phase} deadline of {limit:g} s")
            if not ctx.response_started:
                raise error from None
            await relay.end_with(error)
        except asyncio.CancelledError:
            # An operator's cancel of a stream under way: the child's connection is closed (above), and
            # the client gets the error as the stream's last event. Before the 200 the watch raises it.
            cancelled = relay.watch.cancelled
            if cancelled is None or not ctx.response_started:
                raise
            await relay.end_with(cancelled)
