"""The proxy's own Prometheus series, on a registry per app (never the process-global default registry,
so two apps in one process, as in tests, never collide).

Extending: pass ``extra_collectors`` to ``create_app`` (e.g. the relabeled llama-server series or the
supervisor's child state); they are registered on the same registry and served by the same ``/metrics``.
A collector that must fetch its data first (llama-server's series) also has ``async refresh()``; the
``/metrics`` routes call ``await render_fresh()``, which awaits every such refresh, then renders.

Gauges of in-flight and queued requests are read from the admission controller at scrape time (a custom
collector), so the request path pays nothing for them and they can never drift from the truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar, cast, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.accounts.ledger import LedgerStats
from proxy.admission.gate import SlotGate
from proxy.cluster.limiter import MODES, ClusterLimiter
from proxy.metrics.history import History

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)

_M = TypeVar("_M", Counter, Histogram)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@runtime_checkable
class Refreshable(Protocol):
    async def refresh(self) -> None: ...


# Each served model's admission gate by model name, read at every scrape (models come and go on SIGHUP).
Gates = Callable[[], Mapping[str, SlotGate]]


class AdmissionCollector(Collector):
    """The gates' figures by model: one gate per served model (``proxy.models.lane``)."""

    def __init__(self, gates: Gates) -> None:
        self._gates = gates

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "llamagate_in_flight_requests",
            "Requests holding a slot permit, by model and tenant",
            labels=["model", "tenant"],
        )
        queued = GaugeMetricFamily(
            "llamagate_queued_requests",
            "Requests waiting for a slot permit, by model and tenant",
            labels=["model", "tenant"],
        )
        capacity = GaugeMetricFamily(
            "llamagate_slots",
            "Slot permits the gate hands out (the child's slot count), by model",
            labels=["model"],
        )
        lingering = GaugeMetricFamily(
            "llamagate_lingering_slots",
            "Slots held back after an abandoned request until the child has noticed the closed connection",
            labels=["model"],
        )
        by_priority = (
            GaugeMetricFamily(
                "llamagate_priority_in_flight_requests",
                "Slots held by requests of one priority (the request's own, not aged), by model",
                labels=["model", "priority"],
            ),
            GaugeMetricFamily(
                "llamagate_priority_queued_requests",
                "Requests of one priority (the request's own, not aged) waiting for a slot, by model",
                labels=["model", "priority"],
            ),
        )
        for model, admission in self._gates().items():
            for load in admission.loads():
                in_flight.add_metric([model, load.name], load.in_flight)
                queued.add_metric([model, load.name], load.queued)
            capacity.add_metric([model], admission.capacity)
            lingering.add_metric([model], admission.lingering)
            for level in admission.priority_loads():
                by_priority[0].add_metric([model, str(level.priority)], level.in_flight)
                by_priority[1].add_metric([model, str(level.priority)], level.queued)
        yield in_flight
        yield queued
        yield capacity
        yield lingering
        yield from by_priority


class ClusterCollector(Collector):
    """The shared limits' mode (``proxy.cluster``): one series per mode, 1 for the one in force (``off``:
    no ``cluster.redis_url``), the leases this replica holds, and Redis calls that failed."""

    def __init__(self, limiter: Callable[[], ClusterLimiter | None]) -> None:
        self._limiter = limiter

    def collect(self) -> Iterator[Metric]:
        limiter = self._limiter()
        current = "off" if limiter is None else limiter.mode
        mode = GaugeMetricFamily(
            "llamagate_cluster_mode",
            "Which tenant limits are in force: cluster (shared in Redis), local or refuse (Redis down), "
            "off (no cluster.redis_url); 1 for the mode in force",
            labels=["mode"],
        )
        for name in ("off", *MODES):
            mode.add_metric([name], 1.0 if name == current else 0.0)
        yield mode
        yield GaugeMetricFamily(
            "llamagate_cluster_leases",
            "Slots this replica's requests hold as shared leases (in Redis, or under the local fallback)",
            value=0 if limiter is None else limiter.held,
        )
        yield CounterMetricFamily(
            "llamagate_cluster_redis_errors",
            "Redis calls of the shared limits that failed (refused, reset or timed out)",
            value=0 if limiter is None else limiter.redis_errors,
        )


class UsageTokens(Collector):
    """``llamagate_usage_tokens_total``: the tokens the usage ledger was charged, by tenant, model and
    kind. A dict of sums rather than a labelled ``Counter``: three increments per request, each of which
    would take the counter's lock."""

    def __init__(self, sums: Mapping[tuple[str, str], list[int]]) -> None:
        self._sums = sums

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "llamagate_usage_tokens",
            "Tokens charged to the usage ledger, by tenant, model and kind (prompt, cached, completion)",
            labels=["tenant", "model", "kind"],
        )
        for (tenant, model), sums in list(self._sums.items()):
            for kind, value in zip(("prompt", "cached", "completion"), sums, strict=True):
                family.add_metric([tenant, model, kind], value)
        yield family


