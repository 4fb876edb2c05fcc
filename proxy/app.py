"""``create_app``: the Starlette application that is the only door to llama-server.

The request path is kept short on purpose (the proxy's whole budget is a fraction of a millisecond):
``CorsMiddleware`` (a no-op unless ``proxy.cors`` lists origins) and ``RequestContextMiddleware``
(request id, error mapping, access log, metrics) around a dict lookup from path to a pure-ASGI endpoint
(one per row of ``proxy.routes.table``). Starlette's default stack (ServerErrorMiddleware,
ExceptionMiddleware and a regex router) is not on the request path; its router still handles lifespan.
Nothing in the chain buffers a response body. ``app.add_middleware`` therefore has no effect on
requests: add layers here.

The daemon reads ``app.state.runtime`` (a ``ProxyRuntime``) for drain, reload and counters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Lifespan, Receive, Scope, Send

from proxy.admission.gate import Admission
from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.errors import MethodNotAllowed, NotFound
from proxy.metrics.proxy import AdmissionCollector, ProxyMetrics, Refreshable
from proxy.middleware.context import RequestContextMiddleware, write_access_log
from proxy.middleware.cors import CorsMiddleware
from proxy.routes.build import routes as table_routes
from proxy.routes.table import served_paths
from proxy.routes.ui import ui_routes
from proxy.settings import ProxySettings
from proxy.source import UpstreamSource
from proxy.state import ProxyRuntime

_PROBES = frozenset({"/healthz", "/readyz", "/health", "/v1/health"})


class _Dispatch:
    """Exact-path routing: one dict lookup. Unknown path: 404; known path, wrong method: 405."""

    def __init__(self, routes: Sequence[Route], fallback: ASGIApp) -> None:
        # HEAD only for the probes: relayed upstream, a HEAD answer has a length but no body to wait for.
        self._table = {
            r.path: (frozenset(r.methods or ()) - (set() if r.path in _PROBES else {"HEAD"}), r.app)
            for r in routes
        }
        self._fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._fallback(scope, receive, send)  # lifespan
            return
        entry = self._table.get(scope["path"])
        if entry is None:
            raise NotFound(f"Invalid URL ({scope['method']} {scope['path'][:200]})")
        methods, endpoint = entry
        if scope["method"] not in methods:
            ctx: RequestContext = scope[SCOPE_KEY]
            ctx.route = scope["path"]  # a known route (bounded label set); only the method was wrong
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
    upstream: UpstreamSource,
    *,
    registry: CollectorRegistry | None = None,
    extra_collectors: Iterable[Collector] = (),
) -> Starlette:
    """The proxy app. ``registry``: where the proxy's series go (a fresh one by default, never the global
    default); ``extra_collectors``: more series for the same ``/metrics``."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    metrics = ProxyMetrics(registry)
    runtime = ProxyRuntime(settings, upstream, metrics)

    def gates() -> dict[str, Admission]:
        # Several models: every lane's own gate (the door's is unused); one model: its one gate.
        router = runtime.router
        if router is None:
            return {runtime.source.snapshot().model_alias: runtime.admission}
        return {name: lane.runtime.admission for name, lane in router.lanes.items()}

    registry.register(AdmissionCollector(gates))
    for collector in extra_collectors:
        registry.register(collector)
        if isinstance(collector, Refreshable):
            metrics.refreshers.append(collector)

    def observe(ctx: RequestContext, duration_s: float, method: str) -> None:
        reason = ctx.outcome[9:] if ctx.outcome.startswith("rejected:") else None
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
        if runtime.settings.access_log and (ctx.route not in _PROBES or ctx.status >= 400):
            write_access_log(ctx, duration_s, method)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await runtime.aclose()

    def wrap(inner: ASGIApp) -> ASGIApp:
        # CORS outermost: a preflight is answered before authentication, and the allow-origin header is
        # added to every answer, the context layer's error answers included.
        context = RequestContextMiddleware(inner, observe=observe, active=runtime.track_active)
        return CorsMiddleware(context, lambda: runtime.settings.cors, served_paths())

    app = ProxyApp([*table_routes(runtime), *ui_routes(runtime)], wrap, lifespan)
    app.state.runtime = runtime
    return app
