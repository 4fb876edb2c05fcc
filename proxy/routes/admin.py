"""The admin routes answered by the proxy itself: ``/metrics``, ``/admin/identity``, ``/admin/load`` and
``/admin/history``.

``GET /admin/load``: the admission gate's figures right now, per tenant, as JSON.

The same numbers as the ``llamagate_in_flight_requests`` / ``llamagate_queued_requests`` gauges on
``/metrics``, without making a browser parse Prometheus text or making every poll of the status page
scrape llama-server's own series too (``/metrics`` refreshes them).

Each model has its own gate (``proxy.models.lane``), shown under ``models`` by name; the top-level
figures are their sums (a one-model daemon: its one gate's), and the top-level ``tenants`` rows each
tenant's sums over the models beside its limits (``max_concurrency`` and ``max_queue`` apply per model,
``max_concurrency_total`` to the sum).

``priorities``, at the top and per model: per priority level (highest first; the request's own level,
as ``X-LlamaGate-Priority`` may have lowered it, not its aged one), the slots its requests hold and
the requests waiting (``proxy.admission.gate``, ``priority_loads``).

``GET /admin/history``: the last 15 minutes per served model, in 10 s buckets (``proxy.metrics.history``);
each read first samples the gates, so the newest bucket's ``queued`` and ``running`` include now.
"""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope, Send

from proxy.asgi.responses import send_bytes, send_json
from proxy.auth import Principal
from proxy.metrics.proxy import CONTENT_TYPE
from proxy.models.lane import Lane
from proxy.state import ProxyState


class Metrics:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        await send_bytes(send, 200, await self.state.metrics.render_fresh(), CONTENT_TYPE.encode())


class Identity:
    """``GET /admin/identity``: what is served (build, binary and model digests, host); admin only."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        await send_json(send, 200, dict(self.state.source.identity()))


class AdminLoad:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        await send_json(send, 200, load_report(self.state))


class AdminHistory:
    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        sample_gates(self.state)
        lanes = self.state.router.lanes
        await send_json(send, 200, self.state.metrics.history.report(list(lanes)))


# How often the gates' queued and running are sampled into the history: the buckets keep the highest.
SAMPLE_EVERY_S = 1.0


def sample_gates(state: ProxyState) -> None:
    gates = {name: lane.gate for name, lane in state.router.lanes.items()}
    state.metrics.history.sample({name: (adm.in_flight, adm.queued) for name, adm in gates.items()})


async def sample_history(state: ProxyState) -> None:
    """The app's timer (its lifespan runs it): a few attribute reads per model a second, off the request
    path."""
    while True:
        sample_gates(state)
        await asyncio.sleep(SAMPLE_EVERY_S)


def load_report(state: ProxyState) -> dict[str, object]:
    """Every model's gate together at the top (a one-model daemon: its one gate), each model's own
    under ``models``."""
    lanes = state.router.lanes
    models = {name: gate_report(state, lane) for name, lane in lanes.items()}  # sizes each gate first
    gates = [lane.gate for lane in lanes.values()]
    sums: dict[str, list[int]] = {}  # tenant -> [in flight, queued] over every model
    for adm in gates:
        for load in adm.loads():
            both = sums.setdefault(load.name, [0, 0])
            both[0] += load.in_flight
            both[1] += load.queued
    tenants = []
    for name, (in_flight, queued) in sums.items():
        settings = state.tenants.get(name)
        tenants.append(
            {
                "name": name,
                "in_flight": in_flight,
                "queued": queued,
                # A tenant's limits apply per model (each model's rows); max_concurrency_total bounds
                # the sum (proxy.admission.totals). None for a tenant removed by a reload whose last
                # requests are still running.
                "max_concurrency": settings.max_concurrency if settings else None,
                "max_queue": settings.max_queue if settings else None,
                "max_concurrency_total": settings.max_concurrency_total if settings else None,
            }
        )
    levels: dict[int, list[int]] = {}  # priority -> [in flight, queued] over every model
    for adm in gates:
        for level in adm.priority_loads():
            both = levels.setdefault(level.priority, [0, 0])
            both[0] += level.in_flight
            both[1] += level.queued
    return {
        "slots": sum(adm.capacity for adm in gates),
        "in_flight": sum(adm.in_flight for adm in gates),
        "queued": sum(adm.queued for adm in gates),
        "lingering": sum(adm.lingering for adm in gates),
        "answered": answered_report(state, list(lanes)),
        "tenants": tenants,
        "priorities": [
            {"priority": p, "in_flight": both[0], "queued": both[1]}
            for p, both in sorted(levels.items(), reverse=True)
        ],
        "models": models,
    }


def gate_report(state: ProxyState, lane: Lane) -> dict[str, object]:
    lane.snapshot()  # keeps the gate's capacity equal to the child's slots, as every request does
    adm = lane.gate
    tenants: list[dict[str, object]] = []
    for load in adm.loads():
        settings = state.tenants.get(load.name)
        tenants.append(
            {
                "name": load.name,
                "in_flight": load.in_flight,
                "queued": load.queued,
                "max_concurrency": settings.max_concurrency if settings else None,
                "max_queue": settings.max_queue if settings else None,
            }
        )
    return {
        "slots": adm.capacity,
        "in_flight": adm.in_flight,
        "queued": adm.queued,
        "lingering": adm.lingering,
        "answered": answered_report(state, [lane.name]),
        "tenants": tenants,
        "priorities": [
            {"priority": level.priority, "in_flight": level.in_flight, "queued": level.queued}
            for level in adm.priority_loads()
        ],
    }


def answered_report(state: ProxyState, models: list[str]) -> dict[str, int]:
    """``answered`` in ``/admin/load``: the generation requests ``models`` answered since the start
    (whatever their status) and the output tokens they relayed, summed; counters the status page turns
    into requests and tokens per second for its charts."""
    sums = [state.metrics.answered.get(name, [0, 0]) for name in models]
    return {"requests": sum(s[0] for s in sums), "output_tokens": sum(s[1] for s in sums)}
