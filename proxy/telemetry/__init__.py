"""OpenTelemetry: a trace and the GenAI server metrics of each generation request, exported over OTLP/HTTP.

Optional twice over: the ``otel`` extra brings the SDK and the OTLP/HTTP exporter, and the ``telemetry:``
section turns it on (``ProxySettings.telemetry``). Without the section ``start`` returns None and no
module of OpenTelemetry is imported; the endpoint then sets no ``RequestContext.genai`` and every step
below is skipped.

With it, the endpoint fills ``ctx.genai`` (``proxy.asgi.context.GenAI``: the operation, the request's
parameters, the caller's ``traceparent``, when admission began, replays), the account adds what the
request was charged and how the answer ended (``proxy.routes.charge``), and when the request is done
``record`` writes its spans and metrics at once from those figures and the context's times (arrival,
queue wait, time to first token, duration): nothing of OpenTelemetry runs while the request is in
flight, and the SDK's batch processor and periodic reader send from their own threads. The mapping of
every span, metric and attribute is in docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from proxy.asgi.context import RequestContext
from proxy.settings import TelemetrySettings


class Telemetry(Protocol):
    def record(self, ctx: RequestContext, duration_s: float) -> None:
        """One generation request, done: its spans and metrics (``ctx.genai`` is set)."""

    def child_event(self, name: str, attributes: Mapping[str, str | int | float]) -> None:
        """An event of a served model's child (``llamagate.child.hang``): a span of its own, at once."""

    def shutdown(self) -> None:
        """Export what is pending and stop (blocking: run it in a thread)."""


def start(settings: TelemetrySettings | None) -> Telemetry | None:
    """The exporters for ``settings``; None (and nothing imported) when telemetry is off."""
    if settings is None:
        return None
    from proxy.telemetry.otel import OtelTelemetry  # only now: the otel extra may be missing

    return OtelTelemetry(settings)
