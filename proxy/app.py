"""``create_app``: the Starlette application that is the only door to llama-server.

The request path is kept short on purpose (the proxy's whole budget is a fraction of a millisecond):
``CorsMiddleware`` (a no-op unless ``proxy.cors`` lists origins) and ``RequestContextMiddleware``
(request id, error mapping, access log, metrics) around a dict lookup from path to a pure-ASGI endpoint
(one per row of ``proxy.routes.table``; a row whose path ends in one parameter, ``/admin/keys/{id}``,
is found by its prefix when the exact lookup misses). Starlette's default stack (ServerErrorMiddleware,
ExceptionMiddleware and a regex router) is not on the request path; its router still handles lifespan.
Nothing in the chain buffers a response body. ``app.add_middleware`` therefore has no effect on
requests: add layers here.

The daemon reads ``app.state.proxy`` (the door's state, ``proxy.state.ProxyState``) for drain, reload,
counters and the model router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Lifespan, Receive, Scope, Send

from proxy.accounts.service import Accounts
from proxy.admission.gate import SlotGate
from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.errors import MethodNotAllowed, NotFound
from proxy.metrics.picker import PickerGauges
from proxy.metrics.proxy import (
    AdmissionCollector,
    ClusterCollector,
    LedgerCollector,
    ProxyMetrics,
    Refreshable,
)
from proxy.metrics.tier import TierCollector
from proxy.middleware.context import RequestContextMiddleware, write_access_log
from proxy.middleware.cors import CorsMiddleware
from proxy.models.lane import ModelEntry
from proxy.routes.admin import sample_history
from proxy.routes.build import routes as table_routes
from proxy.routes.table import ROUTES, served_paths
from proxy.routes.ui import ui_routes
from proxy.settings import ProxySettings
from proxy.source import UpstreamSnapshot, UpstreamSource
from proxy.state import ProxyState

log = logging.getLogger("llamagate.proxy")

_PROBES = frozenset({"/healthz", "/readyz", "/health", "/v1/health"})
# The rows that take slot permits: what ``/admin/load``'s ``answered`` counts (the page's own polls
# and a monitor's probes are not traffic).
_GENERATION = frozenset(spec.path for spec in ROUTES if spec.takes_slots)


# A row's methods, its endpoint and its path as written (the request's label).
_Entry = tuple[frozenset[str], ASGIApp, str]


class _Dispatch:
    """Exact-path routing: one dict lookup. Unknown path: 404; known path, wrong method: 405. The few
    rows with a path parameter (``/admin/models/{name}/load``, admin only) are tried after a miss, in
    order, by Starlette's compiled pattern; their ``path_params`` go in the scope."""

    def __init__(self, routes: Sequence[Route], fallback: ASGIApp) -> None:
        # HEAD only for the probes: relayed upstream, a HEAD answer has a length but no body to wait for.
        def entry(r: Route) -> _Entry:
            return frozenset(r.methods or ()) - (set() if r.path in _PROBES else {"HEAD"}), r.app, r.path

        self._table = {r.path: entry(r) for r in routes if not r.param_convertors}
        self._patterns = [(r, entry(r)) for r in routes if r.param_convertors]
        self._fallback = fallback

    def _match(self, scope: Scope) -> _Entry | None:
        path: str = scope["path"]
        entry = self._table.get(path)
        if entry is not None or not self._patterns:
            return entry
        for route, found in self._patterns:
            matched = route.path_regex.match(path)
            if matched is not None:
                convert = route.param_convertors
                scope["path_params"] = {k: convert[k].convert(v) for k, v in matched.groupdict().items()}
                return found
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._fallback(scope, receive, send)  # lifespan
            return
        entry = self._match(scope)
        if entry is None:
            raise NotFound(f"Invalid URL ({scope['method']} {scope['path'][:200]})")
        methods, endpoint, route = entry
        if scope["method"] not in methods:
            ctx: RequestContext = scope[SCOPE_KEY]
            ctx.route = route  # a known row's path (bounded label set); only the method was wrong
            allow = ", ".join(sorted(methods))
            raise MethodNotAllowed(
                f"method {scope['method']} is not allowed on {scope['path']}", headers={"allow": allow}
            )
        await endpoint(scope, receive, send)


