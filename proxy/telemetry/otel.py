"""The OpenTelemetry SDK's side of ``proxy.telemetry``: imported only when the ``telemetry:`` section is set.

Names follow the GenAI semantic conventions (open-telemetry/semantic-conventions-genai): the server span
``{gen_ai.operation.name} {gen_ai.request.model}`` and the three ``gen_ai.server.*`` histograms with the
spec's bucket boundaries, which are stable; the token usage histogram is the conventions'
``gen_ai.client.token.usage`` (experimental: the spec is renaming the client metrics). llamagate's own
attributes are under ``llamagate.``. The providers are this object's own, never the SDK's global ones: a
library in the same process must not see llamagate's exporters, nor llamagate theirs.

Every span is written when its request is done, with the times the request recorded (``start_time`` and
``end_time`` on the monotonic figures turned into wall-clock nanoseconds), so nothing here runs on the
request's way. Never a prompt, a completion, a key or a stop sequence (user text too): figures and names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from proxy.asgi.context import GenAI, RequestContext
from proxy.settings import TelemetrySettings

# gen_ai.provider.name: llama.cpp is not one of the spec's well-known values; a custom one is allowed.
PROVIDER = "llama.cpp"
SERVICE = "llamagate"
SHUTDOWN_TIMEOUT_S = 10.0

# The spec's explicit bucket boundaries (seconds; tokens).
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip


def _resource(settings: TelemetrySettings) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME as the SDK reads them, the configured attributes
    and service name over them, and ``llamagate`` when nothing names the service."""
    attributes: dict[str, AttributeValue] = dict(settings.resource_attributes)
    if settings.service_name is not None:
        attributes["service.name"] = settings.service_name
    resource = Resource.create(attributes)
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE}))
    return resource


def _url(settings: TelemetrySettings, signal: str) -> str | None:
    # None: the exporter reads OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT.
    return f"{settings.endpoint.rstrip('/')}/v1/{signal}" if settings.endpoint else None


