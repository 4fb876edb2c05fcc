"""The daemon around a misbehaving child (the fake llama-server): FAILED stays visible, or exits."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fakes.fake_child import make_fake_binary
from tests.integration.conftest import DaemonFactory

pytestmark = pytest.mark.integration

CRASH_LOOP = {"supervision": {"max_restarts": 1, "backoff_initial_s": 0.1, "backoff_max_s": 0.1}}


def test_failed_keeps_the_daemon_up_and_readyz_says_why(daemon_factory: DaemonFactory) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake", "--crash-after-ready", "0.1")
    d = daemon_factory(CRASH_LOOP, binary=fake, wait_ready=False)
    body = d.wait_for(lambda code, b: b.get("state") == "FAILED", "FAILED", timeout=60)
    assert body["ready"] is False
    assert body["reason"].startswith(
        "gave up: 2 failures within 300 s (max_restarts 1); last: exited with code 3"
    )
    status = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", d.base_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert status.returncode == 1 and "NOT READY" in status.stdout and "gave up" in status.stdout
    assert d.stop() == 0


def test_exit_on_failed_exits_non_zero(daemon_factory: DaemonFactory) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake", "--exit-during-load", "1")
    overrides = {"supervision": {**CRASH_LOOP["supervision"], "exit_on_failed": True}}
    d = daemon_factory(overrides, binary=fake, wait_ready=False)
    assert d.wait_exit(60) == 1
    assert "exited during load: exited with code 1" in d.log_text()
    assert "failed to load model (fake)" in d.log_text()  # the child's last words travel with the failure
