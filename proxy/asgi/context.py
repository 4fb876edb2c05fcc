"""The record of one request, filled in as it goes and read once at the end (access log, metrics).

``RequestContextMiddleware`` (``proxy.middleware.context``) creates it and puts it in the ASGI scope
under ``SCOPE_KEY``; every endpoint reads and fills it from there.
"""

from __future__ import annotations

SCOPE_KEY = "llamagate.ctx"


class GenAI:
    """What only OpenTelemetry needs of one generation request (``proxy.telemetry``): its GenAI operation
    and the caller's W3C trace context, read from the request head when telemetry is on. Everything else
    telemetry reports (admission times, replays, usage, the model as named) is the request's own record,
    kept whether telemetry is on or not, as the access log and the Prometheus series read it."""

    __slots__ = ("operation", "traceparent", "tracestate")

    def __init__(self, operation: str, traceparent: str | None, tracestate: str | None) -> None:
        self.operation = operation  # gen_ai.operation.name
        self.traceparent = traceparent  # the caller's W3C trace context, as sent
        self.tracestate = tracestate


class RequestContext:
    """What one request became, filled in as it goes; read once at the end."""

    __slots__ = (
        "admit_at",
        "admitted_at",
        "attempt",
        "authorization",
        "client_host",
        "content_length",
        "extra_headers",
        "finish_reasons",
        "first_token_s",
        "genai",
        "key_id",
        "model",
        "outcome",
        "queue_wait_s",
        "replays",
        "request_id",
        "request_model",
        "request_params",
        "response_id",
        "response_started",
        "route",
        "started",
        "status",
        "tenant",
        "tokens",
        "tpot_s",
        "ttft_s",
        "usage",
    )

    def __init__(self, request_id: str, started: float) -> None:
        self.request_id = request_id
        self.started = started
        self.authorization: bytes | None = None
        self.content_length: int | None = None
        self.client_host: str | None = None
        self.tenant: str | None = None
        self.key_id: str | None = None
        # The served model the request reached (a lane's name or the one model's alias), never the
        # client's raw ``model`` string: it is a metrics label, so its values must stay bounded.
        self.model: str | None = None
        self.route = "unmatched"
        self.status = 0
        self.response_started = False
        self.outcome = "ok"
        self.queue_wait_s: float | None = None
        self.ttft_s: float | None = None
        self.tpot_s: float | None = None
        self.tokens = 0
        # Headers every answer to this request carries, errors included, beside X-Request-ID: a
        # budgeted caller's rate-limit headers (``proxy.admission.pipeline``), as ASGI header pairs.
        self.extra_headers: list[tuple[bytes, bytes]] = []
        # 1, or 2 once the request was run again on the next child because its child died before any
        # byte of the answer reached the client (``proxy.routes.replay``). What the request record says
        # of its answer (tokens, time per token, outcome; the usage the ledger charges) is the final
        # attempt's: ``next_attempt`` forgets the dead child's.
        self.attempt = 1
        # Set by a generation endpoint when OpenTelemetry is on (``GenAI``); None otherwise.
        self.genai: GenAI | None = None
        # A generation's own record, kept always (telemetry reads it at the end, as the access log does).
        # The model as the client named it (a name the router resolved: a bounded set); ``model`` is the
        # served name that answered.
        self.request_model: str | None = None
        # gen_ai.request.* figures the client set (numbers only: ``proxy.telemetry.request``).
        self.request_params: dict[str, int | float] = {}
        self.admit_at: float | None = None  # monotonic: when admission began
        self.admitted_at: float | None = None  # monotonic: when it ended with a slot
        # From arrival to the first token of an answer the proxy assembled (``ttft_s`` is a stream's, as
        # the client saw it); the spec's time to first token counts both.
        self.first_token_s: float | None = None
        self.replays: list[tuple[str, float]] = []  # (reason, monotonic) of each run on another child
        self.usage: tuple[int, int, int] | None = None  # (prompt, cached, completion) as charged
        self.response_id: str | None = None
        self.finish_reasons: tuple[str, ...] = ()

    @property
    def replayed(self) -> bool:
        return self.attempt > 1

    def next_attempt(self) -> None:
        """The request runs again on another child: forget what the failed attempt recorded of its answer
        (a field that describes the answer, such as the usage to charge, is reset here too). The time to
        first token and the duration still count from arrival: the client waited all along."""
        self.attempt += 1
        self.outcome = "ok"
        self.tokens = 0
        self.ttft_s = None
        self.tpot_s = None
