"""The supervisor's series, read from a real state machine driven with plain numbers for time, behind a
fake of the driver's read side (``SupervisorView``)."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.budget.plan import Budget
from supervisor.child.machine import Exited, GatePassed, Machine, Start, State, Tick
from supervisor.child.restart import Policy
from supervisor.daemon.identity import served_identity
from supervisor.daemon.metrics_collector import ModelView, SupervisorCollector
from tests.helpers.promtool import check_metrics

MIB = 1024 * 1024
BUDGET = Budget(
    weights_bytes=235 * MIB,
    kv_bytes=54 * MIB,
    runtime_bytes=140 * MIB,
    available_bytes=20_000 * MIB,
    headroom_bytes=1024 * MIB,
    slots=2,
    ctx_per_slot=4096,
    max_ctx_per_slot=32768,
    max_slots=16,
)
IDENTITY = served_identity(
    binary=Path("/cache/llama-server"),
    binary_sha256="dd45c2f620ef121461b9a93db51381902389253ddd24888229a521c51ee4e9aa",
    build={  # as supervisor.daemon.prepare builds them from the receipt
        "commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
        "version": "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with cc 12.2.0",
    },
    model=Path("/cache/gemma.gguf"),
    model_size=253_000_000,
    model_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    alias="gemma-3-270m",
    serving={"threads": 2, "threads_batch": 2, "slots": 2, "ctx_per_slot": 4096},
    host={"cpu_model": "test"},
)


MODEL = "gemma-3-270m"  # one model's daemon labels its series with the served alias


def lab(**labels: str) -> tuple[tuple[str, str], ...]:
    """A sample's sorted labels, the model's included."""
    return tuple(sorted({"model": MODEL, **labels}.items()))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """The driver's read side: a real Machine; load and readiness times kept as the driver keeps them."""

    def __init__(self, pid: int | None = None, alias: str = MODEL) -> None:
        self.alias = alias
        self.machine = Machine(Policy(max_restarts=2, restart_window_s=300))
        self.child_pid = pid
        self.load_seconds: float | None = None
        self.ready_since: float | None = None
        self.budget: dict[str, object] | None = dict(BUDGET.as_dict())
        self.clock = Clock()
        self.identity_reads = 0
        self.collector = SupervisorCollector.single(self, lambda: MODEL, clock=self.clock)

    def identity(self) -> dict[str, object]:
        self.identity_reads += 1
        model = IDENTITY["model"]
        assert isinstance(model, dict)
        return {**IDENTITY, "model": {**model, "alias": self.alias}}

    def child_rss_bytes(self) -> int | None:
        return psutil.Process(self.child_pid).memory_info().rss if self.alive() else None

    def child_cpu_seconds(self) -> float | None:
        return sum(psutil.Process(self.child_pid).cpu_times()[:2]) if self.alive() else None

    def alive(self) -> bool:
        return self.child_pid is not None and psutil.pid_exists(self.child_pid)

    def step(self, event: object, now: float) -> None:
        self.clock.now = now
        spawned_at = self.machine.spawned_at
        self.machine.step(event, now)  # type: ignore[arg-type]
        for t in self.machine.transitions:
            if t.new is State.READY and t.old is State.STARTING:
                self.load_seconds, self.ready_since = now - spawned_at, now
            elif t.new not in (State.READY, State.UNHEALTHY):
                self.ready_since = None

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(self.collector)
        return generate_latest(registry)

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for family in text_string_to_metric_families(self.render().decode()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def state_of(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> list[str]:
    return [
        dict(labels)["state"]
        for (name, labels), v in samples.items()
        if name == "llamagate_child_state" and v == 1
    ]


def test_one_state_series_per_state_and_only_the_current_one_is_1() -> None:
    h = Harness()
    samples = h.samples()
    states = [dict(labels)["state"] for (name, labels) in samples if name == "llamagate_child_state"]
    assert {dict(labels)["model"] for (name, labels) in samples if name == "llamagate_child_state"} == {MODEL}
    assert sorted(states) == sorted(s.value for s in State)
    assert state_of(samples) == ["STOPPED"]


def test_boot_crash_restart_and_give_up() -> None:
    h = Harness()
    h.step(Start(), 0.0)
    assert state_of(h.samples()) == ["STARTING"]
    h.step(GatePassed(1), 2.5)
    h.clock.now = 12.5
    s = h.samples()
    assert state_of(s) == ["READY"]
    assert s[("llamagate_child_load_duration_seconds", lab())] == 2.5
    assert s[("llamagate_child_ready_seconds", lab())] == 10.0
    assert s[("llamagate_child_failures_total", lab(cause="exit"))] == 0

    h.step(Exited(1, "killed by SIGKILL"), 20.0)
    h.step(Tick(), 20.0)  # backoff 0 in this policy: starts again
    s = h.samples()
    assert state_of(s) == ["STARTING"]
    assert s[("llamagate_child_failures_total", lab(cause="exit"))] == 1
    assert s[("llamagate_child_restarts_total", lab())] == 1
    assert s[("llamagate_child_ready_seconds", lab())] == 0
    # the last successful load stays visible while the next one runs
    assert s[("llamagate_child_load_duration_seconds", lab())] == 2.5

    # max_restarts 2: the crash of the ready child does not count towards giving up; the third
    # failed start does.
    for gen, at in [(2, 21.0), (3, 22.0)]:
        h.step(Exited(gen, "exited with code 1"), at)
        h.step(Tick(), at)
        assert state_of(h.samples()) == ["STARTING"]
    h.step(Exited(4, "exited with code 1"), 23.0)
    s = h.samples()
    assert state_of(s) == ["FAILED"]
    assert s[("llamagate_child_failures_total", lab(cause="load_exit"))] == 3
    assert s[("llamagate_child_failures_total", lab(cause="exit"))] == 1


def test_child_process_figures_come_from_the_live_pid() -> None:
    # The child says when it is up (interpreter loaded, 8 MiB written): read right after the spawn, a
    # busy machine may still show the half-exec'd process with next to nothing resident.
    script = "import time; ballast = b'x' * (8 << 20); print('up', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 60.0)  # a deadline, not a pace
        assert ready and child.stdout.readline() == "up\n"
        h = Harness(pid=child.pid)
        s = h.samples()
        assert s[("llamagate_child_resident_memory_bytes", lab())] > 1 * MIB
        assert s[("llamagate_child_threads", lab())] >= 1
        assert s[("llamagate_child_cpu_seconds_total", lab())] >= 0
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    # the pid is gone and the driver has not noticed yet: the series are absent, the scrape works
    s = h.samples()
    assert ("llamagate_child_resident_memory_bytes", lab()) not in s
    assert ("llamagate_child_state", lab(state="STOPPED")) in s


def test_no_child_no_process_series() -> None:
    s = Harness(pid=None).samples()
    assert not [
        name for name, _ in s if name.startswith(("llamagate_child_resident", "llamagate_child_threads"))
    ]


def test_memory_budget_figures() -> None:
    h = Harness()
    s = h.samples()
    assert s[("llamagate_memory_budget_bytes", lab(part="weights"))] == 235 * MIB
    assert s[("llamagate_memory_budget_bytes", lab(part="kv"))] == 54 * MIB
    assert s[("llamagate_memory_budget_bytes", lab(part="runtime"))] == 140 * MIB
    assert s[("llamagate_memory_headroom_bytes", ())] == 1024 * MIB
    assert s[("llamagate_host_memory_available_bytes", ())] > 0
    h.budget = None
    s = h.samples()
    assert ("llamagate_memory_headroom_bytes", ()) not in s
    assert not [name for name, _ in s if name == "llamagate_memory_budget_bytes"]


def test_served_info_carries_the_identity() -> None:
    h = Harness()
    s = h.samples()
    labels = {
        "llama_cpp_build": "b1-0c1e570",
        "binary_sha256": "dd45c2f620ef",
        "model": "gemma-3-270m",
        "model_sha256": "a5fd3b62230a",
        "slots": "2",
        "ctx_per_slot": "4096",
    }
    assert s[("llamagate_served_info", tuple(sorted(labels.items())))] == 1
    h.samples()
    assert h.identity_reads == 1  # read once per boot, not per scrape
    h.step(Start(), 1.0)
    h.samples()
    assert h.identity_reads == 2


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (
            {"source": "external binary (no receipt)", "version": "version: 7 (build 6000, commit abcdef1)"},
            "b6000-abcdef1",
        ),
        ({"commit": "0c1e57098bba43ac"}, "0c1e570"),
        ({"source": "external binary (no receipt)", "version": "unknown"}, "unknown"),
        (None, "unknown"),
    ],
)
def test_build_label_fallbacks(build: dict[str, object] | None, expected: str) -> None:
    from supervisor.daemon.metrics_collector import ServedLabels

    identity = served_identity(
        binary=Path("/b"),
        binary_sha256="x",
        build=build,
        model=Path("/m"),
        model_size=1,
        model_sha256="y",
        alias="a",
        serving={"threads": 1, "threads_batch": 1, "slots": 1, "ctx_per_slot": 256},
        host={},
    )
    assert ServedLabels.from_identity(identity).llama_cpp_build == expected


