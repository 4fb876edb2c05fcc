"""The probes: ``/healthz`` (liveness), ``/readyz`` (readiness, with why not) and llama-server's own
``/health``. They need no credentials and say nothing secret: state names, counts and the reason the
supervisor gave."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from proxy.asgi.context import SCOPE_KEY
from proxy.asgi.responses import send_json
from proxy.auth import Principal
from proxy.errors import NotReady
from proxy.state import ProxyState


class Healthz:
    """Liveness: the event loop that serves this also runs the supervisor, so an answer means both live."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        await send_json(send, 200, {"status": "ok"})


class Readyz:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        snap = self.state.source.snapshot()
        # The child may be fine while the proxy itself cannot take a new connection (at its cap, out of
        # file descriptors): a load balancer must hear that too.
        door = self.state.door.problem() if self.state.door is not None else None
        ready = snap.ready and door is None
        router = self.state.router
        body: dict[str, object] = {
            "state": snap.state,
            "ready": ready,
            "reason": door or snap.reason,
            # The default model's (the daemon's source names it), as a one-model client reads them.
            "model": snap.model_alias,
            "slots": snap.slots,
            "ctx_per_slot": snap.ctx_per_slot,
            "generation": snap.generation,
            # Every model's together (a one-model daemon: its own).
            "in_flight": self.state.in_flight,
            "queued": self.state.queued,
        }
        body.update({k: v for k, v in snap.info.items() if k not in body})
        # Each model's own state; ready only when every ``always`` model is.
        body["models"] = router.model_states()  # sizes each gate to its child's slots
        body["not_ready"] = router.not_ready()
        body["slots_total"] = sum(lane.gate.capacity for lane in router.lanes.values())
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


class Health:
    """llama-server's ``/health`` (and ``/v1/health``), answered from readiness without credentials, in
    the child's own words: ``200 {"status":"ok"}`` when ready, else ``503`` with its loading error shape
    (plus ``Retry-After``). Monitoring written for llama-server keeps working through the proxy."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        snap = self.state.source.snapshot()
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
