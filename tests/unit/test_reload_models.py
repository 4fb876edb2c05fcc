"""SIGHUP as one reconcile per model, decided with fakes (no process, no model): two models, one
changed; the old child serves until the new one passes the gate when memory holds both, a refusal or a
failed trial leaves every model as it was, supervision reaches every model's prober at once, and a
FAILED model comes back on an unchanged config."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import signal
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

import supervisor.daemon.service as daemon_mod
from supervisor.child.driver import ChildSupervisor
from supervisor.child.machine import State, Tick
from supervisor.child.osseam import ServedModel
from supervisor.config.load import load_config
from supervisor.config.models import served_models
from supervisor.config.schema import Config
from supervisor.daemon.prepare import Prepared
from supervisor.daemon.prepare_models import PreparedModel
from supervisor.daemon.service import Daemon
from tests.unit.test_daemon import prepared
from tests.unit.test_process_driver import FakeChild
from tests.unit.test_reload import LlamaOs, LoadingProbes, until

KEPT = "; kept the previous settings"
CONFIG = """
supervision: {{health_interval_s: {interval}, max_restarts: {max_restarts}}}
tenants: [{{name: default, max_queue: {max_queue}}}]
models:
  - {{name: chat, path: /m/chat.gguf, sha256: "{sha}"}}
  - {{name: embed, path: /m/embed.gguf, sha256: "{sha}"{embed}}}
"""


class ServingProbes(LoadingProbes):
    """Each child answers /v1/models with its own alias and per-slot context; ``hold`` keeps every
    child spawned from now on loading (/health 503) until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.serves: dict[str, ServedModel] = {}
        self.hold = False
        self.health_calls: dict[str, int] = {}

    async def health(self, base_url: str, timeout_s: float) -> int:
        self.health_calls[base_url] = self.health_calls.get(base_url, 0) + 1
        return await super().health(base_url, timeout_s)

    async def models(self, base_url: str, secret: str) -> list[ServedModel]:
        return [self.serves[base_url]]

    def release(self) -> None:
        self.hold = False
        self.loading.clear()


class ServingOs(LlamaOs):
    def __init__(self, probes: ServingProbes) -> None:
        super().__init__(probes)
        self.serving = probes
        self.by_alias: dict[str, list[FakeChild]] = {}

    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> FakeChild:
        child = await super().spawn(argv, env, cwd)
        if argv[1:2] != ["--help"]:
            arg = dict(itertools.pairwise(argv))
            base = f"http://127.0.0.1:{arg['--port']}"
            ctx = int(arg["-c"]) // int(arg["-np"])
            self.serving.serves[base] = ServedModel(arg["-a"], ctx)
            self.by_alias.setdefault(arg["-a"], []).append(child)
            if self.serving.hold:
                self.serving.loading.add(base)
        return child


def fake_prepare(room_for: int) -> Callable[..., Prepared]:
    def prepare(cfg: Config, **kwargs: object) -> Prepared:
        """prepare() for one model's config without files, on a host with room for ``room_for`` children."""
        p = prepared()
        llama = cfg.llama
        spec = replace(p.spec, alias=llama.model.alias).with_llama(
            ctx_per_slot=llama.ctx_per_slot, slots=llama.slots, extra_args=tuple(llama.extra_args)
        )
        budget = replace(p.budget, available_bytes=p.budget.required_bytes * room_for + 1, headroom_bytes=0)
        return replace(p, spec=spec, budget=budget, identity={"model": {"alias": llama.model.alias}})

    return prepare


class Harness:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room_for: int) -> None:
        self.prepare = fake_prepare(room_for)
        monkeypatch.setattr(daemon_mod, "prepare", self.prepare)
        self.path = tmp_path / "llamagate.yaml"
        self.write()
        self.probes = ServingProbes()
        self.os = ServingOs(self.probes)
        cfg = load_config(self.path)
        models = [PreparedModel(m, self.prepare(m.cfg)) for m in served_models(cfg)]
        self.daemon = Daemon(cfg, models, config_path=self.path, child_os=self.os, probes=self.probes)

    def write(
        self, *, interval: float = 3600, max_restarts: int = 5, max_queue: int = 8, embed: str = ""
    ) -> None:
        self.path.write_text(
            CONFIG.format(
                interval=interval, max_restarts=max_restarts, max_queue=max_queue, sha="1" * 64, embed=embed
            )
        )

    def sup(self, name: str) -> ChildSupervisor:
        return self.daemon.models.hosts[name].sup

    def child(self, name: str, index: int = -1) -> FakeChild:
        return self.os.by_alias[name][index]

    def max_queue(self) -> int:
        return self.daemon.proxy.runtime.tenant("default").max_queue  # type: ignore[no-any-return]

    def last_reload(self, name: str) -> object:
        return self.daemon.models.hosts[name].snapshot().info["last_reload"]


