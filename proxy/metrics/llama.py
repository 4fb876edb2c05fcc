"""llama-server's own ``/metrics`` from every model's child, relabeled and served inside the proxy's
``/metrics`` by one collector (``ModelsLlamaMetrics``; a one-model daemon's is a set of one).

llama-server names its series ``llamacpp:NAME``; colons are reserved for recording rules by Prometheus
convention, and the series carry no label saying which model or which daemon they describe. Here every
``llamacpp:NAME`` becomes ``llamacpp_NAME`` with ``model`` and ``instance`` labels; HELP and TYPE are
kept. One exception: ``llamacpp:n_tokens_max`` is typed ``counter`` upstream but is a high-water mark
without the ``_total`` suffix a Prometheus counter must carry (``promtool check metrics`` rejects it, and
prometheus-client's parser would silently rename it ``..._total``). Any upstream counter whose name
lacks ``_total`` is therefore served under its own name as a gauge, which is what a maximum is.

Why one cached scrape per child: llama-server resets the window of its throughput gauges
(``predicted_tokens_seconds``, ``prompt_tokens_seconds``) on every scrape, so two scrapers would halve
each other's windows. All scrapers within ``ttl_s`` share one upstream fetch, and concurrent scrapers
share the fetch in flight (single flight). A scraper that disconnects does not cancel the fetch the
others wait on.

The child being down is not an error of ``/metrics``: the upstream part is simply absent and
``llamagate_upstream_scrape_ok`` is 0, while the proxy's and supervisor's series are served as usual.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from proxy.source import UpstreamSnapshot

log = logging.getLogger("llamagate.metrics")

UPSTREAM_PREFIX = "llamacpp:"
SERVED_PREFIX = "llamacpp_"
# About one Prometheus scrape interval at its fastest; long enough to merge scrapers, short enough that
# a 1 s scrape still sees fresh values.
DEFAULT_TTL_S = 1.0
# llama-server answers /metrics from its HTTP thread in about a millisecond; a child that takes longer
# than this is hung, and the scrape must still answer well inside Prometheus's default 10 s timeout.
DEFAULT_TIMEOUT_S = 2.0


def _declared_types(text: str) -> dict[str, str]:
    """Names exactly as ``# TYPE`` declares them; the parser strips a counter's ``_total``."""
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
    return types


def _served_name(name: str) -> str:
    if name.startswith(UPSTREAM_PREFIX):
        name = SERVED_PREFIX + name[len(UPSTREAM_PREFIX) :]
    # Any other colon would make the served name a recording-rule name too.
    return name.replace(":", "_")


def relabel(text: str, labels: Mapping[str, str]) -> list[Metric]:
    """Parse llama-server's exposition and return served families with ``labels`` added to every sample.

    Raises ``ValueError`` on text that is not the Prometheus text format."""
    declared = _declared_types(text)
    families: list[Metric] = []
    for family in text_string_to_metric_families(text):
        name = _served_name(family.name)
        kind = family.type
        documentation = family.documentation
        if kind == "counter" and family.name + "_total" not in declared:
            kind = "gauge"
            documentation += " (a high-water mark; typed counter by llama-server)"
        served = Metric(name, documentation, kind)
        for sample in family.samples:
            sample_name = _served_name(sample.name)
            if kind == "gauge" and family.type == "counter":
                # The parser appended "_total" to the sample; the gauge keeps the declared name.
                sample_name = name
            served.add_sample(sample_name, {**sample.labels, **labels}, sample.value, sample.timestamp)
        families.append(served)
    return families


@dataclass(frozen=True)
class Scrape:
    at: float
    # Which child answered: a new child, or none at all, invalidates the cache at once.
    child: tuple[int, str | None]
    ok: bool
    duration_s: float
    families: tuple[Metric, ...]


