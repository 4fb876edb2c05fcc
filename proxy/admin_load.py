"""``GET /admin/load``: the admission gate's figures right now, per tenant, as JSON; admin only.

The same numbers as the ``llamagate_in_flight_requests`` / ``llamagate_queued_requests`` gauges on
``/metrics``, without making a browser parse Prometheus text or making every poll of the status page
scrape llama-server's own series too (``/metrics`` refreshes them).

Several models (``models:``): each model has its own gate (``proxy.model_router``), shown under
``models`` by name; the top-level figures are their sums, and its ``tenants`` rows each tenant's sums
over the models with only ``max_concurrency_total`` (a tenant's other limits apply per model: see each
model's rows).
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from proxy.context import SCOPE_KEY, RequestContext
from proxy.routes import send_json
from proxy.runtime import ProxyRuntime

ROUTE = "/admin/load"


class AdminLoad:
    def __init__(self, runtime: ProxyRuntime) -> None:
        self.rt = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        self.rt.authorize(ctx, ROUTE, "admin")
        await send_json(send, 200, load_report(self.rt))


def load_report(rt: ProxyRuntime) -> dict[str, object]:
    if rt.router is None:
        return gate_report(rt)
    if len(rt.router.lanes) == 1:  # one model: its gate is the door's, with the limits
        ((name, lane),) = rt.router.lanes.items()
        return {**gate_report(lane.runtime), "models": {name: gate_report(lane.runtime)}}
    runtimes = {name: lane.runtime for name, lane in rt.router.lanes.items()}
    models = {name: gate_report(lane_rt) for name, lane_rt in runtimes.items()}  # sizes each gate first
    gates = [lane_rt.admission for lane_rt in runtimes.values()]
    sums: dict[str, list[int]] = {}  # tenant -> [in flight, queued] over every model
    for adm in gates:
        for load in adm.loads():
            both = sums.setdefault(load.name, [0, 0])
            both[0] += load.in_flight
            both[1] += load.queued
    return {
        "slots": sum(adm.capacity for adm in gates),
        "in_flight": sum(adm.in_flight for adm in gates),
        "queued": sum(adm.queued for adm in gates),
        "lingering": sum(adm.lingering for adm in gates),
        # Limits apply per model, so a sum has none (the page then shows the bare counts); the one
        # limit on the sum is the tenant's max_concurrency_total (proxy.tenant_totals).
        "tenants": [
            {
                "name": n,
                "in_flight": f,
                "queued": q,
                "max_concurrency": None,
                "max_queue": None,
                "max_concurrency_total": _total(rt, n),
            }
            for n, (f, q) in sums.items()
        ],
        "models": models,
    }


def _total(rt: ProxyRuntime, tenant: str) -> int | None:
    settings = rt.tenants.get(tenant)
    return settings.max_concurrency_total if settings else None


def gate_report(rt: ProxyRuntime) -> dict[str, object]:
    rt.snapshot()  # keeps the gate's capacity equal to the child's slots, as every request does
    adm = rt.admission
    tenants: list[dict[str, object]] = []
    for load in adm.loads():
        settings = rt.tenants.get(load.name)
        tenants.append(
            {
                "name": load.name,
                "in_flight": load.in_flight,
                "queued": load.queued,
                # None for a tenant removed by a reload whose last requests are still running.
                "max_concurrency": settings.max_concurrency if settings else None,
                "max_queue": settings.max_queue if settings else None,
            }
        )
    return {
        "slots": adm.capacity,
        "in_flight": adm.in_flight,
        "queued": adm.queued,
        "lingering": adm.lingering,
        "tenants": tenants,
    }
