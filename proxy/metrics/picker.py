"""Per-model gauges without a tenant label, for a load balancer or an endpoint picker (the llm-d router,
which carries the Gateway API Inference Extension's picker) choosing among replicas.

A picker reads, from every replica, one series per metric: the queue, the running count and the KV
(context) use. ``llamagate_queued_requests`` and ``llamagate_in_flight_requests`` carry a tenant label, so
a picker would have to sum them; these carry only ``model``, one series per served model:

    llamagate_model_queued_requests        requests waiting in the proxy's gate (TotalQueuedRequests)
    llamagate_model_running_requests       requests holding a slot permit (TotalRunningRequests)
    llamagate_model_slots                  the child's slots, as its /slots lists them
    llamagate_model_busy_slots             of those, slots processing a task
    llamagate_model_context_used_tokens     tokens held by busy slots (prompt and generated so far)
    llamagate_model_context_capacity_tokens the sum of every slot's n_ctx
    llamagate_model_kv_cache_usage_ratio   used / total, 0..1 (KVCacheUtilization)

Queue and running come from the gate at render time (exact, free). The rest come from the child's
``/slots``, read at most once per ``ttl_s`` (0.2 s: a picker scraping every 50 ms gets the reading in
memory three times out of four) with one fetch in flight per child however many scrapers wait on it.
``/slots`` runs on llama-server's HTTP thread, not in a slot, so reading it takes no capacity.

Which tokens count as in use: a busy slot's ``n_prompt_tokens`` (this llama-server build counts the
prompt and the tokens generated so far in it, so it grows while a request decodes). An idle slot keeps
its last prompt cached for reuse but any new request may take it, so it counts as free. A child that is
not listening, or whose ``/slots`` cannot be read, shows 0 slots and 0 tokens (and the ratio 0): a
picker should not send work there, and ``/readyz`` says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.admission.gate import SlotGate
from proxy.errors import UpstreamFailure
from proxy.source import UpstreamSnapshot
from proxy.upstream.connection import UpstreamClosed
from proxy.upstream.pool import Upstream

log = logging.getLogger("llamagate.metrics")

DEFAULT_TTL_S = 0.2
# /slots answers from llama-server's HTTP thread in about a millisecond; longer than this is a hung child.
_TIMEOUT_S = 2.0
_REQUEST_ID = "llamagate-slots-gauges"


@dataclass(frozen=True, slots=True)
class SlotsReading:
    slots: int = 0
    busy: int = 0
    tokens_used: int = 0
    tokens_total: int = 0

    @property
    def usage_ratio(self) -> float:
        return self.tokens_used / self.tokens_total if self.tokens_total > 0 else 0.0


NOTHING = SlotsReading()


def parse_slots(body: bytes) -> SlotsReading | None:
    """llama-server's ``/slots`` answer as a reading; None for anything that is not a list of slots."""
    try:
        slots = json.loads(body)
    except ValueError:
        return None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return None
    busy = used = total = 0
    for slot in slots:
        n_ctx = slot.get("n_ctx")
        total += n_ctx if isinstance(n_ctx, int) else 0
        if slot.get("is_processing"):
            busy += 1
            tokens = slot.get("n_prompt_tokens")
            used += tokens if isinstance(tokens, int) and tokens > 0 else 0
    return SlotsReading(len(slots), busy, used, total)


# Each served model by name: its gate and its child's snapshot, read at every render (SIGHUP changes them).
Lanes = Callable[[], Mapping[str, tuple[SlotGate, Callable[[], UpstreamSnapshot]]]]


