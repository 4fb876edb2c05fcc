"""The supervisor's series for ``/metrics``: a prometheus-client collector read at scrape time.

Nothing here is updated on the supervisor's path: every value is read from the state machine, the
memory budget, the identity record and the child process (psutil) when Prometheus asks, so the series
can never drift from the truth and the supervisor pays nothing between scrapes.

The collector reads the driver (``SupervisorView``): the machine's state, restarts and failures, the
driver's load and readiness times, the child's figures, the memory budget and the identity.
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

# Failure causes the state machine records (process.Machine._fail); listed so that every cause is
# exported from the start at 0 and ``increase()`` sees the first failure of each.
FAILURE_CAUSES = ("spawn", "load_exit", "load_timeout", "load_stalled", "gate", "exit", "unhealthy")
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


class SupervisorCollector(Collector):
    def __init__(self, view: SupervisorView, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._view = view
        self._clock = clock  # the driver's clock: ready_since is on it
        self._process: psutil.Process | None = None
        # The identity changes only when a new child is spawned with new settings; read it once per boot.
        self._served: tuple[int, ServedLabels] | None = None

    def collect(self) -> Iterator[Metric]:
        m = self._view.machine
        yield from self._state(m)
        yield from self._child()
        yield from self._memory()
        info = InfoMetricFamily(
            "llamagate_served", "What is served: llama.cpp build, binary, model, capacity"
        )
        if self._served is None or self._served[0] != m.generation:
            self._served = (m.generation, ServedLabels.from_identity(self._view.identity()))
        info.add_metric([], vars(self._served[1]))
        yield info

    def _state(self, m: Machine) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "llamagate_child_state",
            "1 for the child's current supervisor state, 0 for the others",
            labels=["state"],
        )
        for s in State:
            state.add_metric([s.value], 1.0 if m.state is s else 0.0)
        yield state
        restarts = CounterMetricFamily("llamagate_child_restarts", "Child starts after the first, any reason")
        restarts.add_metric([], m.restarts)
        yield restarts
        failures = CounterMetricFamily(
            "llamagate_child_failures",
            "Unplanned child stops, by cause (each is followed by a restart or FAILED)",
            labels=["cause"],
        )
        for cause in sorted({*FAILURE_CAUSES, *m.failures}):
            failures.add_metric([cause], m.failures.get(cause, 0))
        yield failures
        since = self._view.ready_since
        yield _gauge(
            "llamagate_child_ready_seconds",
            "Seconds since the child passed the readiness gate (0 when not ready)",
            0.0 if since is None else max(0.0, self._clock() - since),
        )
        load = self._view.load_seconds
        if load is not None:
            yield _gauge(
                "llamagate_child_load_duration_seconds", "Spawn to READY of the last successful load", load
            )

    def _child(self) -> Iterator[Metric]:
        rss, cpu, threads = self._view.child_rss_bytes(), self._view.child_cpu_seconds(), self._threads()
        # Each is None when there is no child or it exited between two reads: absent, never an error.
        if rss is not None:
            yield _gauge("llamagate_child_resident_memory_bytes", "Resident memory of llama-server", rss)
        if cpu is not None:
            cpu_seconds = CounterMetricFamily(
                "llamagate_child_cpu_seconds", "CPU time of llama-server, user + system"
            )
            cpu_seconds.add_metric([], cpu)
            yield cpu_seconds
        if threads is not None:
            yield _gauge("llamagate_child_threads", "Threads of llama-server", threads)

    def _threads(self) -> int | None:
        pid = self._view.child_pid
        if pid is None:
            self._process = None
            return None
        try:
            if self._process is None or self._process.pid != pid:
                self._process = psutil.Process(pid)
            return self._process.num_threads()
        except psutil.Error:
            self._process = None
            return None

    def _memory(self) -> Iterator[Metric]:
        budget = self._view.budget or {}
        parts = GaugeMetricFamily(
            "llamagate_memory_budget_bytes",
            "Planned memory of the child by part (their sum is what the budget check required)",
            labels=["part"],
        )
        for part in ("weights", "kv", "runtime", "prompt_cache", "checkpoint"):
            value = budget.get(f"{part}_bytes")
            if isinstance(value, int):
                parts.add_metric([part], value)
        if parts.samples:
            yield parts
        headroom = budget.get("headroom_bytes")
        if isinstance(headroom, int):
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
