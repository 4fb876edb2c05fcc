"""The one place the daemon meets the proxy's app: built with one lane per served model (one or
several, the same way), lanes added, replaced and removed on SIGHUP, a lane's use (for idle unloading)
and its drain, and the door's own state (keys, tenants, limits; the in-flight total) for reload and stop.
Every name of the proxy's the daemon uses is here, nowhere else in it.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.registry import Collector
from starlette.applications import Starlette

from proxy.app import create_app
from proxy.listener.guard import FrontDoor
from proxy.metrics.proxy import ProxyMetrics
from proxy.models.lane import ModelEntry
from proxy.settings import DoorSettings, ProxySettings
from proxy.source import UpstreamSource
from proxy.state import ProxyState
from supervisor.daemon.model_hosts import ModelHost


def _entry(host: ModelHost) -> ModelEntry:
    served = host.served
    return ModelEntry(served.name, served.aliases, host, served.residency)


class ProxyWiring:
    def __init__(
        self,
        settings: ProxySettings,
        door_source: UpstreamSource,
        hosts: Iterable[ModelHost],
        collectors: Iterable[Collector],
    ) -> None:
        self.app: Starlette = create_app(
            settings, door_source, [_entry(h) for h in hosts], extra_collectors=collectors
        )
        # The door's state (keys, tenants, the in-flight total, the router).
        self.runtime: ProxyState = self.app.state.proxy
        self._router = self.runtime.router

    # --- the door ------------------------------------------------------------------------------------
    @property
    def metrics(self) -> ProxyMetrics:
        return self.runtime.metrics

    def door_settings(self) -> DoorSettings:
        return self.runtime.settings.door

    def set_door(self, door: FrontDoor) -> None:
        self.runtime.door = door

    def reload(self, settings: ProxySettings) -> None:
        self.runtime.reload(settings)

    @property
    def active(self) -> int:
        return self.runtime.active

    async def drain(self, timeout_s: float) -> bool:
        return await self.runtime.drain(timeout_s)

    # --- one lane per model --------------------------------------------------------------------------
    def serve(self, host: ModelHost) -> None:
        """Route the model's name and aliases to ``host`` (a lane added, or replaced by its new entry)."""
        self._router.add(_entry(host))

    async def retire(self, name: str, timeout_s: float) -> None:
        """No new request reaches the model; wait (up to ``timeout_s``) for those in flight."""
        lane = self._router.lanes.get(name)
        self._router.remove(name)
        if lane is not None:
            await lane.drain(timeout_s)

    async def drain_lane(self, name: str, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until the model's lane has no request in flight."""
        lane = self._router.lanes.get(name)
        if lane is not None:
            await lane.drain(timeout_s)

    def usage(self, name: str) -> tuple[bool, float]:
        """(busy, last used on the monotonic clock) of the model's lane."""
        lane = self._router.lanes.get(name)
        if lane is None:
            return False, 0.0
        return lane.busy, lane.last_used
