"""Several models: the ``models:`` config and what a single-model config still means, the router's choice
of model, and the model set's on-demand decisions (room in the budget, idle unload, one shared load),
with stand-in hosts and no child processes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from proxy.errors import BadRequest, Forbidden, ModelNotFound, NotReady
from proxy.models.lane import ModelEntry
from proxy.models.router import ModelRouter
from proxy.settings import TenantSettings
from supervisor.config.load import parse_config
from supervisor.config.models import served_models
from supervisor.config.schema import Config
from supervisor.daemon.model_hosts import ModelHost, ModelSet
from supervisor.errors import ConfigError
from tests.fakes.fake_upstream import StaticSource, snapshot_for

SHA = "a" * 64


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(text, env={})
    return list(exc.value.problems)


# --- configuration -----------------------------------------------------------------------------------
def test_the_embedded_default_and_a_llama_section_are_one_always_model() -> None:
    (only,) = served_models(Config())
    assert (only.name, only.residency, only.idle_unload_s) == ("smollm2-135m-instruct", "always", None)
    assert only.cfg == Config()  # the one-model daemon gets its config untouched
    cfg = parse_config("llama: {model: {alias: mine}, slots: 3}\nproxy: {model_aliases: [other]}\n")
    (only,) = served_models(cfg)
    assert (only.name, only.aliases, only.cfg) == ("mine", ("other",), cfg)


def test_a_models_entry_is_the_llama_section_with_its_own_fields_over_it() -> None:
    cfg = parse_config(
        "llama: {slots: 3, threads: 2, extra_args: [--temp, '0']}\n"
        "models:\n"
        f"  - {{name: chat, aliases: [c], path: /m.gguf, sha256: '{SHA}'}}\n"
        "  - {name: embed, embeddings: true, slots: 1, extra_args: [--pooling, mean],"
        " residency: on_demand, idle_unload_s: 7}\n",
        env={},
    )
    chat, embed = served_models(cfg)
    assert (chat.name, chat.aliases, chat.residency, chat.idle_unload_s) == ("chat", ("c",), "always", None)
    assert chat.cfg.llama.slots == 3 and chat.cfg.llama.extra_args == ("--temp", "0")
    assert chat.cfg.llama.model.alias == "chat" and str(chat.cfg.llama.model.path) == "/m.gguf"
    assert chat.cfg.proxy.model_aliases == ("c",) and chat.cfg.models == ()
    assert (embed.residency, embed.idle_unload_s, embed.on_demand) == ("on_demand", 7.0, True)
    assert embed.cfg.llama.slots == 1 and embed.cfg.llama.embeddings is True
    assert embed.cfg.llama.threads == 2 and embed.cfg.llama.extra_args == ("--pooling", "mean")


def test_models_problems_are_reported_by_their_path() -> None:
    assert problems(
        "proxy: {model_aliases: [x]}\n"
        "models:\n"
        "  - {name: chat, aliases: [embed], path: /m.gguf}\n"
        f"  - {{name: embed, residency: sometimes, slots: 0, sha256: '{SHA}', extra_args: [--port, '1']}}\n"
        "  - {aliases: [z]}\n"
        "tenants: [{name: default, models: [chat, nope]}]\n"
    ) == [
        "models[1].residency: must be one of always, on_demand (got 'sometimes')",
        "models[1].slots: must be >= 1",
        "models[0].sha256: required when models[0].path is set (the file is verified)",
        "models[1].name: 'embed' already names models[0]",
        "models[1].sha256: only with models[1].path (the demo model's digest is pinned)",
        "models[1].extra_args[0]: --port is not allowed: set by the supervisor from the config",
        "models[2].name: required",
        "proxy.model_aliases: with models:, give each model its own aliases (models[].aliases)",
        "tenants[0].models[1]: 'nope' is not a served model (served: chat, embed)",
    ]


# --- routing -----------------------------------------------------------------------------------------
def router() -> ModelRouter:
    def source() -> StaticSource:
        return StaticSource(snapshot_for("http://127.0.0.1:1", "s"))

    entries = [
        ModelEntry("chat", ("c", "gpt"), source()),
        ModelEntry("embed", (), source(), "on_demand"),
    ]
    return ModelRouter(entries, (TenantSettings("t"),))


def test_one_model_may_be_named_by_its_name_an_alias_or_not_at_all() -> None:
    # Was the one-model daemon's check_model: the router of one lane answers the same.
    r = ModelRouter([ModelEntry("m", ("gpt-4o-mini",), StaticSource(snapshot_for(None, None)))], ())
    assert r.resolve(None, None).name == "m"
    assert r.resolve("m", None).name == "m"
    assert r.resolve("gpt-4o-mini", None).name == "m"
    with pytest.raises(ModelNotFound) as info:
        r.resolve("other", None)
    assert info.value.status == 404 and info.value.code == "model_not_found"
    with pytest.raises(ModelNotFound):
        r.resolve(7, None)


def test_the_model_field_picks_a_lane_by_name_or_alias_and_tenants_may_be_limited() -> None:
    r = router()
    anyone = TenantSettings("t")
    assert r.resolve("chat", anyone).name == "chat"
    assert r.resolve("gpt", anyone).name == "chat"
    assert r.resolve("embed", anyone).name == "embed"
    assert r.lanes["chat"].gate is not r.lanes["embed"].gate  # a gate each
    with pytest.raises(ModelNotFound, match="'nope' does not exist; this server serves 'chat', 'embed'"):
        r.resolve("nope", anyone)
    with pytest.raises(BadRequest, match="'model' is required"):
        r.resolve(None, anyone)
    with pytest.raises(Forbidden, match="tenant 't' may not use the model 'embed'"):
        r.resolve("embed", TenantSettings("t", models=("chat",)))


# --- the model set's on-demand decisions -------------------------------------------------------------
@dataclass
class _Served:
    name: str
    on_demand: bool = True
    idle_unload_s: float | None = 10.0
    residency: str = "on_demand"
    preload: bool = False


@dataclass
class StandIn:
    """What ``ModelSet`` reads and asks of a host."""

    name: str
    required_bytes: int
    on_demand: bool = True
    running: bool = False
    unloading: bool = False
    starts: int = 0
    stops: list[str] = field(default_factory=list)
    served: _Served = field(init=False)

    def __post_init__(self) -> None:
        self.served = _Served(self.name, self.on_demand, 10.0 if self.on_demand else None)
        self.sup = self

    def start(self) -> None:
        self.running = True
        self.starts += 1

    async def stop(self, reason: str) -> None:
        await asyncio.sleep(0)
        self.running = False
        self.unloading = False
        self.stops.append(reason)

    draining: bool = False


def model_set(usable: int, *hosts: StandIn, usage: dict[str, tuple[bool, float]]) -> ModelSet:
    s = ModelSet(usable)
    for h in hosts:
        s.hosts[h.name] = cast(ModelHost, h)
    s.usage = lambda name: usage.get(name, (False, 0.0))
    return s


async def test_a_load_that_does_not_fit_unloads_the_least_recently_used_idle_model() -> None:
    always = StandIn("chat", 400, on_demand=False, running=True)
    old = StandIn("old", 300, running=True)
    recent = StandIn("recent", 300, running=True)
    new = StandIn("new", 300)
    s = model_set(1100, always, old, recent, new, usage={"old": (False, 1.0), "recent": (False, 5.0)})
    await s.load(cast(ModelHost, new))
    assert new.running and new.starts == 1
    assert old.stops == ["made room for 'new'"] and recent.stops == [] and always.stops == []


async def test_a_load_with_no_idle_model_to_unload_is_a_503_saying_why() -> None:
    mib = 1 << 20
    busy = StandIn("busy", 600 * mib, running=True)
    new = StandIn("new", 600 * mib)
    s = model_set(1000 * mib, busy, new, usage={"busy": (True, 0.0)})
    with pytest.raises(NotReady) as refused:
        await s.load(cast(ModelHost, new))
    assert str(refused.value) == (
        "the model 'new' needs 600 MiB and does not fit: 600 MiB of 1,000 MiB usable is held by loaded"
        " models (busy 600 MiB) and no on_demand model among them is idle"
    )
    assert refused.value.headers.get("retry-after") is not None
    assert busy.running and not new.running


async def test_concurrent_loads_of_one_cold_model_start_it_once() -> None:
    new = StandIn("new", 1)
    s = model_set(10, new, usage={})
    await asyncio.gather(*(s.load(cast(ModelHost, new)) for _ in range(5)))
    assert new.starts == 1


async def test_idle_unload_waits_for_idle_time_and_never_takes_a_busy_model() -> None:
    idle = StandIn("idle", 1, running=True)
    busy = StandIn("busy", 1, running=True)
    always = StandIn("chat", 1, on_demand=False, running=True)
    usage = {"idle": (False, 100.0), "busy": (True, 0.0), "chat": (False, 0.0)}
    s = model_set(10, idle, busy, always, usage=usage)
    assert await s._unload_idle(105.0) == pytest.approx(2.5)  # busy: checked again soon
    assert idle.stops == [] and idle.running
    await s._unload_idle(110.0)
    assert idle.stops == ["idle for 10 s"] and not idle.running
    assert busy.running and busy.stops == [] and always.running


def test_resident_decode_threads_beyond_the_cores_are_warned_about() -> None:
    from types import SimpleNamespace

    from supervisor.daemon.prepare_models import PreparedModel, thread_warning

    cfg = parse_config(
        "models: [{name: a, threads: 2}, {name: b, threads: 1},"
        " {name: c, threads: 4, residency: on_demand}, {name: d, threads: 8, residency: on_demand,"
        " ctx_per_slot: 256}]\n",
        env={},
    )

    def prepared(threads: int, required: int) -> Any:
        return SimpleNamespace(
            spec=SimpleNamespace(threads=threads), budget=SimpleNamespace(required_bytes=required)
        )

    a, b, c, d = served_models(cfg)
    models = (
        PreparedModel(a, prepared(2, 10)),
        PreparedModel(b, prepared(1, 10)),
        PreparedModel(c, prepared(4, 30)),  # the largest on_demand model: resident with the always ones
        PreparedModel(d, prepared(8, 20)),
    )
    assert thread_warning(models, cores=7) is None
    assert thread_warning(models, cores=6) == (
        "the resident children's decode threads add up to 7 (a 2, b 1, c 4) on 6 cores: they compete,"
        " and every model's time per output token grows; lower models[].threads"
    )


def test_config_check_names_a_models_missing_file_by_its_path(tmp_path: Any) -> None:
    import subprocess
    import sys

    from supervisor.config.models import as_model_path

    assert as_model_path("llama.model.sha256: differs", 2) == "models[2].sha256: differs"
    assert as_model_path("something else", 2) == "something else"
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - {{name: x, path: {tmp_path}/missing.gguf, sha256: '{SHA}'}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "config", "check", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert f"models[0].path: model file not found: {tmp_path}/missing.gguf" in done.stdout + done.stderr


async def test_a_waiter_that_leaves_never_cancels_the_load_it_started() -> None:
    from types import SimpleNamespace

    from supervisor.child.machine import State

    started, gate, done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def loader(host: Any) -> None:
        started.set()
        await gate.wait()  # e.g. an idle model being unloaded to make room
        done.set()

    sup = SimpleNamespace(observers=[], state=State.STARTING)
    served = _Served("cold")
    model = SimpleNamespace(served=served, prepared=SimpleNamespace())
    host = ModelHost(cast(Any, model), lambda name, prepared: cast(Any, sup), loader)
    waiter = asyncio.create_task(host.ensure_loaded())
    await asyncio.wait_for(started.wait(), 5)
    waiter.cancel()  # the client left
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.set()
    await asyncio.wait_for(done.wait(), 5)  # the load went on for whoever asks next


async def test_a_host_announces_every_transition_of_its_child_to_every_waiter() -> None:
    # What a request waiting for the next READY child (proxy.routes.replay) wakes on.
    from types import SimpleNamespace

    from proxy.source import AnnouncesChanges
    from supervisor.child.machine import State

    sup = SimpleNamespace(observers=[], state=State.READY)
    model = SimpleNamespace(served=_Served("m"), prepared=SimpleNamespace())
    host = ModelHost(cast(Any, model), lambda name, prepared: cast(Any, sup), lambda h: None)
    assert isinstance(host, AnnouncesChanges)
    waiters = [asyncio.create_task(host.changed(30.0)) for _ in range(2)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    for observer in sup.observers:
        observer(State.READY, State.BACKOFF, "exited")
    await asyncio.wait_for(asyncio.gather(*waiters), 5)
    later = asyncio.create_task(host.changed(30.0))  # a new wait is for the next transition
    await asyncio.sleep(0)
    assert not later.done()
    for observer in sup.observers:
        observer(State.BACKOFF, State.STARTING, None)
    await asyncio.wait_for(later, 5)


def test_a_failed_always_model_keeps_the_aggregate_failed_while_another_restarts() -> None:
    from types import SimpleNamespace

    from supervisor.child.machine import State

    def host(name: str) -> Any:
        return SimpleNamespace(name=name, served=SimpleNamespace(on_demand=False), sup=SimpleNamespace())

    restarting, failing = host("b"), host("a")  # the one restarting is listed first
    s = ModelSet(10)
    s.hosts = {"b": restarting, "a": failing}
    heard: list[tuple[State, State]] = []
    s.observers.append(lambda old, new, reason: heard.append((old, new)))
    restarting.sup.state = failing.sup.state = State.READY
    s._on_change(failing, State.READY, None)
    failing.sup.state = State.FAILED
    s._on_change(failing, State.FAILED, "gave up")
    restarting.sup.state = State.BACKOFF
    s._on_change(restarting, State.BACKOFF, "exited")
    assert heard == [(State.STOPPED, State.READY), (State.READY, State.FAILED)]
    restarting.sup.state = State.READY
    s._on_change(restarting, State.READY, None)
    failing.sup.state = State.READY  # e.g. after a SIGHUP restart
    s._on_change(failing, State.READY, None)
    assert heard[-1] == (State.FAILED, State.READY)


def test_a_model_restarting_on_sighup_answers_503_not_404_until_it_is_back() -> None:
    r = router()
    anyone = TenantSettings("t")
    chat = r.lanes["chat"].entry
    r.remove("chat", restarting=True)
    for name in ("chat", "gpt"):  # its name and its aliases
        with pytest.raises(NotReady, match="the model 'chat' is restarting with new settings") as refused:
            r.resolve(name, anyone)
        assert refused.value.headers["retry-after"] == "5"
    r.add(chat)  # the new child's lane
    assert r.resolve("gpt", anyone).name == "chat" and r.restarting == {}
    r.remove("embed")  # removed for good: not served
    with pytest.raises(ModelNotFound):
        r.resolve("embed", anyone)


async def test_a_host_reports_its_budget_share_and_an_always_model_refuses_to_unload() -> None:
    from types import SimpleNamespace

    from proxy.errors import Conflict
    from proxy.models.lane import OperatorControl

    def host(name: str, on_demand: bool) -> ModelHost:
        sup = SimpleNamespace(observers=[], tick_hooks=[], draining=False)
        served = _Served(name, on_demand, residency="on_demand" if on_demand else "always")
        budget = SimpleNamespace(required_bytes=250)
        model = SimpleNamespace(served=served, prepared=SimpleNamespace(budget=budget))
        return ModelHost(cast(Any, model), lambda n, p: cast(Any, sup), lambda h: None)

    s = ModelSet(1000)
    always, lazy = host("chat", False), host("lazy", True)
    s.add(always)
    s.add(lazy)
    assert isinstance(lazy, OperatorControl)
    assert lazy.control_report() == {"budget_bytes": 250, "budget_share": 0.25, "loads": 0}
    with pytest.raises(Conflict, match="'chat' has residency 'always'"):
        await always.unload("by hand")
    await lazy.unload("by hand")  # nothing running: nothing to stop, under the set's lock
    assert lazy.lock is s._lock and not s._lock.locked()


async def test_a_request_that_waited_out_a_load_gets_retry_after_from_the_supervisors_estimate() -> None:
    from types import SimpleNamespace

    from supervisor.child.machine import State

    snap = SimpleNamespace(retry_after_s=17.0)
    sup = SimpleNamespace(observers=[], state=State.STARTING, snapshot=lambda: snap)
    served = SimpleNamespace(name="cold", on_demand=True, load_wait_s=0.05)
    model = SimpleNamespace(served=served, prepared=SimpleNamespace())

    async def loader(host: Any) -> None:
        host.task = asyncio.get_running_loop().create_future()  # running, still loading

    host = ModelHost(cast(Any, model), lambda name, prepared: cast(Any, sup), loader)
    with pytest.raises(NotReady, match=r"still loading after 0\.05 s") as refused:
        await host.ensure_loaded()
    assert refused.value.headers["retry-after"] == "17"
    cast(asyncio.Future[None], host.task).cancel()


def test_preload_is_for_on_demand_models_only_and_reaches_the_served_model() -> None:
    assert problems("models:\n  - {name: chat, preload: true}\n") == [
        "models[0].preload: only for residency on_demand (an 'always' model is loaded at start anyway)"
    ]
    cfg = parse_config("models:\n  - {name: chat}\n  - {name: lazy, residency: on_demand, preload: true}\n")
    assert [m.preload for m in served_models(cfg)] == [False, True]


async def test_a_preloaded_on_demand_model_is_loaded_at_start_and_may_be_unloaded() -> None:
    always = StandIn("chat", 100, on_demand=False)
    lazy, cold = StandIn("lazy", 100), StandIn("cold", 100)
    lazy.served.preload = True
    # In use: the idle unload (which a preloaded model is subject to, as any on_demand one) leaves it.
    s = model_set(1000, always, lazy, cold, usage={"lazy": (True, 0.0)})
    running = asyncio.create_task(s.run())
    try:
        async with asyncio.timeout(5):
            while not (always.running and lazy.running):  # noqa: ASYNC110 - the set's own task starts them
                await asyncio.sleep(0.005)
        assert not cold.running and lazy.starts == 1
    finally:
        await s.stop()
        await running
    assert lazy.stops and not lazy.running