@pytest.mark.needs_tool("promtool")
def test_promtool_accepts_the_supervisor_series() -> None:
    h = Harness(pid=None)
    h.step(Start(), 0.0)
    h.step(GatePassed(1), 1.0)
    result = check_metrics(h.render())
    assert result.returncode == 0, result.stdout + result.stderr


# --- several models ----------------------------------------------------------------------------------
class Models:
    """A several-model daemon's read side: the served models by name, changed between scrapes as SIGHUP
    and on-demand loads change them."""

    def __init__(self) -> None:
        self.views: dict[str, ModelView] = {}
        self.collector = SupervisorCollector(lambda: self.views, clock=lambda: 30.0)

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(self.collector)
        out = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def states_by_model(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for (name, labels), v in samples.items():
        if name == "llamagate_child_state" and v == 1:
            out.setdefault(dict(labels)["model"], []).append(dict(labels)["state"])
    return out


def of(model: str, **labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model": model, **labels}.items()))


@pytest.mark.needs_tool("promtool")
def test_several_models_one_sample_set_each_and_the_host_series_once() -> None:
    chat, embed = Harness(alias="chat"), Harness(alias="embed")
    chat.step(Start(), 0.0)
    chat.step(GatePassed(1), 2.0)
    chat.step(Exited(1, "killed by SIGKILL"), 10.0)
    chat.step(Tick(), 10.0)
    chat.step(GatePassed(2), 12.0)
    embed.budget = {**BUDGET.as_dict(), "weights_bytes": 100 * MIB}
    m = Models()
    m.views = {"chat": ModelView(chat), "embed": ModelView(embed, on_demand=True, loaded=False)}
    s = m.samples()
    # The on_demand model with no child reads UNLOADED, not its stopped machine's STOPPED.
    assert states_by_model(s) == {"chat": ["READY"], "embed": ["UNLOADED"]}
    assert ("llamagate_child_state", of("chat", state="UNLOADED")) not in s  # an always model never is
    assert s[("llamagate_child_restarts_total", of("chat"))] == 1
    assert s[("llamagate_child_restarts_total", of("embed"))] == 0
    assert s[("llamagate_child_failures_total", of("chat", cause="exit"))] == 1
    assert s[("llamagate_child_failures_total", of("embed", cause="exit"))] == 0
    assert s[("llamagate_child_ready_seconds", of("chat"))] == 18.0
    assert s[("llamagate_child_ready_seconds", of("embed"))] == 0
    assert s[("llamagate_child_load_duration_seconds", of("chat"))] == 2.0
    assert ("llamagate_child_load_duration_seconds", of("embed")) not in s  # never loaded
    assert s[("llamagate_memory_budget_bytes", of("chat", part="weights"))] == 235 * MIB
    assert s[("llamagate_memory_budget_bytes", of("embed", part="weights"))] == 100 * MIB
    # The host's figures once, without a model.
    assert s[("llamagate_memory_headroom_bytes", ())] == 1024 * MIB
    assert s[("llamagate_host_memory_available_bytes", ())] > 0
    assert [k for k in s if k[0].startswith("llamagate_host_memory")] == [
        ("llamagate_host_memory_available_bytes", ())
    ]
    # One served info per model, its model label the model's own (no second ``model`` label).
    served = {dict(labels)["model"]: v for (name, labels), v in s.items() if name == "llamagate_served_info"}
    assert served == {"chat": 1, "embed": 1}
    result = check_metrics(generate_latest(_registry(m.collector)))
    assert result.returncode == 0, result.stdout + result.stderr

    # embed loads on demand: a new driver, READY; its identity is read for the new driver.
    loaded = Harness(alias="embed")
    loaded.step(Start(), 20.0)
    loaded.step(GatePassed(1), 25.0)
    m.views["embed"] = ModelView(loaded, on_demand=True, loaded=True)
    s = m.samples()
    assert states_by_model(s) == {"chat": ["READY"], "embed": ["READY"]}
    assert s[("llamagate_child_state", of("embed", state="UNLOADED"))] == 0
    assert s[("llamagate_child_ready_seconds", of("embed"))] == 5.0
    assert loaded.identity_reads == 1

    # SIGHUP removes chat: its series are gone at the next scrape.
    del m.views["chat"]
    s = m.samples()
    assert {dict(labels).get("model") for (_, labels) in s} == {"embed", None}


def _registry(collector: SupervisorCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    return registry