class OtelTelemetry:
    def __init__(self, settings: TelemetrySettings) -> None:
        resource = _resource(settings)
        headers = dict(settings.headers) or None  # None: OTEL_EXPORTER_OTLP_HEADERS
        sampler = (
            ParentBased(TraceIdRatioBased(settings.sampling_ratio))
            if settings.sampling_ratio is not None
            else None  # OTEL_TRACES_SAMPLER, else parent-based always-on
        )
        self._traces = TracerProvider(resource=resource, sampler=sampler)
        exporter = OTLPSpanExporter(endpoint=_url(settings, "traces"), headers=headers)
        self._traces.add_span_processor(BatchSpanProcessor(exporter))
        interval = settings.metrics_interval_s * 1000 if settings.metrics_interval_s is not None else None
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=_url(settings, "metrics"), headers=headers),
            export_interval_millis=interval,
        )
        self._meters = MeterProvider(resource=resource, metric_readers=[reader])
        self._tracer = self._traces.get_tracer("llamagate")
        meter = self._meters.get_meter("llamagate")
        self._duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration (to the last byte of the answer)",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self._ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self._tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token for successful responses",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used (experimental in the conventions)",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self._propagator = TraceContextTextMapPropagator()

    def record(self, ctx: RequestContext, duration_s: float) -> None:
        g = ctx.genai
        assert g is not None
        wall_now, mono_now = time.time_ns(), time.monotonic()

        def at(mono: float) -> int:  # a monotonic time as wall-clock nanoseconds
            return wall_now - int((mono_now - mono) * 1e9)

        # Every time from the request's own monotonic record: its arrival, and the end as the duration
        # the access log and the Prometheus series have.
        start, end = at(ctx.started), at(ctx.started + duration_s)
        error = _error_type(ctx)
        common: dict[str, AttributeValue] = {
            "gen_ai.operation.name": g.operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": ctx.request_model or ctx.model or "-",
        }
        if ctx.usage is not None and ctx.model is not None:
            common["gen_ai.response.model"] = ctx.model  # the served name: the child answers under it
        if error is not None:
            common["error.type"] = error
        self._span(ctx, g, common, error, start, end, at)
        self._duration.record(duration_s, common)
        ttft_s = ctx.ttft_s if ctx.ttft_s is not None else ctx.first_token_s
        if error is None and ttft_s is not None:
            self._ttft.record(ttft_s, common)
        if error is None and ctx.tpot_s is not None:
            self._tpot.record(ctx.tpot_s, common)
        if ctx.usage is not None:
            prompt, _, completion = ctx.usage
            self._tokens.record(prompt, {**common, "gen_ai.token.type": "input"})
            self._tokens.record(completion, {**common, "gen_ai.token.type": "output"})

    def _span(
        self,
        ctx: RequestContext,
        g: GenAI,
        common: Mapping[str, AttributeValue],
        error: str | None,
        start: int,
        end: int,
        at: Callable[[float], int],  # monotonic seconds -> wall-clock nanoseconds
    ) -> None:
        attributes = {**common, **_request_attributes(ctx, g)}
        parent = self._parent(g)
        span = self._tracer.start_span(
            f"{g.operation} {ctx.request_model or ctx.model or '-'}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=start,
            attributes=attributes,
        )
        inside = trace.set_span_in_context(span)
        if ctx.admit_at is not None:
            admitted = at(ctx.admitted_at) if ctx.admitted_at is not None else end
            wait = self._tracer.start_span("llamagate.admission", context=inside, start_time=at(ctx.admit_at))
            wait.end(end_time=max(admitted, at(ctx.admit_at)))
            ttft_s = ctx.ttft_s if ctx.ttft_s is not None else ctx.first_token_s
            if ttft_s is not None and ctx.admitted_at is not None:
                first = start + int(ttft_s * 1e9)
                prefill = self._tracer.start_span("llamagate.prefill", context=inside, start_time=admitted)
                prefill.end(end_time=max(first, admitted))
                decode = self._tracer.start_span("llamagate.decode", context=inside, start_time=first)
                decode.set_attribute("gen_ai.usage.output_tokens", ctx.tokens)
                decode.end(end_time=max(end, first))
        for reason, when in ctx.replays:
            span.add_event("llamagate.replay", {"llamagate.replay.reason": reason}, timestamp=at(when))
        if ctx.outcome.startswith("rejected:"):
            span.add_event(
                "llamagate.refused",
                {"llamagate.refusal.reason": ctx.outcome.removeprefix("rejected:"),
                 "http.response.status_code": ctx.status},
                timestamp=end,
            )  # fmt: skip
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end)

    def child_event(self, name: str, attributes: Mapping[str, str | int | float]) -> None:
        # No request is behind it: a root span of its own, of no duration, at the moment it is decided.
        span = self._tracer.start_span(name, kind=SpanKind.INTERNAL, attributes=dict(attributes))
        span.end()

    def _parent(self, g: GenAI) -> Context | None:
        if g.traceparent is None:
            return None
        carrier = {"traceparent": g.traceparent}
        if g.tracestate is not None:
            carrier["tracestate"] = g.tracestate
        return self._propagator.extract(carrier)

    def shutdown(self) -> None:
        # The pending spans and a last collection of the metrics go out; an unreachable collector holds
        # the stop for at most the exporters' timeout (10 s, or OTEL_EXPORTER_OTLP_TIMEOUT) each.
        self._traces.shutdown()
        self._meters.shutdown(timeout_millis=SHUTDOWN_TIMEOUT_S * 1000)


def _error_type(ctx: RequestContext) -> str | None:
    """``error.type``: a refusal's reason (``rate_limited``, ``queue_full``...), else the status code of an
    answer that is an error (4xx, 5xx; 499 when the client left)."""
    if ctx.outcome.startswith("rejected:"):
        return ctx.outcome.removeprefix("rejected:")
    if ctx.status >= 400:
        return str(ctx.status)
    return None


def _request_attributes(ctx: RequestContext, g: GenAI) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = dict(ctx.request_params)
    out["llamagate.request_id"] = ctx.request_id
    if ctx.tenant is not None:
        out["llamagate.tenant"] = ctx.tenant
    if ctx.key_id is not None:
        out["llamagate.key_id"] = ctx.key_id
    out["http.response.status_code"] = ctx.status
    out["llamagate.route"] = ctx.route
    if ctx.queue_wait_s is not None:
        out["llamagate.queue_wait_s"] = ctx.queue_wait_s
    if ctx.attempt > 1:
        out["llamagate.attempts"] = ctx.attempt
    if ctx.usage is not None:
        prompt, cached, completion = ctx.usage
        out["gen_ai.usage.input_tokens"] = prompt
        out["gen_ai.usage.output_tokens"] = completion
        out["gen_ai.usage.cache_read.input_tokens"] = cached
    if ctx.response_id is not None:
        out["gen_ai.response.id"] = ctx.response_id
    if ctx.finish_reasons:
        out["gen_ai.response.finish_reasons"] = list(ctx.finish_reasons)
    return out