async def serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room_for: int = 4
) -> AsyncIterator[Harness]:
    h = Harness(tmp_path, monkeypatch, room_for)
    task = asyncio.create_task(h.daemon.models.run())
    try:
        await until(lambda: all(h.sup(n).state is State.READY for n in ("chat", "embed")), "both READY")
        yield h
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await h.daemon._close()


@pytest.fixture
async def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    async for harness in serving(tmp_path, monkeypatch):
        yield harness


@pytest.fixture
async def tight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    """Room for the two models' children, not a third."""
    async for harness in serving(tmp_path, monkeypatch, room_for=2):
        yield harness


async def test_the_old_child_serves_until_one_on_the_new_settings_passes_the_gate(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    old, other = h.child("embed"), h.child("chat")
    old_url = h.daemon.models.hosts["embed"].snapshot().base_url
    h.write(embed=", ctx_per_slot: 2048", max_restarts=7)
    h.probes.hold = True  # the new child loads until released
    caplog.set_level(logging.INFO, logger="llamagate.daemon")
    reload = asyncio.create_task(h.daemon.reload())
    await until(lambda: len(h.os.by_alias["embed"]) == 2, "a child on the new settings")
    for _ in range(20):
        await asyncio.sleep(0)  # while it loads, the old child serves on: untouched, and still the model's
        assert old.signals == [] and h.daemon.models.hosts["embed"].snapshot().base_url == old_url
        assert h.daemon.models.snapshot().ready
    assert not reload.done()
    h.probes.release()
    await asyncio.wait_for(reload, 10)
    embed = h.daemon.models.hosts["embed"]
    assert old.signals == [signal.SIGTERM]  # stopped once the new one served
    assert embed.snapshot().base_url != old_url and embed.snapshot().ctx_per_slot == 2048
    assert (embed.sup.machine.generation, embed.sup.machine.restarts) == (2, 1)  # one model's count
    assert embed.sup.machine.policy.max_restarts == 7  # started under the new supervision
    assert h.last_reload("embed") == "applied" and h.daemon.models.last_reload == "applied"
    assert other.signals == [] and h.sup("chat").machine.generation == 1
    assert "model 'embed': side by side" in caplog.text


async def test_new_settings_that_fail_beside_the_old_child_leave_it_serving_and_apply_nothing(
    h: Harness,
) -> None:
    old = h.child("embed")
    h.write(embed=", extra_args: [--lora, /missing.gguf]", max_queue=1)
    await h.daemon.reload()
    failed = "llama-server exited during load: exited with code 1"
    assert str(h.last_reload("embed")).startswith(f"reload rejected: {failed}")
    assert str(h.daemon.models.last_reload).startswith(f"reload rejected: model 'embed': {failed}")
    assert old.signals == [] and h.sup("embed").state is State.READY
    assert h.sup("embed").machine.generation == 1 and h.sup("embed").machine.failures == {}
    assert h.max_queue() == 8  # the tenants' change waits for a reload that applies


async def test_an_argument_one_model_refuses_leaves_every_model_as_it_was(h: Harness) -> None:
    h.write(embed=", extra_args: [--bogus-flag]", max_queue=1)
    await h.daemon.reload()
    refused = "llama-server refused its arguments: error: invalid argument: --bogus-flag"
    assert h.last_reload("embed") == f"reload rejected: {refused}{KEPT}"
    assert (
        h.last_reload("chat")
        == h.daemon.models.last_reload
        == f"reload rejected: model 'embed': {refused}{KEPT}"
    )
    assert [len(h.os.by_alias[n]) for n in ("chat", "embed")] == [1, 1]  # no child started or stopped
    assert h.child("chat").signals == h.child("embed").signals == []
    assert h.max_queue() == 8


async def test_memory_for_one_child_only_stops_the_old_child_first_and_says_so(
    tight: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    old = tight.child("embed")
    tight.write(embed=", ctx_per_slot: 2048")
    await tight.daemon.reload()
    assert tight.last_reload("embed") == "applied" and old.signals == [signal.SIGTERM]
    assert "model 'embed': stop, then start: both children at once would need" in caplog.text


async def test_a_stop_during_the_trial_leaves_no_child_on_the_new_settings(h: Harness) -> None:
    h.write(embed=", ctx_per_slot: 2048")
    h.probes.hold = True
    reload = asyncio.create_task(h.daemon.reload())
    await until(lambda: len(h.os.by_alias["embed"]) == 2, "a child on the new settings")
    reload.cancel()  # what a SIGTERM does to a reload
    await asyncio.gather(reload, return_exceptions=True)
    assert h.child("embed").signals == [signal.SIGKILL] and h.child("embed", 0).signals == []
    assert h.daemon.models.hosts["embed"].sup.state is State.READY


async def test_supervision_reaches_every_models_prober_at_once(h: Harness) -> None:
    # At 3600 s nothing has been probed since READY; at the new interval each child is probed within
    # moments, without the old hour-long wait.
    before = dict(h.probes.health_calls)
    h.write(interval=0.01, max_restarts=9)
    await h.daemon.reload()
    assert h.daemon.models.last_reload == "applied"
    for name in ("chat", "embed"):
        url = h.daemon.models.hosts[name].snapshot().base_url
        assert url is not None
        await until(lambda u=url: h.probes.health_calls.get(u, 0) >= before.get(u, 0) + 3, f"{name} probed")
        sup = h.sup(name)
        assert sup.health_interval_s == 0.01 and sup.machine.policy.max_restarts == 9
        assert sup.status()["supervision"]["max_restarts"] == 9
    assert [len(h.os.by_alias[n]) for n in ("chat", "embed")] == [1, 1]  # no child restarted for it


async def test_sighup_with_the_config_unchanged_starts_a_failed_model_again(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    h.sup("embed").govern(replace(h.sup("embed").machine.policy, max_restarts=0), 3600, 2)
    h.child("embed").exit(-9)  # a crash of the ready child: restarted after its backoff, never FAILED
    await until(lambda: h.sup("embed").state is State.BACKOFF, "embed BACKOFF")
    h.os.spawn_error = OSError(errno.ENOENT, "No such file or directory")  # and then it cannot start
    h.os.t += 60.0  # the fake clock passes the backoff (at most backoff_max_s)
    h.sup("embed").post(Tick())
    await until(lambda: h.sup("embed").state is State.FAILED, "embed FAILED")
    h.os.spawn_error = None  # the cause went away outside the config
    assert not h.daemon.models.snapshot().ready and "SIGHUP" in str(h.sup("embed").status()["recovery"])
    with caplog.at_level(logging.WARNING, logger="llamagate.daemon"):
        await h.daemon.reload()
    await until(lambda: h.sup("embed").state is State.READY, "embed READY again")
    assert h.daemon.models.snapshot().ready and len(h.os.by_alias["embed"]) == 2
    assert h.child("chat").signals == [] and h.sup("chat").machine.generation == 1
    assert "model 'embed' is FAILED: starting llama-server again" in caplog.text


async def test_going_from_models_to_the_llama_section_replaces_the_set(h: Harness) -> None:
    old = [h.child("chat"), h.child("embed")]
    h.path.write_text(f'llama: {{model: {{path: /m/solo.gguf, sha256: "{"1" * 64}", alias: solo}}}}\n')
    await h.daemon.reload()
    assert list(h.daemon.models.hosts) == ["solo"] and h.daemon.models.last_reload == "applied"
    await until(lambda: h.sup("solo").state is State.READY, "solo READY")
    assert h.daemon.models.snapshot().ready and h.daemon.models.snapshot().model_alias == "solo"
    assert all(child.signals == [signal.SIGTERM] for child in old)
