"""One ASGI endpoint per row of ``proxy.routes.table``: the row's kind picks the endpoint, the row's
``access`` is checked before it runs (one auth step for every route: no endpoint decides who may call
it), and the row itself (stream format, cost kind, feature) configures it.

Generation rows all go through ``Inference`` (the one admission path: permits, token caps, model check,
disconnect handling). Anthropic rows are wrapped so their credentials may come from ``x-api-key`` and
their refusals are in Anthropic's shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.asgi.context import SCOPE_KEY, RequestContext
from proxy.auth import Access, Principal
from proxy.errors import NotFound
from proxy.middleware.anthropic import AnthropicRoute
from proxy.routes.admin import AdminHistory, AdminLoad, Identity, Metrics
from proxy.routes.inference import Inference
from proxy.routes.model_control import AdminModels, LoadModel, UnloadModel
from proxy.routes.models import ModelsRoute
from proxy.routes.passthrough import Counting, Passthrough, Props
from proxy.routes.probes import Health, Healthz, Readyz
from proxy.routes.requests import AdminRequests, CancelRequest
from proxy.routes.store_admin import AdminKey, AdminKeys, AdminUsage
from proxy.routes.table import REFUSED, ROUTES, Kind, RouteSpec
from proxy.state import ProxyState


class Endpoint(Protocol):
    """What serves one row, once its access is checked: ``who`` is the caller (``NOBODY`` on a route
    open to everyone)."""

    def __call__(self, scope: Scope, receive: Receive, send: Send, who: Principal) -> Awaitable[None]: ...


class Guarded:
    """A row's endpoint behind the row's access."""

    __slots__ = ("access", "endpoint", "path", "state")

    def __init__(self, state: ProxyState, spec: RouteSpec, endpoint: Endpoint) -> None:
        self.state = state
        self.path = spec.path
        self.access: Access = spec.access
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx: RequestContext = scope[SCOPE_KEY]
        ctx.route = self.path  # the row's path: a bounded label, even when the caller is refused
        who = self.state.authorize(ctx, self.access)
        await self.endpoint(scope, receive, send, who)


# What serves a row of each kind, made once per row when the app is built. Generation rows
# (``spec.takes_slots``) are not here: they all go through ``Inference``.
Factory = Callable[[ProxyState, RouteSpec], Endpoint]
ENDPOINTS: dict[Kind, Factory] = {
    "count": lambda state, spec: Counting(state, spec.path, schema=spec.body),
    "models": lambda state, spec: ModelsRoute(state),
    "props": lambda state, spec: Props(state, spec.path),
    "health": lambda state, spec: Health(state),
    "liveness": lambda state, spec: Healthz(),
    "readiness": lambda state, spec: Readyz(state),
    "metrics": lambda state, spec: Metrics(state),
    "identity": lambda state, spec: Identity(state),
    "load": lambda state, spec: AdminLoad(state),
    "history": lambda state, spec: AdminHistory(state),
    "admin_models": lambda state, spec: AdminModels(state),
    "model_load": lambda state, spec: LoadModel(state),
    "model_unload": lambda state, spec: UnloadModel(state),
    "requests": lambda state, spec: AdminRequests(state),
    "request": lambda state, spec: CancelRequest(state),
    "slots": lambda state, spec: Passthrough(state, spec.path, need_ready=False),
    "keys": lambda state, spec: AdminKeys(state),
    "key": lambda state, spec: AdminKey(state),
    "usage": lambda state, spec: AdminUsage(state),
}


def endpoint(state: ProxyState, spec: RouteSpec) -> Endpoint:
    if spec.takes_slots:
        return Inference(state, spec)
    return ENDPOINTS[spec.kind](state, spec)


class RefusedRoute:
    """A llama-server path the proxy does not serve on purpose (``table.REFUSED``): 404 with why."""

    def __init__(self, route: str, reason: str) -> None:
        self.route = route
        self.reason = reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SCOPE_KEY].route = self.route
        raise NotFound(f"{self.route} is not served through llamagate: {self.reason}")


def routes(state: ProxyState) -> list[Route]:
    served = []
    for spec in ROUTES:
        app: ASGIApp = Guarded(state, spec, endpoint(state, spec))
        if spec.anthropic:
            app = AnthropicRoute(app)
        served.append(Route(spec.path, app, methods=list(spec.methods)))
    taken = {spec.path for spec in ROUTES}
    refused = [
        Route(r.path, RefusedRoute(r.path, r.reason), methods=list(r.methods))
        for r in REFUSED
        # A path parameter (/slots/:id_slot) is not an exact path: those answer 404 as unknown.
        if r.path not in taken and ":" not in r.path
    ]
    return served + refused
