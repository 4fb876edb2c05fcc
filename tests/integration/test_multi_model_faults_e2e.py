"""Several models around misbehaving children (the fake llama-server, one behaviour per model through its
``extra_args``): systemd hears READY=1 only once every ``always`` model is READY; ``exit_on_failed`` exits
the daemon when an ``always`` model gives up, and not when an ``on_demand`` one fails to load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fakes.fake_child import make_fake_binary
from tests.integration.conftest import DaemonFactory, process_gone, wait_until
from tests.integration.test_deploy_notify import FakeSystemd
from tests.integration.test_multi_model_e2e import model

pytestmark = pytest.mark.integration

GIVE_UP_FAST = {"max_restarts": 1, "backoff_initial_s": 0.1, "backoff_max_s": 0.1}


def entry(factory: DaemonFactory, name: str, *switches: str, **extra: Any) -> dict[str, Any]:
    """A model entry whose fake child behaves as ``switches`` say."""
    return model(factory, name, extra_args=list(switches), **extra)


def config(*models: dict[str, Any], exit_on_failed: bool = False) -> dict[str, Any]:
    return {
        "llama": {"prompt_cache_mib": 0, "ctx_checkpoints": 0},
        "supervision": {**GIVE_UP_FAST, "exit_on_failed": exit_on_failed},
        "models": list(models),
    }


@pytest.fixture
def systemd() -> Iterator[FakeSystemd]:
    fake = FakeSystemd()
    yield fake
    fake.sock.close()


def test_ready_only_once_every_always_model_is_ready(
    daemon_factory: DaemonFactory, systemd: FakeSystemd
) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake")
    cfg = config(
        entry(daemon_factory, "fast"),
        entry(daemon_factory, "slow", "--load-seconds", "4"),
        entry(daemon_factory, "lazy", residency="on_demand", idle_unload_s=60),
    )
    d = daemon_factory(cfg, binary=fake, env=systemd.env(), wait_ready=False)
    # While "fast" is READY and "slow" still loads, the daemon is not ready and systemd hears nothing.
    body = d.wait_for(
        lambda code, b: b.get("models", {}).get("fast", {}).get("state") == "READY", "fast READY", 60
    )
    if body["models"]["slow"]["state"] != "READY":
        assert body["ready"] is False and body["not_ready"] == ["slow"]
        assert "READY=1" not in systemd.lines()
    systemd.wait_for(lambda m: "READY=1" in m, "READY=1", d, timeout=60)
    # The moment systemd hears READY=1 every always model is READY; the on_demand one is not loaded.
    code, body = d.readyz()
    assert code == 200 and body["ready"] is True and body["not_ready"] == []
    states = {name: m["state"] for name, m in body["models"].items()}
    assert states == {"fast": "READY", "slow": "READY", "lazy": "UNLOADED"}
    assert systemd.lines().count("READY=1") == 1
    assert d.stop() == 0


def test_exit_on_failed_exits_when_an_always_model_gives_up(daemon_factory: DaemonFactory) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake")
    cfg = config(
        entry(daemon_factory, "good"),
        entry(daemon_factory, "broken", "--exit-during-load", "1"),
        exit_on_failed=True,
    )
    d = daemon_factory(cfg, binary=fake, wait_ready=False)
    assert d.wait_exit(90) == 1
    log = d.log_text()
    assert "exit_on_failed" in log and "model 'broken'" in log
    # The healthy model's child went with the daemon: nothing is left running.
    pids = [int(p) for p in _child_pids(log)]
    assert pids and all(process_gone(pid) for pid in pids)


def test_an_on_demand_model_that_cannot_load_does_not_end_the_daemon(daemon_factory: DaemonFactory) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake")
    cfg = config(
        entry(daemon_factory, "good"),
        entry(daemon_factory, "broken", "--exit-during-load", "1", residency="on_demand", load_wait_s=60),
        exit_on_failed=True,
    )
    d = daemon_factory(cfg, binary=fake)
    answer = httpx.post(
        f"{d.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {d.inference_key}"},
        json={"model": "broken", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=90,
    )
    assert answer.status_code == 503, answer.text
    assert "the model 'broken' could not be loaded" in answer.json()["error"]["message"]
    # The request's failure is the model's own: the daemon serves on, ready, with its always model.
    code, body = d.readyz()
    assert d.proc.poll() is None and code == 200 and body["models"]["good"]["state"] == "READY"
    wait_until(lambda: d.readyz()[1]["models"]["broken"]["state"] in ("FAILED", "UNLOADED"), "broken down")
    code, body = d.readyz()  # and still after the failed model is down
    assert d.proc.poll() is None and code == 200 and body["not_ready"] == []
    assert d.stop() == 0


def _child_pids(log: str) -> list[str]:
    import re

    return re.findall(r"\bpid[=\": ]+(\d+)", log)
