"""The supervisor's series for ``/metrics``: a prometheus-client collector read at scrape time.

Nothing here is updated on the supervisor's path: every value is read from the state machine, the
memory budget, the identity record and the child process (psutil) when Prometheus asks, so the series
can never drift from the truth and the supervisor pays nothing between scrapes.

The collector reads each served model's driver (``SupervisorView``): the machine's state, restarts and
failures, the driver's load and readiness times, the child's figures, the memory budget and the identity.
Every series but the host's memory carries the model's name as ``model``: one family per name with one
sample set per model, for one model's daemon (its alias) as for a several-model one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from supervisor.child.machine import Machine, State

# Failure causes the state machine records (child.machine.Machine._fail); listed so that every cause is
# exported from the start at 0 and ``increase()`` sees the first failure of each. The first five are
# failed starts (they count towards FAILED); "exit", "unhealthy" and "hang" (the server loop did not answer
# the watchdog's GET /slots within supervision.loop_deadline_s) are crashes of a ready child (restarted
# without end, never FAILED).
FAILURE_CAUSES = ("spawn", "load_exit", "load_timeout", "load_stalled", "gate", "exit", "unhealthy", "hang")
# Digest prefixes are enough to tell builds and models apart on a dashboard without a 64-char label.
DIGEST_PREFIX = 12
# `llama-server --version`: "version: 0.5.0-dev (build 1, commit 0c1e570)"
_VERSION = re.compile(r"\(build (\d+), commit ([0-9a-f]+)\)")


@dataclass(frozen=True)
class ServedLabels:
    llama_cpp_build: str
    binary_sha256: str
    model: str
    model_sha256: str
    slots: str
    ctx_per_slot: str

    @classmethod
    def from_identity(cls, identity: Mapping[str, object]) -> ServedLabels:
        """From ``identity.served_identity()``'s record; missing parts read ``unknown``."""

        def part(name: str) -> Mapping[str, object]:
            value = identity.get(name)
            return value if isinstance(value, Mapping) else {}

        binary, model, serving = part("binary"), part("model"), part("serving")
        return cls(
            llama_cpp_build=_build_label(part("llama_cpp")),
            binary_sha256=str(binary.get("sha256") or "unknown")[:DIGEST_PREFIX],
            model=str(model.get("alias") or "unknown"),
            model_sha256=str(model.get("sha256") or "unknown")[:DIGEST_PREFIX],
            slots=str(serving.get("slots", "unknown")),
            ctx_per_slot=str(serving.get("ctx_per_slot", "unknown")),
        )


def _build_label(build: Mapping[str, object]) -> str:
    """llama-server's own spelling (``/props`` build_info): "b<number>-<commit7>", from the ``--version``
    output the build facts carry (``prepare._build_facts``); else the commit; else unknown."""
    found = _VERSION.search(str(build.get("version") or ""))
    if found:
        return f"b{found[1]}-{found[2]}"
    commit = build.get("commit")
    return str(commit)[:7] if commit else "unknown"


class SupervisorView(Protocol):
    """What the collector reads; ``driver.ChildSupervisor`` provides it."""

    @property
    def machine(self) -> Machine: ...

    @property
    def child_pid(self) -> int | None: ...

    @property
    def load_seconds(self) -> float | None: ...

    @property
    def ready_since(self) -> float | None: ...

    @property
    def budget(self) -> Mapping[str, object] | None: ...

    def child_rss_bytes(self) -> int | None: ...

    def child_cpu_seconds(self) -> float | None: ...

    def identity(self) -> Mapping[str, object]: ...


@dataclass(frozen=True)
class ModelView:
    """One served model as the collector sees it: its driver, and for an ``on_demand`` model whether a
    child is loaded (an unloaded one has none: its state reads ``UNLOADED``)."""

    view: SupervisorView
    on_demand: bool = False
    loaded: bool = True


# The served models by name, read at every scrape: a several-model daemon's models come and go on SIGHUP
# and a model reloaded on demand gets a new driver.
Views = Callable[[], Mapping[str, ModelView]]
UNLOADED = "UNLOADED"
_PARTS = ("weights", "kv", "runtime", "prompt_cache", "checkpoint")