class _ChildSlots:
    """One child's ``/slots``, fetched at most once per ``ttl_s`` (single flight), kept as a reading."""

    def __init__(self, pool: Upstream, ttl_s: float, clock: Callable[[], float]) -> None:
        self._pool = pool
        self._ttl_s = ttl_s
        self._clock = clock
        self.reading = NOTHING
        self._at = float("-inf")
        self._child: int | None = None
        self._inflight: asyncio.Task[None] | None = None
        self._failing = False

    async def refresh(self, snap: UpstreamSnapshot) -> None:
        if snap.base_url is None or not snap.ready:
            self.reading, self._child = NOTHING, None
            return
        if self._child == snap.generation and self._clock() - self._at < self._ttl_s:
            return
        if self._inflight is None:
            self._inflight = asyncio.create_task(self._fetch(snap))
        # Shielded: a scraper that goes away must not cancel the fetch others wait on.
        await asyncio.shield(self._inflight)

    async def _fetch(self, snap: UpstreamSnapshot) -> None:
        try:
            got = await self._get(snap)
        finally:
            self._inflight = None
        if isinstance(got, str):
            # One line per change of state, not one per failed read: a picker scrapes 20 times a second.
            log.log(
                logging.DEBUG if self._failing else logging.WARNING, "llama-server /slots not read: %s", got
            )
            self._failing = True
            self.reading = NOTHING
        else:
            if self._failing:
                log.info("llama-server /slots read again")
            self._failing = False
            self.reading = got
        self._at, self._child = self._clock(), snap.generation

    async def _get(self, snap: UpstreamSnapshot) -> SlotsReading | str:
        try:
            async with asyncio.timeout(_TIMEOUT_S):
                response = await self._pool.open(snap, "GET", "/slots", None, _REQUEST_ID)
                try:
                    body = await response.read()
                finally:
                    response.release()
        except TimeoutError:
            return f"no answer within {_TIMEOUT_S:g} s"
        except (UpstreamFailure, UpstreamClosed) as exc:
            return f"unreachable ({exc.__class__.__name__})"
        if response.status != 200:
            return f"answered HTTP {response.status}"
        reading = parse_slots(body)
        return reading if reading is not None else "not a list of slots"


class PickerGauges(Collector):
    """The gauges of the module docstring; ``await refresh()`` before rendering (``collect`` only reads)."""

    def __init__(
        self,
        lanes: Lanes,
        pool: Upstream,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lanes = lanes
        self._pool = pool
        self._ttl_s = ttl_s
        self._clock = clock
        self._children: dict[str, _ChildSlots] = {}

    async def refresh(self) -> None:
        lanes = self._lanes()
        for name in [n for n in self._children if n not in lanes]:
            del self._children[name]
        waits = []
        for name, (_, snapshot) in lanes.items():
            child = self._children.get(name)
            if child is None:
                child = self._children[name] = _ChildSlots(self._pool, self._ttl_s, self._clock)
            waits.append(child.refresh(snapshot()))
        await asyncio.gather(*waits)

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        queued, running, slots, busy, used, total, ratio = families
        for name, (admission, _) in self._lanes().items():
            child = self._children.get(name)
            reading = child.reading if child is not None else NOTHING
            queued.add_metric([name], admission.queued)
            running.add_metric([name], admission.in_flight)
            slots.add_metric([name], reading.slots)
            busy.add_metric([name], reading.busy)
            used.add_metric([name], reading.tokens_used)
            total.add_metric([name], reading.tokens_total)
            ratio.add_metric([name], reading.usage_ratio)
        return iter(families)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["model"])

        return [
            gauge(
                "llamagate_model_queued_requests",
                "Requests waiting for a slot permit, by model (all tenants)",
            ),
            gauge(
                "llamagate_model_running_requests", "Requests holding a slot permit, by model (all tenants)"
            ),
            gauge("llamagate_model_slots", "Slots of the model's child, from its /slots"),
            gauge(
                "llamagate_model_busy_slots", "Slots of the model's child processing a task, from its /slots"
            ),
            gauge(
                "llamagate_model_context_used_tokens",
                "Context (KV cache) tokens held by the child's busy slots, from its /slots",
            ),
            gauge(
                "llamagate_model_context_capacity_tokens",
                "Context (KV cache) tokens of all the child's slots (sum of n_ctx), from its /slots",
            ),
            gauge(
                "llamagate_model_kv_cache_usage_ratio",
                "Context tokens used over total, 0 to 1 (for an endpoint picker's KV utilisation)",
            ),
        ]
