"""The inference routes: check, admit, forward, relay.

Order matters and is cheapest-refusal first: credentials (no body read for a stranger), readiness (503
before reading), body size and JSON, model name, the tenant's bounds (``proxy.limits``: ``n``, prompt
arrays, ``id_slot``, logprobs, token cap; it also says how many slots the request occupies), the
optional prompt-size check (before a slot is taken), then admission of that many slots, then the
child. With several models (``proxy.model_router``) the body is read before readiness, since its
``model`` names the child: then the model's lane (its own runtime and gate) is chosen, an unloaded
on_demand model is loaded (the wait counts toward TTFT), and the same steps follow on that lane. Every
step that can wait (queue, first token, the stream) runs under the client watch, so a
client that leaves releases what it held at once (not the on-demand load wait: the load is shared with
other requests and goes on; a client that left during it is noticed at admission).

Deadlines (``proxy.timeouts``): ``first_token_s`` from admission to the first generated token of a
stream; ``total_s`` from arrival to the last byte. A non-streamed answer only has the total deadline.

Non-streamed chat and completions are asked of the child as streams and assembled here
(``proxy.assemble`` says why: it is how a client that leaves stops the child's work at once).
Answers to keys that may not see prompt-cache hits go through ``proxy.privacy``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import Receive, Scope, Send

from proxy import body as bodies
from proxy import limits, privacy
from proxy.assemble import AnswerTooLarge, Assembler
from proxy.auth import Principal
from proxy.context import SCOPE_KEY, RequestContext
from proxy.disconnect import ClientWatch
from proxy.errors import ContextTooLarge, NotFound, UpstreamFailure, UpstreamTimeout
from proxy.readiness import UpstreamSnapshot
from proxy.runtime import ProxyRuntime
from proxy.settings import TenantSettings
from proxy.settle import SlotsSettled
from proxy.streams import OPENAI, Meter, StreamFormat
from proxy.upstream import UpstreamClosed, UpstreamResponse

# llama-server notices a closed connection at its next streamed token, or within its 1 s polling interval
# (HTTP_POLLING_SECONDS in server-context.cpp) while nothing is sent; then frees the slot.
CHILD_NOTICE_S = 1.2


class _Exchange:
    """What the child is doing for this request, to know whether abandoning it leaves its slot busy."""

    __slots__ = ("finished", "sent", "tpot_s")

    def __init__(self) -> None:
        self.sent = False
        self.finished = False
        self.tpot_s: float | None = None

    def linger_s(self) -> float:
        if not self.sent or self.finished:
            return 0.0
        if self.tpot_s is not None:  # generating: it notices at its next token write
            return min(CHILD_NOTICE_S, 4 * self.tpot_s + 0.1)
        return CHILD_NOTICE_S


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    # Tells nginx-like fronts not to buffer the stream either.
    (b"x-accel-buffering", b"no"),
]


class _Plan:
    """How this request goes to the child and back."""

    __slots__ = ("assemble", "hide", "stream")

    def __init__(self, stream: bool, assemble: limits.AssembledKind | None, hide: bool) -> None:
        self.stream = stream  # the client asked for a stream
        self.assemble = assemble  # non-streamed for the client, streamed from the child
        self.hide = hide  # strip prompt-cache detail from the answer


class Inference:
    """ASGI endpoint for one inference route (a generation row of ``proxy.route_table``), forwarded to
    the same path on the child. ``embeddings``: the answer generates no tokens (embeddings, rerank), so
    no token cap and no stream; ``needs``: the child feature the route requires; ``fmt``: how its stream
    is measured; ``kind``: how ``proxy.limits`` counts its cost (derived from the route when not given)."""

    def __init__(
        self,
        runtime: ProxyRuntime,
        route: str,
        embeddings: bool = False,
        *,
        fmt: StreamFormat = OPENAI,
        needs: str | None = None,
        kind: limits.RouteKind | None = None,
    ) -> None:
        self.rt = runtime
        self.route = route
        self.embeddings = embeddings
        self.fmt = fmt
        self.needs = needs if needs is not None else ("embeddings" if embeddings else None)
        self.kind: limits.RouteKind = kind or ("embedding" if embeddings else limits.route_kind(route))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = self.rt
        ctx: RequestContext = scope[SCOPE_KEY]
        principal = rt.authorize(ctx, self.route, "inference")
        tenant = rt.tenant(principal.tenant)
        router = rt.router
        if router is None:
            snap = rt.snapshot()
            ctx.model = snap.model_alias  # the one served model: the same label as with several
            if not snap.ready or snap.base_url is None:
                snap = rt.ready_snapshot()  # raises NotReady saying why
            if self.needs is not None and not getattr(snap, self.needs, False):
                raise NotFound(f"{self.route} is not enabled on this server (llama.{self.needs}: false)")
            raw = await bodies.read_body(receive, ctx.content_length, rt.settings.max_body_bytes)
            payload = bodies.parse_object(raw)
        else:
            # Several models: the body names the model, so it is read before readiness is known.
            raw = await bodies.read_body(receive, ctx.content_length, rt.settings.max_body_bytes)
            payload = bodies.parse_object(raw)
            lane = router.resolve(payload.get("model"), tenant)
            ctx.model = lane.name
            rt = lane.runtime
            lane.touch()
            if self.needs is not None and not getattr(rt.snapshot(), self.needs, False):
                raise NotFound(
                    f"{self.route} is not enabled for the model '{lane.name}' ({self.needs}: false)"
                )
            rt.track_active(1)  # the lane is busy from here: an idle unload must not pick it
            try:
                await router.load(lane, receive)
                snap = rt.ready_snapshot()
                await self._admitted(rt, ctx, principal, tenant, snap, raw, payload, send, receive)
            finally:
                rt.track_active(-1)
                lane.touch()
            return
        await self._admitted(rt, ctx, principal, tenant, snap, raw, payload, send, receive)

    async def _admitted(
        self,
        rt: ProxyRuntime,
        ctx: RequestContext,
        principal: Principal,
        tenant: TenantSettings,
        snap: UpstreamSnapshot,
        raw: bytes,
        payload: dict[str, Any],
        send: Send,
        receive: Receive,
    ) -> None:
        admin = "admin" in principal.scopes
        settings = rt.settings
        rewrite = bodies.check_model(payload, snap.model_alias, settings.model_aliases)
        if rewrite:
            payload["model"] = snap.model_alias
        cost = limits.check(self.kind, payload, tenant, admin=admin, capacity=snap.slots)
        rewrite = cost.rewritten or rewrite
        stream = payload.get("stream") is True and not self.embeddings
        if tenant.check_prompt_size:
            prompt_payload = dict(payload)  # as the client sent it: counted before we make it a stream
        assemble = None if stream else limits.assembled_kind(self.route, payload)
        if assemble is not None:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
            # Progress events while the prompt is processed: the child writes, so it notices a client
            # that left during a long prompt too, not only once it generates (consumed here, never sent).
            payload["return_progress"] = True
            rewrite = True
        if rewrite:
            raw = bodies.dump(payload)
        plan = _Plan(stream, assemble, hide=not (admin or tenant.show_cache_details))

        async with ClientWatch(receive) as watch:
            if tenant.check_prompt_size:
                # Re-read: the child may have restarted while the body was on its way.
                await self._check_prompt_size(rt.ready_snapshot(), prompt_payload, ctx.request_id)
            with rt.totals.hold(tenant, cost.slots):
                permit = await rt.admission.acquire(tenant.name, cost.slots)
                exchange = _Exchange()
                try:
                    ctx.queue_wait_s = permit.queue_wait_s
                    # The child may have restarted while we queued: never mix its old address and new
                    # secret.
                    snap = rt.ready_snapshot()
                    await self._forward(snap, raw, plan, send, watch, ctx, exchange)
                finally:
                    linger_s = exchange.linger_s()
                    if linger_s > 0:
                        settled = SlotsSettled(rt, snap, permit.slots, ctx.request_id)
                        permit.release(linger_s, settled.wait)
                    else:
                        permit.release()

    async def _forward(
        self,
        snap: UpstreamSnapshot,
        raw: bytes,
        plan: _Plan,
        send: Send,
        watch: ClientWatch,
        ctx: RequestContext,
        exchange: _Exchange,
    ) -> None:
        stream = plan.stream
        timeouts = self.rt.settings.timeouts
        loop = asyncio.get_running_loop()
        total_at = loop.time() + timeouts.total_s - (time.monotonic() - ctx.started)
        first_at = loop.time() + timeouts.first_token_s
        try:
            async with asyncio.timeout_at(min(first_at, total_at) if stream else total_at) as deadline:
                exchange.sent = True
                try:
                    response = await self.rt.upstream.open(snap, "POST", self.route, raw, ctx.request_id)
                except UpstreamFailure:
                    exchange.sent = False  # never reached the child, or the child hung up: no slot busy
                    raise
                try:
                    if stream and response.status == 200:
                        meter = self.fmt.meter()
                        rewriter = privacy.SseRewriter() if plan.hide else None
                        await self._relay_stream(
                            response, send, watch, ctx, meter, deadline, total_at, exchange, rewriter
                        )
                    elif (
                        plan.assemble is not None
                        and response.status == 200
                        and (response.content_type or b"").startswith(b"text/event-stream")
                    ):
                        await self._relay_assembled(response, send, watch, ctx, plan, exchange)
                    else:
                        await self._relay_whole(response, send, watch, ctx, plan.hide)
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
            await self._end_stream_with(error, send, watch, ctx)

    async def _relay_stream(
        self,
        response: UpstreamResponse,
        send: Send,
        watch: ClientWatch,
        ctx: RequestContext,
        meter: Meter,
        deadline: asyncio.Timeout,
        total_at: float,
        exchange: _Exchange,
        rewriter: privacy.SseRewriter | None = None,
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        send = ctx.raw_send or send  # headers are out: body chunks go straight to the server
        clock = time.monotonic
        try:
            while (chunk := await response.next_chunk()) is not None:
                if meter.feed(chunk, clock()):
                    ctx.ttft_s = meter.ttft_from(ctx.started)
                    deadline.reschedule(total_at)  # first token in: only the total deadline is left
                out = chunk if rewriter is None else rewriter.feed(chunk)
                if response.at_end:
                    # The child's last chunk ([DONE]) and its end arrived together: one write, not two.
                    if rewriter is not None:
                        out += rewriter.flush()
                    exchange.finished = watch.complete = True
                    await send({"type": "http.response.body", "body": out, "more_body": False})
                    return
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            exchange.finished = True
            if rewriter is not None and (rest := rewriter.flush()):
                await send({"type": "http.response.body", "body": rest, "more_body": True})
        except UpstreamClosed:
            exchange.finished = True  # the child ended it
            error = UpstreamFailure("llama-server closed the stream before it was complete")
            await self._end_stream_with(error, send, watch, ctx)
            return
        finally:
            ctx.tokens = meter.tokens
            ctx.tpot_s = exchange.tpot_s = meter.tpot()
        watch.complete = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay_whole(
        self, response: UpstreamResponse, send: Send, watch: ClientWatch, ctx: RequestContext, hide: bool
    ) -> None:
        limit = self.rt.settings.max_response_bytes
        parts: list[bytes] = []
        size = 0
        try:
            while (chunk := await response.next_chunk()) is not None:
                size += len(chunk)
                if size > limit:
                    raise AnswerTooLarge(
                        f"the answer exceeds the proxy's limit of {limit} bytes for non-streamed answers"
                    )
                parts.append(chunk)
        except UpstreamClosed:
            raise UpstreamFailure(
                "llama-server closed the connection before the answer was complete"
            ) from None
        content = parts[0] if len(parts) == 1 else b"".join(parts)
        if response.status == 200:
            ctx.tokens = self.fmt.count_tokens(content)
            if hide:
                content = privacy.strip_json(content)
        else:
            ctx.outcome = "upstream_error"
            content = self.fmt.error_body(response.status, content)
        await self._send_whole(send, watch, response.status, content, response.content_type)

    async def _relay_assembled(
        self,
        response: UpstreamResponse,
        send: Send,
        watch: ClientWatch,
        ctx: RequestContext,
        plan: _Plan,
        exchange: _Exchange,
    ) -> None:
        assert plan.assemble is not None
        assembler = Assembler(plan.assemble, self.rt.settings.max_response_bytes)
        meter = self.fmt.meter()
        clock = time.monotonic
        try:
            while (chunk := await response.next_chunk()) is not None:
                meter.feed(chunk, clock())
                assembler.feed(chunk)
        except UpstreamClosed:
            raise UpstreamFailure(
                "llama-server closed the connection before the answer was complete"
            ) from None
        finally:
            # Known while it generates: how soon the child notices if we abandon it (see ``_Exchange``).
            exchange.tpot_s = meter.tpot()
        exchange.finished = True
        status, answer = assembler.answer()
        if status == 200:
            usage = answer.get("usage")
            tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
            ctx.tokens = tokens if isinstance(tokens, int) else meter.tokens
            if plan.hide:
                answer = privacy.strip(answer)
        else:
            ctx.outcome = "upstream_error"
        await self._send_whole(send, watch, status, bodies.dump(answer), b"application/json")

    @staticmethod
    async def _send_whole(
        send: Send, watch: ClientWatch, status: int, content: bytes, content_type: bytes | None
    ) -> None:
        headers = [
            (b"content-type", content_type or b"application/json"),
            (b"content-length", b"%d" % len(content)),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        watch.complete = True
        await send({"type": "http.response.body", "body": content, "more_body": False})

    async def _end_stream_with(
        self, error: UpstreamFailure, send: Send, watch: ClientWatch, ctx: RequestContext
    ) -> None:
        """llama-server's own convention for an error after the 200: one error event, no ``[DONE]``."""
        ctx.outcome = error.outcome
        watch.complete = True
        await send({"type": "http.response.body", "body": self.fmt.error_event(error), "more_body": False})

    async def _check_prompt_size(
        self, snap: UpstreamSnapshot, payload: dict[str, Any], request_id: str
    ) -> None:
        n_tokens = await count_prompt_tokens(self.rt, snap, self.route, payload, request_id)
        # llama-server refuses a prompt of n_ctx tokens or more (it needs room for one generated token).
        if n_tokens is not None and n_tokens >= snap.ctx_per_slot:
            raise ContextTooLarge(n_tokens, snap.ctx_per_slot)


