"""The proxy's live state, shared by every request and exposed to the daemon as ``app.state.runtime``.

The daemon uses: ``drain(timeout_s)`` at shutdown (after the readiness snapshot says not ready, which
stops admission), ``reload(settings)`` on SIGHUP (keys, tenants and limits swap in; nothing restarts;
in-flight permits stay attached to the tenant state they came from), and ``in_flight`` / ``queued`` /
``active``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.admission.count_rate import CountRate
from proxy.admission.gate import Admission
from proxy.admission.idle import IdleWaiters
from proxy.admission.totals import TenantTotals
from proxy.asgi.context import RequestContext
from proxy.auth import KeyTable, Principal, require
from proxy.errors import Forbidden, NotReady
from proxy.listener.guard import FrontDoor
from proxy.metrics.proxy import ProxyMetrics
from proxy.settings import ProxySettings, TenantSettings
from proxy.settings import Scope as KeyScope
from proxy.source import UpstreamSnapshot, UpstreamSource
from proxy.upstream.pool import Upstream

if TYPE_CHECKING:
    from proxy.models.router import ModelRouter


class ProxyRuntime:
    def __init__(
        self,
        settings: ProxySettings,
        source: UpstreamSource,
        metrics: ProxyMetrics,
    ) -> None:
        self.source = source
        self.metrics = metrics
        self.admission = Admission(settings.tenants, capacity=0)
        self.upstream = Upstream(settings.timeouts)
        self._active = 0
        self._idle = IdleWaiters()
        # The listener's state (connection cap, accept failures) for /readyz; set by whoever serves the app.
        self.door: FrontDoor | None = None
        self.count_rate = CountRate(settings.count_rate_per_s, settings.count_burst)
        # Several models (``proxy.models.router``): set by the daemon; None serves the one ``source``.
        self.router: ModelRouter | None = None
        # A tenant's slots across every model; the router gives each model's lane the door's own.
        self.totals = TenantTotals()
        self._apply(settings)

    def _apply(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.keys = KeyTable(settings.keys, settings.anonymous_tenant)
        self.tenants: dict[str, TenantSettings] = {t.name: t for t in settings.tenants}

    # --- daemon-facing -----------------------------------------------------------------------------------
    def reload(self, settings: ProxySettings) -> None:
        """Swap keys, tenants, limits and timeouts in. The listener address is not reloadable."""
        self._apply(settings)
        self.upstream.timeouts = settings.timeouts
        self.admission.reconfigure(settings.tenants)
        self.count_rate.configure(settings.count_rate_per_s, settings.count_burst)
        if self.router is not None:
            self.router.reload(settings)

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    @property
    def queued(self) -> int:
        return self.admission.queued

    @property
    def lingering(self) -> int:
        """Slots still busy in the child after an abandoned request (see ``Admission``)."""
        return self.admission.lingering

    @property
    def active(self) -> int:
        """HTTP requests being handled right now, of any kind."""
        return self._active

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request is being handled; True if that happened within ``timeout_s``.
        Admission of new work is stopped by the snapshot (``ready=False``), not here."""
        if self._active == 0:
            return True
        return await self._idle.wait(timeout_s)

    async def aclose(self) -> None:
        await self.upstream.aclose()

    # --- request-facing ----------------------------------------------------------------------------------
    def track_active(self, delta: int) -> None:
        self._active += delta
        if self._active == 0:
            self._idle.wake()

    def authorize(self, ctx: RequestContext, route: str, scope: KeyScope) -> Principal:
        """Who is calling, recorded on the request for the access log and metrics (even when refused),
        and whether their key may use this route."""
        ctx.route = route
        principal = self.keys.authenticate(ctx.authorization, ctx.client_host)
        ctx.tenant, ctx.key_id = principal.tenant, principal.key_id
        require(principal, scope)
        return principal

    def snapshot(self) -> UpstreamSnapshot:
        """One consistent view of the child for this request; keeps the global gate equal to its slots."""
        snap = self.source.snapshot()
        if snap.slots != self.admission.capacity:
            self.admission.set_capacity(snap.slots)
        return snap

    def ready_snapshot(self) -> UpstreamSnapshot:
        snap = self.snapshot()
        if not snap.ready or snap.base_url is None:
            raise NotReady(f"llama-server is not ready ({snap.reason or snap.state})", snap.retry_after_s)
        return snap

    def tenant(self, name: str) -> TenantSettings:
        settings = self.tenants.get(name)
        if settings is None:
            raise Forbidden(f"tenant '{name}' is not configured")
        return settings
