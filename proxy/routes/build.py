"""One ASGI endpoint per row of ``proxy.routes.table``, chosen by the row's ``kind``.

Generation rows all go through ``Inference`` (the one admission path: permits, token caps, model check,
disconnect handling), differing only in their stream format. Anthropic rows are wrapped so their
credentials may come from ``x-api-key`` and their refusals are in Anthropic's error shape.
"""

from __future__ import annotations

from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.asgi.context import SCOPE_KEY
from proxy.errors import NotFound
from proxy.middleware.anthropic import AnthropicRoute
from proxy.routes.admin import AdminLoad, Identity, Metrics
from proxy.routes.inference import Inference
from proxy.routes.models import ModelsRoute
from proxy.routes.passthrough import Counting, Passthrough, Props
from proxy.routes.probes import Health, Healthz, Readyz
from proxy.routes.table import REFUSED, ROUTES, RouteSpec
from proxy.state import ProxyState
from proxy.streams.formats import ANTHROPIC, NATIVE, OPENAI, RESPONSES, SILENT, StreamFormat

FORMATS: dict[str, StreamFormat] = {
    "chat": OPENAI,
    "completions": OPENAI,
    "completion": NATIVE,
    "infill": NATIVE,
    "responses": RESPONSES,
    "messages": ANTHROPIC,
    "embeddings": SILENT,
    "rerank": SILENT,
}


def endpoint(state: ProxyState, spec: RouteSpec) -> ASGIApp:
    kind = spec.kind
    app: ASGIApp
    if spec.admission:
        silent = kind in ("embeddings", "rerank")
        app = Inference(state, spec.path, silent, fmt=FORMATS[kind], needs=spec.needs)
    elif kind == "count":
        app = Counting(state, spec.path)
    elif kind == "models":
        app = ModelsRoute(state)
    elif kind == "props":
        app = Props(state)
    elif kind == "health":
        app = Health(state, spec.path)
    elif kind == "liveness":
        app = Healthz()
    elif kind == "readiness":
        app = Readyz(state)
    elif kind == "metrics":
        app = Metrics(state)
    elif kind == "identity":
        app = Identity(state)
    elif kind == "load":
        app = AdminLoad(state)
    elif kind == "slots":
        app = Passthrough(state, spec.path, "admin", need_ready=False)
    else:  # pragma: no cover - the table's Literal type keeps this unreachable
        raise ValueError(f"no endpoint for kind {kind!r}")
    return AnthropicRoute(app) if spec.anthropic else app


class RefusedRoute:
    """A llama-server path the proxy does not serve on purpose (``table.REFUSED``): 404 with why."""

    def __init__(self, route: str, reason: str) -> None:
        self.route = route
        self.reason = reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SCOPE_KEY].route = self.route
        raise NotFound(f"{self.route} is not served through llamagate: {self.reason}")


def routes(state: ProxyState) -> list[Route]:
    served = [Route(spec.path, endpoint(state, spec), methods=list(spec.methods)) for spec in ROUTES]
    taken = {spec.path for spec in ROUTES}
    refused = [
        Route(r.path, RefusedRoute(r.path, r.reason), methods=list(r.methods))
        for r in REFUSED
        # A path parameter (/slots/:id_slot) is not an exact path: those answer 404 as unknown.
        if r.path not in taken and ":" not in r.path
    ]
    return served + refused