# The child's own counter for a templated request: its chat template, not ours.
COUNT_ROUTES = {
    "/v1/chat/completions": "/v1/chat/completions/input_tokens",
    "/chat/completions": "/v1/chat/completions/input_tokens",
    "/v1/responses": "/v1/responses/input_tokens",
    "/responses": "/v1/responses/input_tokens",
    "/v1/messages": "/v1/messages/count_tokens",
}


async def count_prompt_tokens(
    rt: ProxyRuntime, snap: UpstreamSnapshot, route: str, payload: dict[str, Any], request_id: str
) -> int | None:
    """Exact prompt size from the child's own tokenizer and chat template; None when it cannot be told
    (then the child decides, as it would without the check)."""
    counter = COUNT_ROUTES.get(route)
    if counter is not None:
        answer = await _ask(rt, snap, counter, bodies.dump(payload), request_id)
        count = answer.get("input_tokens") if answer else None
        return count if isinstance(count, int) else None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    longest: int | None = None
    for text in prompts:
        if not isinstance(text, str):
            return None
        answer = await _ask(
            rt, snap, "/tokenize", bodies.dump({"content": text, "add_special": True}), request_id
        )
        tokens = answer.get("tokens") if answer else None
        if not isinstance(tokens, list):
            return None
        longest = max(longest or 0, len(tokens))
    return longest


async def _ask(
    rt: ProxyRuntime, snap: UpstreamSnapshot, path: str, raw: bytes, request_id: str
) -> dict[str, Any]:
    limit = rt.settings.timeouts.first_token_s
    try:
        async with asyncio.timeout(limit):
            response = await rt.upstream.open(snap, "POST", path, raw, request_id)
            try:
                content = await response.read()
            except UpstreamClosed:
                raise UpstreamFailure(
                    "llama-server closed the connection while counting the prompt's tokens"
                ) from None
            finally:
                response.release()
    except TimeoutError:
        raise UpstreamTimeout(f"llama-server did not count the prompt's tokens within {limit:g} s") from None
    if response.status != 200:
        return {}
    try:
        answer = bodies.parse_object(content)
    except Exception:
        return {}
    return answer
