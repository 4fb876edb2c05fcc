"""``GET /v1/models`` (and ``/models``): what is served, by name."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.asgi.responses import send_json
from proxy.source import UpstreamSnapshot
from proxy.state import ProxyRuntime


def loaded_state(snap: UpstreamSnapshot) -> str:
    """The OpenAI-side word for a child's state: loaded, loading, unloaded or failed."""
    if snap.state == "READY":
        return "loaded"
    if snap.state == "FAILED":
        return "failed"
    if snap.state in ("UNLOADED", "STOPPED"):
        return "unloaded"
    return "loading"


class ModelsRoute:
    """``GET /v1/models``: one model's daemon relays the child's answer (``single``); a several-model
    daemon lists every model, with its state, in the OpenAI shape plus a ``llamagate`` field."""

    def __init__(self, runtime: ProxyRuntime, single: ASGIApp) -> None:
        self.rt = runtime
        self.single = single

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        router = self.rt.router
        if router is None:
            await self.single(scope, receive, send)
            return
        ctx: RequestContext = scope[SCOPE_KEY]
        ctx.route = "/v1/models"
        principal = self.rt.authorize(ctx, "/v1/models", "inference")
        tenant = self.rt.tenants.get(principal.tenant)
        data: list[Mapping[str, object]] = []
        for name, lane in router.lanes.items():
            if tenant is not None and tenant.models and name not in tenant.models:
                continue
            snap = lane.runtime.snapshot()
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "llamagate",
                    "llamagate": {
                        "state": loaded_state(snap),
                        "supervisor_state": snap.state,
                        "residency": lane.entry.residency,
                        "aliases": list(lane.entry.aliases),
                        "slots": snap.slots,
                        "ctx_per_slot": snap.ctx_per_slot,
                        "embeddings": snap.embeddings,
                    },
                }
            )
        await send_json(send, 200, {"object": "list", "data": data})