class ProxyApp(Starlette):
    """Starlette whose request path is ``RequestContextMiddleware`` around ``_Dispatch``."""

    def __init__(
        self, routes: list[Route], wrap: Callable[[ASGIApp], ASGIApp], lifespan: Lifespan[Any]
    ) -> None:
        super().__init__(routes=routes, lifespan=lifespan)
        self._wrap = wrap

    def build_middleware_stack(self) -> ASGIApp:
        return self._wrap(_Dispatch(self.router.routes, self.router))  # type: ignore[arg-type]


def create_app(
    settings: ProxySettings,
    source: UpstreamSource,
    models: Sequence[ModelEntry],
    *,
    registry: CollectorRegistry | None = None,
    extra_collectors: Iterable[Collector] = (),
    accounts: Accounts | None = None,
) -> Starlette:
    """The proxy app. ``source``: the daemon as a whole (readiness, draining, identity); ``models``: at
    least one served model, each with its own source (one model's daemon: a list of one). ``registry``:
    where the proxy's series go (a fresh one by default, never the global default);
    ``extra_collectors``: more series for the same ``/metrics``. ``accounts``: the store's keys, budgets
    and ledger, opened and started by the caller, who also flushes and closes them (None: no store)."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    metrics = ProxyMetrics(registry)
    state = ProxyState(settings, source, models, metrics, accounts)
    if accounts is not None:
        registry.register(LedgerCollector(accounts.stats))

    def gates() -> dict[str, SlotGate]:
        return {name: lane.gate for name, lane in state.router.lanes.items()}

    registry.register(AdmissionCollector(gates))

    def lanes() -> dict[str, tuple[SlotGate, Callable[[], UpstreamSnapshot]]]:
        return {name: (lane.gate, lane.entry.source.snapshot) for name, lane in state.router.lanes.items()}

    picker = PickerGauges(lanes, state.upstream)
    registry.register(picker)
    metrics.refreshers.append(picker)
    registry.register(ClusterCollector(lambda: state.cluster))
    registry.register(TierCollector(lambda: {name: lane.tier for name, lane in state.router.lanes.items()}))
    for collector in extra_collectors:
        registry.register(collector)
        if isinstance(collector, Refreshable):
            metrics.refreshers.append(collector)

    def observe(ctx: RequestContext, duration_s: float, method: str) -> None:
        reason = ctx.outcome.removeprefix("rejected:") if ctx.outcome.startswith("rejected:") else None
        metrics.observe_request(
            ctx.tenant or "-",
            ctx.model or "-",
            ctx.route,
            ctx.status,
            duration_s,
            reason,
            ctx.queue_wait_s,
            ctx.ttft_s,
            ctx.tpot_s,
            ctx.tokens,
        )
        if ctx.model is not None and ctx.route in _GENERATION:
            metrics.observe_answered(ctx.model, ctx.tokens, ctx.ttft_s, ctx.tpot_s)
        if state.settings.access_log and (ctx.route not in _PROBES or ctx.status >= 400):
            write_access_log(ctx, duration_s, method)
        if ctx.genai is not None and state.telemetry is not None:
            try:
                state.telemetry.record(ctx, duration_s)
            except Exception:  # the request is answered; telemetry must never turn it into an error
                log.exception("OpenTelemetry: recording a request failed")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sampler = asyncio.create_task(sample_history(state), name="history-sampler")
        state.start()
        try:
            yield
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await state.aclose()

    def wrap(inner: ASGIApp) -> ASGIApp:
        # CORS outermost: a preflight is answered before authentication, and the allow-origin header is
        # added to every answer, the context layer's error answers included.
        context = RequestContextMiddleware(inner, observe=observe, active=state.track_active)
        return CorsMiddleware(context, lambda: state.settings.cors, served_paths())

    app = ProxyApp([*table_routes(state), *ui_routes(state)], wrap, lifespan)
    app.state.proxy = state
    return app
