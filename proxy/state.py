"""The door's state, shared by every request and exposed to the daemon as ``app.state.proxy``.

What belongs to the door rather than to one model: settings, keys and tenants, the admission pipeline
every generation request enters (``pipeline``: ``proxy.admission.pipeline``, built here from the
settings and again on reload), every tenant's total across models (``totals``), the counting routes'
rate, the one upstream connection pool (it keeps connections per child), the model router (always set,
at least one lane: ``proxy.models``), the count of requests being handled (for the drain), the
generation requests queued or running (``inflight``, listed and cancelled by an operator:
``proxy.admission.inflight``), the listener's state (``door``, for /readyz) and, with a store, the
accounts (``accounts``: keys made at run time, budgets, the usage ledger; ``proxy.accounts``), the
budgets requests are charged to (``budgets``: the store's, or kept in memory when tenants have budgets
and there is no store), and with ``cluster.redis_url`` the limiter that shares tenants' concurrency and
budgets with the other replicas (``cluster``: ``proxy.cluster``) and shares the poison requests' memory
with them (``shared_poison``), and with ``telemetry:`` the OpenTelemetry exporters (``telemetry``:
``proxy.telemetry``).

The app's startup calls ``start`` (the cluster's watch of Redis and the poison listener run from then on,
with or without traffic).

The daemon uses: ``drain(timeout_s)`` at shutdown (after the readiness snapshot says not ready, which
stops admission), ``reload(settings)`` on SIGHUP (keys, tenants and limits swap in; nothing restarts;
in-flight permits stay attached to the tenant state they came from), ``router`` to add and remove
models, and ``active``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from proxy.accounts.budgets import Budgets
from proxy.accounts.service import Accounts, has_budgets, tenant_budgets
from proxy.admission.budgets import BudgetStep
from proxy.admission.count_rate import CountRate
from proxy.admission.idle import IdleWaiters
from proxy.admission.inflight import InFlight
from proxy.admission.pipeline import Pipeline, PromptCheck, Slots, Step
from proxy.admission.poison import Poison
from proxy.admission.totals import TenantTotals
from proxy.asgi.context import RequestContext
from proxy.auth import NOBODY, Access, KeyTable, Principal, require
from proxy.cluster.budgets import SharedBudgets
from proxy.cluster.limiter import ClusterLimiter
from proxy.cluster.poison import SharedPoison
from proxy.cluster.steps import LeaseStep, SharedBudgetStep
from proxy.errors import Forbidden
from proxy.metrics.proxy import ProxyMetrics
from proxy.models.lane import ModelEntry
from proxy.models.router import ModelRouter
from proxy.settings import ProxySettings, TenantSettings
from proxy.source import UpstreamSource
from proxy.telemetry import start as start_telemetry
from proxy.upstream.pool import Upstream


class DoorProblems(Protocol):
    """The listener's side of readiness (``proxy.listener.guard.FrontDoor``)."""

    def problem(self) -> str | None: ...


