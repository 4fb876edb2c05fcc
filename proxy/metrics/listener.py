"""The optional second listener: ``GET /metrics`` without authentication, for a Prometheus agent, a load
balancer or an endpoint picker (``proxy.metrics_listener``).

It serves the same registry as the main listener's admin-only ``/metrics`` (same ``render_fresh``, so
the same single cached llama-server scrape and ``/slots`` reading), and nothing else: no inference, no
probes, no identity.

Who may read it: the peers of ``allow`` (addresses or CIDRs; by default loopback only), checked against
the TCP peer's address (never a forwarded header: nothing sits in front of this listener). Any other
peer gets ``403`` with a one-line body naming the setting, before any route runs; an answer rather than
a closed connection, so an operator who forgot a CIDR sees why in the picker's or Prometheus's target
error instead of guessing at a network fault. The listener may bind to any address: it is the allow
list, not the bind, that keeps it private.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.metrics.proxy import CONTENT_TYPE, ProxyMetrics

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
_REFUSED = b"forbidden: this peer is not in proxy.metrics_listener.allow\n"


def networks(allow: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or CIDRs as networks (an address is a network of one). ``ValueError`` for a bad one;
    the config loader has refused those already."""
    return tuple(ipaddress.ip_network(a, strict=False) for a in allow)


def allowed(peer: str | None, nets: tuple[Network, ...]) -> bool:
    if peer is None:
        return False  # a Unix socket or a server that does not say: not a peer the list can name
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket shows IPv4 peers as ::ffff:a.b.c.d
    return any(address.version == net.version and address in net for net in nets)


class PeerAllowList:
    """Pure ASGI: 403 for an HTTP request whose TCP peer is outside ``nets``; the rest go to ``app``."""

    def __init__(self, app: ASGIApp, nets: tuple[Network, ...]) -> None:
        self.app = app
        self.nets = nets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            client = scope.get("client")
            if not allowed(client[0] if client else None, self.nets):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 403,
                        "headers": [
                            (b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(_REFUSED)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": _REFUSED})
                return
        await self.app(scope, receive, send)


def create_metrics_app(metrics: ProxyMetrics, allow: Iterable[str] = LOOPBACK) -> ASGIApp:
    async def serve(request: Request) -> Response:
        return Response(await metrics.render_fresh(), media_type=CONTENT_TYPE)

    return PeerAllowList(Starlette(routes=[Route("/metrics", serve, methods=["GET"])]), networks(allow))
