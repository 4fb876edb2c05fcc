"""llama-server's series from every model's child, for a several-model daemon.

One ``LlamaServerMetrics`` per model (each scrape cached and shared as for one child; each family already
carries the child's ``model`` label from the relabeling), merged here into one family per name so the
registry sees each name once. The scrape status gauges get a ``model`` label. Models come and go with
SIGHUP: ``models()`` is read at every refresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from proxy.metrics.llama import LlamaServerMetrics, status_families
from proxy.source import UpstreamSnapshot

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
        return iter(status_families({}))

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
        yield from status_families({name: m.last for name, m in self._by_model.items()})

    async def aclose(self) -> None:
        for metrics in self._by_model.values():
            await metrics.aclose()