class SupervisorCollector(Collector):
    """Every series carries the served model's name as ``model`` (one model's daemon: its alias), so one
    set of rules and dashboards reads both kinds of daemon; the host's own figures carry none."""

    def __init__(self, views: Views, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._views = views
        self._clock = clock  # the drivers' clock: ready_since is on it
        self._processes: dict[str, psutil.Process] = {}
        # The identity changes only when a new child is spawned with new settings; read it once per boot
        # (per driver and generation).
        self._served: dict[str, tuple[SupervisorView, int, ServedLabels]] = {}

    @classmethod
    def single(
        cls, view: SupervisorView, model: Callable[[], str], *, clock: Callable[[], float] = time.monotonic
    ) -> SupervisorCollector:
        """One model's daemon: its one driver under the served alias (read at scrape time)."""
        return cls(lambda: {model(): ModelView(view)}, clock=clock)

    def collect(self) -> Iterator[Metric]:
        views = dict(self._views())
        for gone in [n for n in self._served if n not in views]:
            del self._served[gone]
        for gone in [n for n in self._processes if n not in views]:
            del self._processes[gone]
        yield from self._state(views)
        yield from self._child(views)
        yield from self._memory(views)
        info = InfoMetricFamily(
            "llamagate_served", "What is served: llama.cpp build, binary, model, capacity"
        )
        for name, mv in views.items():
            info.add_metric([], vars(self._served_labels(name, mv.view)))
        yield info

    def _served_labels(self, name: str, view: SupervisorView) -> ServedLabels:
        generation = view.machine.generation
        cached = self._served.get(name)
        if cached is None or cached[0] is not view or cached[1] != generation:
            cached = self._served[name] = (view, generation, ServedLabels.from_identity(view.identity()))
        return cached[2]

    def _state(self, views: Mapping[str, ModelView]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "llamagate_child_state",
            "1 for the child's current supervisor state, 0 for the others, by model"
            " (UNLOADED: an on_demand model with no child)",
            labels=["model", "state"],
        )
        restarts = CounterMetricFamily(
            "llamagate_child_restarts", "Child starts after the first, any reason", labels=["model"]
        )
        failures = CounterMetricFamily(
            "llamagate_child_failures",
            "Unplanned child stops, by cause (each is followed by a restart or FAILED)",
            labels=["model", "cause"],
        )
        ready = GaugeMetricFamily(
            "llamagate_child_ready_seconds",
            "Seconds since the child passed the readiness gate (0 when not ready)",
            labels=["model"],
        )
        load = GaugeMetricFamily(
            "llamagate_child_load_duration_seconds",
            "Spawn to READY of the last successful load",
            labels=["model"],
        )
        now = self._clock()
        for name, mv in views.items():
            m = mv.view.machine
            unloaded = mv.on_demand and not mv.loaded
            for s in State:
                state.add_metric([name, s.value], 1.0 if m.state is s and not unloaded else 0.0)
            if mv.on_demand:
                state.add_metric([name, UNLOADED], 1.0 if unloaded else 0.0)
            restarts.add_metric([name], m.restarts)
            for cause in sorted({*FAILURE_CAUSES, *m.failures}):
                failures.add_metric([name, cause], m.failures.get(cause, 0))
            since = mv.view.ready_since
            ready.add_metric([name], 0.0 if since is None or unloaded else max(0.0, now - since))
            seconds = mv.view.load_seconds
            if seconds is not None:
                load.add_metric([name], seconds)
        yield from (state, restarts, failures, ready)
        if load.samples:
            yield load

    def _child(self, views: Mapping[str, ModelView]) -> Iterator[Metric]:
        rss_family = GaugeMetricFamily(
            "llamagate_child_resident_memory_bytes", "Resident memory of llama-server", labels=["model"]
        )
        cpu_family = CounterMetricFamily(
            "llamagate_child_cpu_seconds", "CPU time of llama-server, user + system", labels=["model"]
        )
        threads_family = GaugeMetricFamily(
            "llamagate_child_threads", "Threads of llama-server", labels=["model"]
        )
        for name, mv in views.items():
            view = mv.view
            rss, cpu, threads = view.child_rss_bytes(), view.child_cpu_seconds(), self._threads(name, view)
            # Each is None when there is no child or it exited between two reads: absent, never an error.
            if rss is not None:
                rss_family.add_metric([name], rss)
            if cpu is not None:
                cpu_family.add_metric([name], cpu)
            if threads is not None:
                threads_family.add_metric([name], threads)
        yield from (f for f in (rss_family, cpu_family, threads_family) if f.samples)

    def _threads(self, name: str, view: SupervisorView) -> int | None:
        pid = view.child_pid
        if pid is None:
            self._processes.pop(name, None)
            return None
        try:
            process = self._processes.get(name)
            if process is None or process.pid != pid:
                process = self._processes[name] = psutil.Process(pid)
            return process.num_threads()
        except psutil.Error:
            self._processes.pop(name, None)
            return None

    def _memory(self, views: Mapping[str, ModelView]) -> Iterator[Metric]:
        parts = GaugeMetricFamily(
            "llamagate_memory_budget_bytes",
            "Planned memory of the child by part (their sum is what the budget check required), by model",
            labels=["model", "part"],
        )
        headroom: int | None = None
        for name, mv in views.items():
            budget = mv.view.budget or {}
            for part in _PARTS:
                value = budget.get(f"{part}_bytes")
                if isinstance(value, int):
                    parts.add_metric([name, part], value)
            kept = budget.get("headroom_bytes")
            if headroom is None and isinstance(kept, int):
                headroom = kept  # the host's, the same in every model's budget: exported once
        if parts.samples:
            yield parts
        if headroom is not None:
            yield _gauge(
                "llamagate_memory_headroom_bytes", "Memory the budget keeps free on the host", headroom
            )
        yield _gauge(
            "llamagate_host_memory_available_bytes",
            "Host memory available to new allocations now (MemAvailable)",
            psutil.virtual_memory().available,
        )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
