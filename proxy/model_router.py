"""Several models behind one door: the request's ``model`` picks a lane, and each lane is a
``ProxyRuntime`` of its own (its model's child, its own admission gate sized to that child's slots),
sharing the door's keys, tenants and upstream connection pool.

Tenants' limits (``max_concurrency``, ``max_queue``, ...) apply per model: each lane's gate keeps
its own count per tenant, so a tenant may hold ``max_concurrency`` slots of every model it uses at
once; ``max_concurrency_total`` bounds the sum over every lane (``proxy.tenant_totals``, one ledger
shared by the lanes). ``tenants[].models`` restricts which models a tenant may use at all.

A lane whose source can load on demand (``LoadsOnDemand``) is loaded by the request that finds it
unloaded; the wait happens before admission and counts toward the request's time to first token.
The daemon reads ``busy`` and ``last_used`` to unload an idle lane, and never one that holds or
awaits a slot.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.context import SCOPE_KEY, RequestContext
from proxy.disconnect import ClientWatch
from proxy.errors import BadRequest, Forbidden, ModelNotFound, NotReady
from proxy.readiness import UpstreamSnapshot, UpstreamSource
from proxy.routes import send_json
from proxy.runtime import ProxyRuntime
from proxy.settings import ProxySettings, TenantSettings

# Retry-After while a model restarts on SIGHUP: the old child drains and stops, then the new one loads.
RESTART_RETRY_S = 5.0
# Of a model's status fields, those /readyz shows under its name.
_MODEL_INFO = ("restarts", "last_failure", "uptime_s", "last_reload", "recovery")


@runtime_checkable
class LoadsOnDemand(Protocol):
    async def ensure_loaded(self) -> None:
        """Return once the model's child is READY; raise ``NotReady`` (with why) when it cannot be."""
        ...


@dataclass(frozen=True)
class ModelEntry:
    """What the daemon tells the proxy about one served model."""

    name: str
    aliases: tuple[str, ...]
    source: UpstreamSource
    residency: str = "always"  # "always" | "on_demand"


class Lane:
    def __init__(self, entry: ModelEntry, runtime: ProxyRuntime) -> None:
        self.entry = entry
        self.runtime = runtime
        self.last_used = time.monotonic()

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def busy(self) -> bool:
        adm = self.runtime.admission
        return adm.in_flight > 0 or adm.queued > 0 or adm.lingering > 0 or self.runtime.active > 0

    def touch(self) -> None:
        self.last_used = time.monotonic()


def _lane_settings(settings: ProxySettings, entry: ModelEntry) -> ProxySettings:
    return replace(settings, model_aliases=entry.aliases)


class ModelRouter:
    def __init__(self, main: ProxyRuntime, entries: Sequence[ModelEntry]) -> None:
        self.main = main
        self.lanes: dict[str, Lane] = {}
        # Name or alias -> name of a model being restarted with new settings (``remove``).
        self.restarting: dict[str, str] = {}
        for entry in entries:
            self.add(entry)

    def add(self, entry: ModelEntry) -> Lane:
        runtime = ProxyRuntime(_lane_settings(self.main.settings, entry), entry.source, self.main.metrics)
        runtime.upstream = self.main.upstream  # one connection pool; it is keyed by the child's address
        runtime.totals = self.main.totals  # tenants[].max_concurrency_total counts across every model
        lane = Lane(entry, runtime)
        self.lanes[entry.name] = lane
        self.restarting = {k: v for k, v in self.restarting.items() if v != entry.name}
        return lane

    def remove(self, name: str, *, restarting: bool = False) -> None:
        """No new request reaches the model. ``restarting``: it comes back (SIGHUP changed its
        settings), so until ``add`` brings it back its name and aliases answer 503 with Retry-After,
        never the 404 of a model that is not served."""
        lane = self.lanes.pop(name, None)
        if restarting and lane is not None:
            for key in (name, *lane.entry.aliases):
                self.restarting[key] = name

    def reload(self, settings: ProxySettings) -> None:
        for lane in self.lanes.values():
            lane.runtime.reload(_lane_settings(settings, lane.entry))

    def served(self) -> list[str]:
        return list(self.lanes)

    def resolve(self, model: Any, tenant: TenantSettings | None) -> Lane:
        """The lane a request's ``model`` names (its name or an alias); 404 listing what is served.
        ``tenant`` None (an admin-only key's tenant may be unconfigured): no ``models`` limit."""
        served = ", ".join(f"'{n}'" for n in self.lanes)
        if model is None and len(self.lanes) == 1:
            model = next(iter(self.lanes))  # one model served: a request need not name it
        if model is None:
            raise BadRequest(f"'model' is required: this server serves {served}")
        lane = None
        if isinstance(model, str):
            lane = self.lanes.get(model) or next(
                (la for la in self.lanes.values() if model in la.entry.aliases), None
            )
        if lane is None and isinstance(model, str) and model in self.restarting:
            raise NotReady(
                f"the model '{self.restarting[model]}' is restarting with new settings", RESTART_RETRY_S
            )
        if lane is None:
            shown = model if isinstance(model, str) and len(model) <= 200 else "(invalid)"
            raise ModelNotFound(f"The model '{shown}' does not exist; this server serves {served}")
        if tenant is not None and tenant.models and lane.name not in tenant.models:
            raise Forbidden(f"tenant '{tenant.name}' may not use the model '{lane.name}'")
        return lane

    def default(self, tenant: TenantSettings | None) -> Lane:
        """The lane of a passthrough request that names no model: the first ``always`` model the
        tenant may use (else its first ``on_demand`` one); 403 when it may use none."""
        usable = [
            lane
            for lane in self.lanes.values()
            if tenant is None or not tenant.models or lane.name in tenant.models
        ]
        if not usable:
            name = tenant.name if tenant is not None else "?"
            raise Forbidden(f"tenant '{name}' may use none of the served models")
        return next((la for la in usable if la.entry.residency == "always"), usable[0])

    async def load(self, lane: Lane, receive: Receive) -> None:
        """Wait until an on_demand lane's model is loaded (at once for the others). A client that leaves
        meanwhile ends its wait (``ClientGone``); the load itself goes on for whoever asks next. The body
        must have been read (``ClientWatch``)."""
        source = lane.entry.source
        if isinstance(source, LoadsOnDemand):
            async with ClientWatch(receive):
                await source.ensure_loaded()

    # --- what /readyz and /v1/models show -----------------------------------------------------------
    def model_states(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for name, lane in self.lanes.items():
            snap = lane.runtime.snapshot()
            out[name] = {
                "state": snap.state,
                "ready": snap.ready,
                "reason": snap.reason,
                "residency": lane.entry.residency,
                "aliases": list(lane.entry.aliases),
                "slots": snap.slots,
                "ctx_per_slot": snap.ctx_per_slot,
                "in_flight": lane.runtime.in_flight,
                "queued": lane.runtime.queued,
                **{k: v for k, v in snap.info.items() if k in _MODEL_INFO},
            }
        return out

    def not_ready(self) -> list[str]:
        """The ``always`` models that are not READY: /readyz is ready only when this is empty."""
        return [
            n
            for n, lane in self.lanes.items()
            if lane.entry.residency == "always" and not lane.runtime.snapshot().ready
        ]


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
