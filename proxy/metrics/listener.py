"""The optional second listener: ``GET /metrics`` without authentication, for a Prometheus agent on the
same host (``proxy.metrics_listener``; the config loader refuses a non-loopback address).

It serves the same registry as the main listener's admin-only ``/metrics`` (same ``render_fresh``, so
the same single cached llama-server scrape), and nothing else: no inference, no probes, no identity.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.metrics.proxy import CONTENT_TYPE, ProxyMetrics


def create_metrics_app(metrics: ProxyMetrics) -> Starlette:
    async def serve(request: Request) -> Response:
        return Response(await metrics.render_fresh(), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", serve, methods=["GET"])])
