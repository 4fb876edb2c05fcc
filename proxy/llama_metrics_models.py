"""llama-server's series from every model's child, for a several-model daemon.

One ``LlamaServerMetrics`` per model (each scrape cached and shared as for one child; each family already
carries the child's ``model`` label from the relabeling), merged here into one family per name so the
registry sees each name once. The scrape status gauges get a ``model`` label. Models come and go with
SIGHUP: ``models()`` is read at every refresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.llama_metrics import LlamaServerMetrics
from proxy.readiness import UpstreamSnapshot

Snapshots = Callable[[], Mapping[str, Callable[[], UpstreamSnapshot]]]


class ModelsLlamaMetrics(Collector):
    def __init__(self, models: Snapshots, instance: str) -> None:
        self._models = models
        self._instance = instance
        self._by_model: dict[str, LlamaServerMetrics] = {}

    async def refresh(self) -> None:
        current = self._models()
        for name in [n for n in self._by_model if n not in current]:
            await self._by_model.pop(name).aclose()
        for name, snapshot in current.items():
            if name not in self._by_model:
                self._by_model[name] = LlamaServerMetrics(snapshot, self._instance)
        await asyncio.gather(*(m.refresh() for m in self._by_model.values()))

    def describe(self) -> Iterator[Metric]:
        return iter(_status({}))

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for metrics in self._by_model.values():
            last = metrics.last
            for family in last.families if last is not None else ():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                into.samples.extend(family.samples)
        yield from merged.values()
        yield from _status(self._by_model)

    async def aclose(self) -> None:
        for metrics in self._by_model.values():
            await metrics.aclose()


def _status(by_model: Mapping[str, LlamaServerMetrics]) -> list[Metric]:
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
    for name, metrics in by_model.items():
        last = metrics.last
        ok.add_metric([name], 1.0 if last is not None and last.ok else 0.0)
        duration.add_metric([name], last.duration_s if last is not None else 0.0)
    return [ok, duration]
