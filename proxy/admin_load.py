"""``GET /admin/load``: the admission gate's figures right now, per tenant, as JSON; admin only.

The same numbers as the ``llamagate_in_flight_requests`` / ``llamagate_queued_requests`` gauges on
``/metrics``, without making a browser parse Prometheus text or making every poll of the status page
scrape llama-server's own series too (``/metrics`` refreshes them).
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