class ProxyState:
    def __init__(
        self,
        settings: ProxySettings,
        source: UpstreamSource,
        models: Sequence[ModelEntry],
        metrics: ProxyMetrics,
        accounts: Accounts | None = None,
    ) -> None:
        if not models:
            raise ValueError("the proxy serves at least one model")
        # The daemon as a whole: readiness, draining, identity, totals such as restarts.
        self.source = source
        self.metrics = metrics
        self.upstream = Upstream(settings.timeouts)
        self._active = 0
        self._idle = IdleWaiters()
        # Set by ``drain``: the daemon is stopping, so no new child is coming for a request that waits
        # for one (``proxy.routes.replay``).
        self.draining = False
        # The listener's state (connection cap, accept failures) for /readyz; set by whoever serves the app.
        self.door: DoorProblems | None = None
        self.count_rate = CountRate(settings.count_rate_per_s, settings.count_burst)
        # A tenant's slots across every model (tenants[].max_concurrency_total).
        self.totals = TenantTotals()
        # Every generation request queued or running, for every model (``GET /admin/requests``).
        self.inflight = InFlight()
        # Opened and started by the daemon (it owns the store's life); None: no store configured.
        self.accounts = accounts
        self._lookup = accounts.find_principal if accounts is not None else None
        # The budgets requests are charged to: the store's, else (tenants with budgets and no store) kept
        # in memory (they start empty at each start), else none (``proxy.accounts.budgets``).
        self.budgets: Budgets | None = accounts.budgets if accounts is not None else None
        # Tenant concurrency shared with the other replicas (``proxy.cluster``); None: this replica alone.
        # Not reloadable: the connection is made once.
        self.cluster = ClusterLimiter(settings.cluster) if settings.cluster is not None else None
        # The budget windows in the same Redis; a hold lives at most a request's longest life.
        self.shared_budgets = (
            SharedBudgets(self.cluster, settings.timeouts.total_s) if self.cluster is not None else None
        )
        self.router = ModelRouter(models, settings.tenants)
        # Poison requests' strikes and cool-downs (``proxy.admission.poison``): kept across reloads.
        self.poison = Poison(settings.poison)
        # With Redis, every replica's verdicts in every replica's memory (``proxy.cluster.poison``).
        self.shared_poison = SharedPoison(self.cluster, self.poison) if self.cluster is not None else None
        if self.shared_poison is not None:
            self.poison.share = self.shared_poison
        # OpenTelemetry's exporters (``proxy.telemetry``); None: off. Not reloadable: made once.
        self.telemetry = start_telemetry(settings.telemetry)
        self._apply(settings)

    def _apply(self, settings: ProxySettings) -> None:
        if self.budgets is None and has_budgets(settings.tenants):
            self.budgets = Budgets(tenant_budgets(settings.tenants))
        elif self.budgets is not None:
            self.budgets.configure(tenant_budgets(settings.tenants))  # new limits; windows keep counts
        self.settings = settings
        self.keys = KeyTable(settings.keys, settings.anonymous_tenant)
        self.tenants: dict[str, TenantSettings] = {t.name: t for t in settings.tenants}
        self.pipeline = self._pipeline()

    def _pipeline(self) -> Pipeline:
        """The admission pipeline's steps, in order (``proxy.admission.pipeline``): cheapest refusal first,
        nothing that holds a slot while it waits for something else, the shared ones only with
        ``cluster.redis_url``, the model's slots last."""
        steps: list[Step] = []
        if self.budgets is not None:
            steps.append(BudgetStep(self.budgets))
        if self.shared_budgets is not None:
            steps.append(SharedBudgetStep(self.shared_budgets))
        steps += [PromptCheck(), self.totals]
        if self.cluster is not None:
            steps.append(LeaseStep(self.cluster, self._estimate_wait))
        steps.append(Slots())
        return Pipeline(steps)

    def _estimate_wait(self, model: str, tenant: str) -> float:
        lane = self.router.lanes.get(model)
        return lane.gate.estimate_wait(tenant) if lane is not None else 1.0

    @property
    def budgeted(self) -> bool:
        """Requests are charged to budgets (a store's, or in memory)."""
        return self.budgets is not None

    # --- daemon-facing -----------------------------------------------------------------------------------
    def start(self) -> None:
        """The background work that runs whether requests come or not (in the app's loop, at startup)."""
        if self.cluster is not None:
            self.cluster.start()
        if self.shared_poison is not None:
            self.shared_poison.start()

    def reload(self, settings: ProxySettings) -> None:
        """Swap keys, tenants, limits and timeouts in. The listener address is not reloadable."""
        self._apply(settings)
        self.poison.configure(settings.poison)
        self.upstream.timeouts = settings.timeouts
        self.count_rate.configure(settings.count_rate_per_s, settings.count_burst)
        self.router.reload(settings.tenants)

    @property
    def in_flight(self) -> int:
        """Requests holding slot permits, every model together."""
        return sum(lane.gate.in_flight for lane in self.router.lanes.values())

    @property
    def queued(self) -> int:
        return sum(lane.gate.queued for lane in self.router.lanes.values())

    @property
    def lingering(self) -> int:
        """Slots still busy in a child after an abandoned request (see ``SlotGate``)."""
        return sum(lane.gate.lingering for lane in self.router.lanes.values())

    @property
    def active(self) -> int:
        """HTTP requests being handled right now, of any kind."""
        return self._active

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request is being handled; True if that happened within ``timeout_s``.
        Admission of new work is stopped by the snapshot (``ready=False``), not here."""
        self.draining = True
        if self._active == 0:
            return True
        return await self._idle.wait(timeout_s)

    async def aclose(self) -> None:
        await self.upstream.aclose()
        if self.shared_poison is not None:
            await self.shared_poison.aclose()
        if self.cluster is not None:
            await self.cluster.aclose()
        if self.telemetry is not None:
            await asyncio.to_thread(self.telemetry.shutdown)  # the last spans and metrics go out

    # --- request-facing ----------------------------------------------------------------------------------
    def track_active(self, delta: int) -> None:
        self._active += delta
        if self._active == 0:
            self._idle.wake()

    def authorize(self, ctx: RequestContext, access: Access) -> Principal:
        """Who is calling, recorded on the request for the access log and metrics (even when refused),
        and whether their key may use a route of this ``access``."""
        if access == "none":
            return NOBODY
        principal = self.keys.authenticate(ctx.authorization, ctx.client_host, self._lookup)
        ctx.tenant, ctx.key_id = principal.tenant, principal.key_id
        require(principal, access)
        return principal

    def tenant(self, name: str) -> TenantSettings:
        settings = self.tenants.get(name)
        if settings is None:
            raise Forbidden(f"tenant '{name}' is not configured")
        return settings
