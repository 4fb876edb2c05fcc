"""Which lane answers a request: the request's ``model`` (its name or an alias) picks one served model's
lane (``proxy.models.lane``: its child, its own admission gate sized to that child's slots). There is
always at least one lane, and one model is a set of one: a request that names no model goes to the only
lane there is, and with several it must name one.

``tenants[].models`` restricts which models a tenant may use at all, and a store key's ``models`` (made
with ``llamagate keys new --models``) narrows that for the one key: a model outside either is a 403 that
says whose limit it is. A tenant's other limits apply per lane, and ``max_concurrency_total`` across
them (``proxy.admission.totals``, kept at the door).

An ``on_demand`` lane whose source can load on demand (``LoadsOnDemand``) is loaded by the request that
finds it unloaded; the wait happens before admission and counts toward the request's time to first token.
The daemon reads a lane's ``busy`` and ``last_used`` to unload an idle model, never one that holds or
awaits a slot, and drains a lane (``Lane.drain``) before it stops the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from starlette.types import Receive

from proxy.asgi.disconnect import ClientWatch
from proxy.errors import BadRequest, Forbidden, ModelNotFound, NotReady
from proxy.models.lane import Lane, LoadsOnDemand, ModelEntry
from proxy.settings import TenantSettings

# Retry-After while a model restarts on SIGHUP: the old child drains and stops, then the new one loads.
RESTART_RETRY_S = 5.0
# Of a model's status fields, those /readyz shows under its name.
_MODEL_INFO = ("restarts", "last_failure", "uptime_s", "last_reload", "recovery")


class ModelRouter:
    def __init__(self, entries: Sequence[ModelEntry], tenants: Iterable[TenantSettings]) -> None:
        self._tenants = tuple(tenants)
        self.lanes: dict[str, Lane] = {}
        # Name or alias -> name of a model being restarted with new settings (``remove``).
        self.restarting: dict[str, str] = {}
        for entry in entries:
            self.add(entry)

    def add(self, entry: ModelEntry) -> Lane:
        """Serve the model. One already served under that name keeps its lane (its gate and the requests
        on it) and takes the new entry: new aliases, residency or source."""
        lane = self.lanes.get(entry.name)
        if lane is None:
            lane = self.lanes[entry.name] = Lane(entry, self._tenants)
        else:
            lane.entry = entry
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

    def reload(self, tenants: Iterable[TenantSettings]) -> None:
        """New tenant limits for every lane's gate (SIGHUP); permits in flight keep theirs."""
        self._tenants = tuple(tenants)
        for lane in self.lanes.values():
            lane.gate.reconfigure(self._tenants)

    def only(self) -> Lane | None:
        """The lane of the one model served, known before a request's body is read; None with several
        (or while the only one restarts)."""
        if len(self.lanes) == 1 and not self.restarting:
            return next(iter(self.lanes.values()))
        return None

    def resolve(self, model: Any, tenant: TenantSettings | None, key_models: Sequence[str] = ()) -> Lane:
        """The lane a request's ``model`` names (its name or an alias; none at all when one model is
        served); 404 listing what is served. ``tenant`` None (an admin-only key's tenant may be
        unconfigured): no ``models`` limit. ``key_models``: the calling key's own limit (() = none)."""
        lane = self._lane(self._implied() if model is None else model)
        self._check_access(lane, tenant, key_models)
        return lane

    def _implied(self) -> str:
        """The model a request that names none asks for: the one served (or restarting), else 400."""
        only = self.only()
        if only is not None:
            return only.name  # one model: naming it is optional
        if not self.lanes and len(set(self.restarting.values())) == 1:
            return next(iter(self.restarting))  # the one model is restarting: its 503 follows
        raise BadRequest(f"'model' is required: this server serves {self._served()}")

    def _lane(self, model: Any) -> Lane:
        """The lane of a model's name or alias; 503 while it restarts, 404 when nothing serves it."""
        if isinstance(model, str):
            lane = self.lanes.get(model) or next(
                (la for la in self.lanes.values() if model in la.entry.aliases), None
            )
            if lane is not None:
                return lane
            if model in self.restarting:
                raise NotReady(
                    f"the model '{self.restarting[model]}' is restarting with new settings", RESTART_RETRY_S
                )
        shown = model if isinstance(model, str) and len(model) <= 200 else "(invalid)"
        raise ModelNotFound(f"The model '{shown}' does not exist; this server serves {self._served()}")

    @staticmethod
    def _check_access(lane: Lane, tenant: TenantSettings | None, key_models: Sequence[str]) -> None:
        """403 when the tenant's or the key's ``models`` limit leaves this lane out."""
        if tenant is not None and tenant.models and lane.name not in tenant.models:
            raise Forbidden(f"tenant '{tenant.name}' may not use the model '{lane.name}'")
        if key_models and lane.name not in key_models:
            raise Forbidden(
                f"this API key may not use the model '{lane.name}'; it is limited to "
                + ", ".join(f"'{m}'" for m in key_models)
            )

    def _served(self) -> str:
        """For a refusal's message only (not built for every request)."""
        return ", ".join(f"'{n}'" for n in self.lanes)

    def default(self, tenant: TenantSettings | None, key_models: Sequence[str] = ()) -> Lane:
        """The lane of a passthrough request that names no model: the first ``always`` model the
        tenant (and the key, ``key_models``) may use (else its first ``on_demand`` one); 403 when it
        may use none."""
        usable = [
            lane
            for lane in self.lanes.values()
            if (tenant is None or not tenant.models or lane.name in tenant.models)
            and (not key_models or lane.name in key_models)
        ]
        if not usable:
            name = tenant.name if tenant is not None else "?"
            whose = "this API key" if key_models else f"tenant '{name}'"
            raise Forbidden(f"{whose} may use none of the served models")
        return next((la for la in usable if la.entry.residency == "always"), usable[0])

    async def load(self, lane: Lane, receive: Receive) -> None:
        """Wait until an on_demand lane's model is loaded (at once for the others). A client that leaves
        meanwhile ends its wait (``ClientGone``); the load itself goes on for whoever asks next. The body
        must have been read (``ClientWatch``)."""
        if not lane.on_demand:
            return  # loaded for as long as it is served: nothing to wait for
        source = lane.entry.source
        if isinstance(source, LoadsOnDemand):
            async with ClientWatch(receive):
                await source.ensure_loaded()

    # --- what /readyz and /v1/models show -----------------------------------------------------------
    def model_states(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for name, lane in self.lanes.items():
            snap = lane.snapshot()
            out[name] = {
                "state": snap.state,
                "ready": snap.ready,
                "reason": snap.reason,
                "residency": lane.entry.residency,
                "aliases": list(lane.entry.aliases),
                "slots": snap.slots,
                "ctx_per_slot": snap.ctx_per_slot,
                "in_flight": lane.gate.in_flight,
                "queued": lane.gate.queued,
                # The load now (0..1 rising to 1.0 at READY), its step and the time left by the last
                # load of the same file (supervisor.child.loading).
                "progress": snap.progress,
                "load_step": snap.load_step,
                "load_eta_s": snap.load_eta_s,
                **{k: v for k, v in snap.info.items() if k in _MODEL_INFO},
            }
        return out

    def not_ready(self) -> list[str]:
        """The ``always`` models that are not READY: /readyz is ready only when this is empty."""
        return [
            n
            for n, lane in self.lanes.items()
            if lane.entry.residency == "always" and not lane.snapshot().ready
        ]
