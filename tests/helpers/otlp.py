"""A real OTLP/HTTP receiver on loopback for the OpenTelemetry tests: it accepts what an exporter POSTs
to /v1/traces and /v1/metrics (protobuf, gzip or not), keeps every raw body (to search for text that
must never leave the process) and decodes them with the protocol's own classes (opentelemetry-proto)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def plain(value: AnyValue) -> Any:
    """An attribute's value as Python: str, int, float, bool or a list of them."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain(v) for v in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


def attributes(items: Any) -> dict[str, Any]:
    return {kv.key: plain(kv.value) for kv in items}


class Receiver:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []  # every request body, decompressed, in arrival order
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.lock = threading.Lock()
        self.url = ""

    # -- what arrived -------------------------------------------------------------------------------------
    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) for every span received."""
        with self.lock:
            return [
                (attributes(rs.resource.attributes), span)
                for req in self.traces
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def metric(self, name: str) -> list[Any]:
        with self.lock:
            return [
                metric
                for req in self.metrics
                for rm in req.resource_metrics
                for sm in rm.scope_metrics
                for metric in sm.metrics
                if metric.name == name
            ]

    def points(self, name: str) -> list[Any]:
        """Every histogram data point of the metric ``name`` received (each export is cumulative)."""
        return [point for metric in self.metric(name) for point in metric.histogram.data_points]


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            data = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.headers.get("content-encoding") == "gzip":
                data = gzip.decompress(data)
            if self.path == "/v1/traces":
                traces = ExportTraceServiceRequest.FromString(data)
                answer = ExportTraceServiceResponse().SerializeToString()
                with receiver.lock:
                    receiver.bodies.append(data)
                    receiver.traces.append(traces)
            elif self.path == "/v1/metrics":
                metrics = ExportMetricsServiceRequest.FromString(data)
                answer = ExportMetricsServiceResponse().SerializeToString()
                with receiver.lock:
                    receiver.bodies.append(data)
                    receiver.metrics.append(metrics)
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(receiver))
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