class _ChildScrape:
    """One child's ``/metrics``, fetched at most once per ``ttl_s`` (single flight) and kept relabeled."""

    def __init__(
        self,
        snapshot: Callable[[], UpstreamSnapshot],
        *,
        instance: str,
        ttl_s: float,
        timeout_s: float,
        transport: httpx.AsyncBaseTransport | None,
        clock: Callable[[], float],
    ) -> None:
        self._snapshot = snapshot
        self._instance = instance
        self._ttl_s = ttl_s
        self._clock = clock
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(timeout_s),
            # One connection is plenty for one fetch a second; expire it before llama-server's 5 s idle
            # close so a reused connection is not closed under us.
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=4.0),
            trust_env=False,
            follow_redirects=False,
            headers={"user-agent": "llamagate-metrics"},
        )
        self._last: Scrape | None = None
        self._inflight: asyncio.Task[None] | None = None

    @property
    def last(self) -> Scrape | None:
        return self._last

    async def refresh(self) -> None:
        snap = self._snapshot()
        last = self._last
        child = (snap.generation, snap.base_url)
        if last is not None and last.child == child and self._clock() - last.at < self._ttl_s:
            return
        if self._inflight is None:
            self._inflight = asyncio.create_task(self._fetch(snap))
        # Shielded: a scraper that goes away must not cancel the fetch other scrapers are waiting on.
        await asyncio.shield(self._inflight)

    async def _fetch(self, snap: UpstreamSnapshot) -> None:
        started = self._clock()
        try:
            got = await self._get(snap)
        finally:
            self._inflight = None
        ok = not isinstance(got, str)
        # One line per change, not one per failed fetch: a dead child would otherwise log every second.
        if isinstance(got, str):
            was_ok = self._last is None or self._last.ok
            log.log(logging.WARNING if was_ok else logging.DEBUG, "llama-server /metrics not read: %s", got)
        elif self._last is not None and not self._last.ok:
            log.info("llama-server /metrics read again")
        self._last = Scrape(
            at=self._clock(),
            child=(snap.generation, snap.base_url),
            ok=ok,
            duration_s=self._clock() - started,
            families=() if isinstance(got, str) else tuple(got),
        )

    async def _get(self, snap: UpstreamSnapshot) -> list[Metric] | str:
        """The relabeled families, or why there are none."""
        if snap.base_url is None:
            return f"no child listening ({snap.state})"
        headers = {"authorization": "Bearer " + snap.secret} if snap.secret else {}
        try:
            response = await self._client.get(snap.base_url + "/metrics", headers=headers)
        except httpx.HTTPError as exc:
            return f"unreachable ({exc.__class__.__name__})"
        if response.status_code != 200:
            return f"answered HTTP {response.status_code}"
        try:
            return relabel(response.text, {"model": snap.model_alias, "instance": self._instance})
        except ValueError as exc:
            return f"not the Prometheus text format ({exc})"

    async def aclose(self) -> None:
        if self._inflight is not None:
            self._inflight.cancel()
        await self._client.aclose()


Snapshots = Callable[[], Mapping[str, Callable[[], UpstreamSnapshot]]]


class ModelsLlamaMetrics(Collector):
    """llama-server's series from every served model's child, each family once with every child's samples
    (each already carrying its ``model`` label), beside the status of each model's last fetch. Models
    come and go with SIGHUP: ``snapshots()`` (name -> that model's snapshot) is read at every refresh.
    ``await refresh()`` before rendering the registry (``collect`` is synchronous and only reads the last
    scrapes)."""

    def __init__(
        self,
        snapshots: Snapshots,
        instance: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshots = snapshots
        self._make = functools.partial(
            _ChildScrape,
            instance=instance,
            ttl_s=ttl_s,
            timeout_s=timeout_s,
            transport=transport,
            clock=clock,
        )
        self._by_model: dict[str, _ChildScrape] = {}

    @classmethod
    def single(
        cls, snapshot: Callable[[], UpstreamSnapshot], instance: str, **kwargs: Any
    ) -> ModelsLlamaMetrics:
        """One child, named by the alias its snapshot serves."""
        return cls(lambda: {snapshot().model_alias: snapshot}, instance, **kwargs)

    def last(self, model: str) -> Scrape | None:
        scrape = self._by_model.get(model)
        return scrape.last if scrape is not None else None

    async def refresh(self) -> None:
        current = self._snapshots()
        for name in [n for n in self._by_model if n not in current]:
            await self._by_model.pop(name).aclose()
        for name, snapshot in current.items():
            if name not in self._by_model:
                self._by_model[name] = self._make(snapshot)
        await asyncio.gather(*(m.refresh() for m in self._by_model.values()))

    def describe(self) -> Iterator[Metric]:
        # Only the fixed families: the upstream ones are whatever llama-server serves.
        return iter(status_families({}))

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for scrape in self._by_model.values():
            last = scrape.last
            for family in last.families if last is not None else ():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                into.samples.extend(family.samples)
        yield from merged.values()
        yield from status_families({name: m.last for name, m in self._by_model.items()})

    async def aclose(self) -> None:
        for scrape in self._by_model.values():
            await scrape.aclose()


def status_families(scrapes: Mapping[str, Scrape | None]) -> list[Metric]:
    """The status of each model's last fetch, labelled with its name (one model's daemon: its alias).
    No scrapes: the families with no sample (``describe``)."""
    ok = GaugeMetricFamily(
        "llamagate_upstream_scrape_ok",
        "1 when the last fetch of llama-server's /metrics succeeded (its llamacpp_* series are then served)",
        labels=["model"],
    )
    duration = GaugeMetricFamily(
        "llamagate_upstream_scrape_duration_seconds",
        "Duration of the last fetch of llama-server's /metrics",
        labels=["model"],
    )
    for model, last in scrapes.items():
        ok.add_metric([model], 1.0 if last is not None and last.ok else 0.0)
        duration.add_metric([model], last.duration_s if last is not None else 0.0)
    return [ok, duration]
