"""The one place the daemon meets the proxy's app: built with one lane per served model (one or
several, the same way), lanes added, replaced and removed on SIGHUP, a lane's use (for idle unloading)
and its drain, the door's own state (keys, tenants, limits; the in-flight total) for reload and stop, and
the accounts store (``open_accounts``: opened by ``serve`` before the models are prepared, so a bad file
fails the start at once; started, flushed and closed by the daemon). Every name of the proxy's the
daemon uses is here, nowhere else in it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prometheus_client.registry import Collector
from starlette.applications import Starlette

from proxy.accounts.engines import inspect_configured_store
from proxy.accounts.ledger import LedgerStats
from proxy.accounts.service import Accounts
from proxy.accounts.store import StoreError
from proxy.app import create_app
from proxy.listener.guard import FrontDoor
from proxy.metrics.proxy import ProxyMetrics
from proxy.models.lane import Lane, ModelEntry
from proxy.settings import DoorSettings, ProxySettings
from proxy.source import UpstreamSnapshot, UpstreamSource
from proxy.state import ProxyState
from proxy.upstream.slot_actions import ChildSlots
from supervisor.config.proxy_settings import proxy_settings
from supervisor.config.schema import Config
from supervisor.daemon.model_hosts import ModelHost
from supervisor.errors import Misconfigured


def open_accounts(cfg: Config) -> Accounts | None:
    """The store of ``cfg`` opened as the daemon's (SQLite: its lock taken, one daemon per file;
    PostgreSQL: shared by every replica); None without ``store:``. A store that cannot be used is
    ``Misconfigured`` (exit 2) naming it and what is wrong."""
    settings = proxy_settings(cfg)
    if settings.store is None:
        return None
    try:
        return Accounts.open(settings.store, settings.tenants)
    except StoreError as exc:
        raise Misconfigured(str(exc)) from exc


def check_store(cfg: Config) -> str | None:
    """What ``config check`` says of the store, changing nothing (None without one); ``Misconfigured``
    for a file ``serve`` would refuse."""
    settings = proxy_settings(cfg).store
    if settings is None:
        return None
    try:
        return inspect_configured_store(settings)
    except StoreError as exc:
        raise Misconfigured(str(exc)) from exc


class DaemonAccounts:
    """The store's life in the daemon: started with the daemon, flushed in the drain, closed at stop."""

    def __init__(self, accounts: Accounts | None) -> None:
        self.accounts = accounts

    def start(self) -> None:
        if self.accounts is None:
            return
        try:
            self.accounts.start()
        except StoreError as exc:
            raise Misconfigured(str(exc)) from exc

    async def flush(self, timeout_s: float) -> tuple[bool, LedgerStats] | None:
        """Write what the ledger holds (off the loop); (done, the ledger's figures) or None without one."""
        if self.accounts is None:
            return None
        done = await asyncio.to_thread(self.accounts.flush, timeout_s)
        return done, self.accounts.stats()

    async def close(self) -> None:
        if self.accounts is not None:
            accounts, self.accounts = self.accounts, None
            await asyncio.to_thread(accounts.close)


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
        accounts: Accounts | None = None,
    ) -> None:
        self.app: Starlette = create_app(
            settings, door_source, [_entry(h) for h in hosts], extra_collectors=collectors, accounts=accounts
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

    async def save_states(self, name: str, snap: UpstreamSnapshot) -> int:
        """Save the conversation states of the slots of the model's child ``snap`` (its supervisor's
        own snapshot) to disk: the child is about to stop on purpose, and the next child of the same
        identity restores them. How many were saved."""
        lane: Lane | None = self._router.lanes.get(name)
        if lane is None:
            return 0
        return await lane.save_states(snap, ChildSlots(self.runtime.upstream, snap, "llamagate-stop"))

    def states_lost(self, name: str) -> int:
        """The model's states folder was removed under it and made again: its tier forgets what it held
        (``Lane.states_lost``); how many states it knew of."""
        lane: Lane | None = self._router.lanes.get(name)
        return lane.states_lost() if lane is not None else 0

    def usage(self, name: str) -> tuple[bool, float]:
        """(busy, last used on the monotonic clock) of the model's lane."""
        lane = self._router.lanes.get(name)
        if lane is None:
            return False, 0.0
        return lane.busy, lane.last_used
