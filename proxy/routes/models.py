"""``GET /v1/models`` (and ``/models``): what is served, by name, answered by the proxy (not relayed from a
child: there is one list for every model, a one-model daemon's being a list of one)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import Receive, Scope, Send

from proxy.asgi.responses import send_json
from proxy.auth import Principal
from proxy.source import UpstreamSnapshot
from proxy.state import ProxyState


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
    """Every served model, with its state, in the OpenAI shape plus a ``llamagate`` field; a tenant limited
    to some models (``tenants[].models``) sees those."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> None:
        tenant = self.state.tenants.get(who.tenant)
        data: list[Mapping[str, object]] = []
        for name, lane in self.state.router.lanes.items():
            if tenant is not None and tenant.models and name not in tenant.models:
                continue
            snap = lane.snapshot()
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
