"""The operator's model routes (admin only): ``GET /admin/models`` lists every served model with its
state, residency, memory share, last use, loads and load progress; ``POST /admin/models/{name}/load``
loads one and answers once it is READY; ``POST /admin/models/{name}/unload`` drains its lane (up to
``proxy.drain_timeout_s``) and stops its child.

The proxy knows the lanes; what only the daemon knows (the model's budget, its loads) and what only it
can do (start and stop a child) come from the model's source as an ``OperatorControl``
(``proxy.models.lane``). Refusals say why: an unknown model is ``404`` naming the served ones, an
``always`` model cannot be unloaded (``409``), a load that does not fit the memory budget is ``503`` with
Retry-After naming the models that hold the memory.
"""

from __future__ import annotations

import time

from starlette.types import Receive, Scope, Send

from proxy.asgi.responses import send_json
from proxy.auth import Principal
from proxy.errors import Conflict, ModelNotFound, NotReady
from proxy.models.lane import Lane, OperatorControl
from proxy.state import ProxyState


def model_row(lane: Lane) -> dict[str, object]:
    """One model as ``/admin/models`` shows it."""
    snap = lane.snapshot()
    row: dict[str, object] = {
        "name": lane.name,
        "state": snap.state,
        "ready": snap.ready,
        "reason": snap.reason,
        "residency": lane.entry.residency,
        "aliases": list(lane.entry.aliases),
        # Seconds since a request last chose this model (or since it was first served).
        "idle_s": round(max(0.0, time.monotonic() - lane.last_used), 3),
        "in_flight": lane.gate.in_flight,
        "queued": lane.gate.queued,
        "progress": snap.progress,
        "load_step": snap.load_step,
        "load_eta_s": snap.load_eta_s,
        "budget_bytes": None,
        "budget_share": None,
        "loads": None,
    }
    source = lane.entry.source
    if isinstance(source, OperatorControl):
        row.update(source.control_report())
    return row


def _lane(state: ProxyState, scope: Scope) -> Lane:
    name = scope["path_params"]["name"]
    lane = state.router.lanes.get(name)
    if lane is None:
        served = ", ".join(f"'{n}'" for n in state.router.lanes)
        shown = name if len(name) <= 200 else "(invalid)"
        raise ModelNotFound(f"The model '{shown}' does not exist; this server serves {served}")
    return lane


def _control(lane: Lane) -> OperatorControl:
    source = lane.entry.source
    if not isinstance(source, OperatorControl):
        raise Conflict(f"the model '{lane.name}' cannot be loaded or unloaded by an operator")
    return source


class AdminModels:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        rows = [model_row(lane) for lane in self.state.router.lanes.values()]
        await send_json(send, 200, {"models": rows})


class LoadModel:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        lane = _lane(self.state, scope)
        await _control(lane).load()
        await send_json(send, 200, model_row(lane))


class UnloadModel:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        lane = _lane(self.state, scope)
        if lane.entry.residency == "always":
            raise Conflict(
                f"the model '{lane.name}' has residency 'always' and cannot be unloaded; "
                "only on_demand models (models[].residency) can"
            )
        control = _control(lane)
        timeout_s = self.state.settings.drain_timeout_s
        if not await lane.drain(timeout_s):
            raise NotReady(
                f"the model '{lane.name}' still has requests in flight after {timeout_s:g} s"
                " (proxy.drain_timeout_s); not unloaded",
                timeout_s,
            )
        await control.unload("unloaded by an operator")
        await send_json(send, 200, model_row(lane))