class LedgerCollector(Collector):
    """The usage ledger's queue and writes (``proxy.accounts.ledger``), read at scrape time."""

    def __init__(self, stats: Callable[[], LedgerStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "llamagate_ledger_pending_records",
            "Usage records charged and not written to the store yet",
            s.pending,
        )
        counters = (
            ("llamagate_ledger_written_records", "Usage records written to the store", s.written),
            (
                "llamagate_ledger_unwritten_records",
                "Usage records whose first write failed (kept in memory and retried)",
                s.unwritten,
            ),
            (
                "llamagate_ledger_dropped_records",
                "Usage records lost: charged while the most the ledger holds in memory were waiting",
                s.dropped,
            ),
            ("llamagate_ledger_write_errors", "Batch writes to the store that failed", s.write_errors),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value)


class ProxyMetrics:
    """Series the request path updates. Label children are cached: ``labels()`` takes a lock and builds a
    tuple on every call, which shows on the hot path."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "llamagate_requests",
            "Requests answered, by tenant, model, route and status",
            ["tenant", "model", "route", "status"],
            registry=registry,
        )
        self.rejections = Counter(
            "llamagate_rejections",
            "Requests refused, by tenant, model and reason",
            ["tenant", "model", "reason"],
            registry=registry,
        )
        self.output_tokens = Counter(
            "llamagate_output_tokens",
            "Generated tokens relayed, by tenant and model",
            ["tenant", "model"],
            registry=registry,
        )
        # tenant, model -> [prompt, cached, completion]: summed on the request path without a lock (the
        # event loop is its one writer), read at scrape time (``UsageTokens``).
        self.usage: dict[tuple[str, str], list[int]] = {}
        registry.register(UsageTokens(self.usage))
        # model -> [generation requests answered (any status), output tokens they relayed], since the
        # start: the status page's traffic charts turn them into rates (``/admin/load``'s ``answered``).
        # Plain ints for the same reason as ``usage``.
        self.answered: dict[str, list[int]] = {}
        # The last 15 minutes per model, in buckets (``GET /admin/history``, the page's charts).
        self.history = History()
        self.ttft = Histogram(
            "llamagate_time_to_first_token_seconds",
            "Arrival to first generated token, queue wait included, by tenant and model",
            ["tenant", "model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "llamagate_time_per_output_token_seconds",
            "Mean time between generated tokens of a stream, by tenant and model",
            ["tenant", "model"],
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "llamagate_queue_wait_seconds",
            "Time waiting for a slot permit, by tenant and model",
            ["tenant", "model"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "llamagate_request_duration_seconds",
            "Arrival to last byte, by tenant and model",
            ["tenant", "model"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.replays = Counter(
            "llamagate_replays",
            "Requests run again on the next child because theirs died before any byte of the answer reached"
            " the client, by model and reason (closed: the child hung up; refused: it was gone)",
            ["model", "reason"],
            registry=registry,
        )
        self.poison = Counter(
            "llamagate_poison_requests",
            "Requests in flight at two deaths of their model's child, not sent again (proxy.poison), by"
            " model, tenant and key id",
            ["model", "tenant", "key"],
            registry=registry,
        )
        self.poison_refusals = Counter(
            "llamagate_poison_refusals",
            "Requests refused because their key cools down after poison requests (key_cooling_down) or their"
            " body killed two children already (poison_body), by model, tenant, key id and reason",
            ["model", "tenant", "key", "reason"],
            registry=registry,
        )
        self.cancelled = Counter(
            "llamagate_cancelled_requests",
            "Requests an operator cancelled (DELETE /admin/requests/{id}), by model and the state they were"
            " in (queued, running)",
            ["model", "state"],
            registry=registry,
        )
        self._children: dict[tuple[str, ...], Counter | Histogram] = {}
        # Extra collectors whose data is fetched (awaited) before each render; see the module docstring.
        self.refreshers: list[Refreshable] = []

    def _child(self, metric: _M, *labels: str) -> _M:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return cast(_M, child)

    def observe_request(
        self,
        tenant: str,
        model: str,
        route: str,
        status: int,
        duration_s: float,
        reason: str | None,
        queue_wait_s: float | None,
        ttft_s: float | None,
        tpot_s: float | None,
        tokens: int,
    ) -> None:
        self._child(self.requests, tenant, model, route, str(status)).inc()
        self._child(self.duration, tenant, model).observe(duration_s)
        if reason is not None:
            self._child(self.rejections, tenant, model, reason).inc()
        if queue_wait_s is not None:
            self._child(self.queue_wait, tenant, model).observe(queue_wait_s)
        if ttft_s is not None:
            self._child(self.ttft, tenant, model).observe(ttft_s)
        if tpot_s is not None:
            self._child(self.tpot, tenant, model).observe(tpot_s)
        if tokens:
            self._child(self.output_tokens, tenant, model).inc(tokens)

    def observe_answered(
        self, model: str, tokens: int, ttft_s: float | None = None, tpot_s: float | None = None
    ) -> None:
        """One generation request of ``model`` answered (whatever its status), with its output tokens
        and its times (for the history)."""
        sums = self.answered.get(model)
        if sums is None:
            sums = self.answered[model] = [0, 0]
        sums[0] += 1
        sums[1] += tokens
        self.history.observe(model, tokens, ttft_s, tpot_s)

    def observe_replay(self, model: str, reason: str) -> None:
        self._child(self.replays, model, reason).inc()

    def observe_poison(self, model: str, tenant: str, key: str) -> None:
        self._child(self.poison, model, tenant, key).inc()

    def observe_poison_refusal(self, model: str, tenant: str, key: str, reason: str) -> None:
        self._child(self.poison_refusals, model, tenant, key, reason).inc()

    def observe_cancel(self, model: str, state: str) -> None:
        self._child(self.cancelled, model, state).inc()

    def observe_usage(self, tenant: str, model: str, prompt: int, cached: int, completion: int) -> None:
        """One ledger record's tokens (``cached`` is the part of ``prompt`` read from the prompt cache)."""
        sums = self.usage.get((tenant, model))
        if sums is None:
            sums = self.usage[(tenant, model)] = [0, 0, 0]
        sums[0] += prompt
        sums[1] += cached
        sums[2] += completion

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def render_fresh(self) -> bytes:
        await asyncio.gather(*(r.refresh() for r in self.refreshers))
        return self.render()
