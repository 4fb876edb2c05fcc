"""The daemon around a misbehaving child (the fake llama-server, or the real one on a model file that
does not load): FAILED stays visible, or exits; a child that dies after READY is never FAILED."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from supervisor.artifacts.files import sha256_file
from tests.fakes.fake_child import make_fake_binary
from tests.integration.conftest import DaemonFactory

pytestmark = pytest.mark.integration

CRASH_LOOP = {"supervision": {"max_restarts": 1, "backoff_initial_s": 0.1, "backoff_max_s": 0.1}}


def test_failed_keeps_the_daemon_up_and_readyz_says_why(daemon_factory: DaemonFactory) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake", "--exit-during-load", "3")
    d = daemon_factory(CRASH_LOOP, binary=fake, wait_ready=False)
    body = d.wait_for(lambda code, b: b.get("state") == "FAILED", "FAILED", timeout=60)
    assert body["ready"] is False
    assert body["reason"].startswith(
        "gave up: 2 failed starts within 300 s (max_restarts 1); last: exited during load: exited with code 3"
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


def test_a_model_file_that_fails_to_load_ends_failed_within_the_window(daemon_factory: DaemonFactory) -> None:
    # The real llama-server on the demo model cut in half: the header (all the daemon reads before the
    # start) is whole, the tensor data is not, so every child exits during load. Three failed starts
    # within the window (max_restarts 2) are FAILED, before the window is over.
    cut = daemon_factory.folder / "cut.gguf"
    with daemon_factory.model.open("rb") as whole, cut.open("wb") as half:
        half.write(whole.read(daemon_factory.model.stat().st_size // 2))
    window_s = 120
    started = time.monotonic()
    d = daemon_factory(
        {
            "llama": {"model": {"path": str(cut), "sha256": sha256_file(cut)}},
            "supervision": {
                "max_restarts": 2,
                "restart_window_s": window_s,
                "backoff_initial_s": 0.5,
                "backoff_max_s": 1,
            },
        },
        wait_ready=False,
    )
    body = d.wait_for(lambda code, b: b.get("state") == "FAILED", "FAILED", timeout=window_s)
    assert time.monotonic() - started < window_s
    reason = body["reason"]
    assert reason.startswith(
        "gave up: 3 failed starts within 120 s (max_restarts 2); last: exited during load: exited with code 1"
    ), reason
    assert reason.endswith("data is not within the file bounds, model is corrupted or incomplete"), reason
    status = d.admin_status()
    assert status["failures"] == {"load_exit": 3} and status["generation"] == 3
    assert d.stop() == 0


def test_a_ready_child_that_keeps_dying_is_restarted_never_failed(daemon_factory: DaemonFactory) -> None:
    # max_restarts 1: a second failed start would be FAILED. Four deaths by SIGABRT (what a request that
    # aborts llama-server does) of a child that had passed the gate each time are restarted, and the
    # daemon says which kind of restart it is.
    d = daemon_factory(CRASH_LOOP, binary=make_fake_binary(daemon_factory.folder / "fake"))
    reasons = set()
    for generation in range(1, 5):
        pid = d.child_pid
        assert pid is not None and d.readyz()[1]["generation"] == generation

        def back(code: int, b: dict[str, Any], g: int = generation + 1) -> bool:
            return (code == 200 and b["generation"] == g) or b["state"] == "FAILED"

        os.kill(pid, signal.SIGABRT)
        body = d.wait_for(back, f"READY on child {generation + 1}")
        assert body["state"] == "READY", body
        reasons.add(body["last_failure"])
    assert reasons == {"killed by SIGABRT"}
    status = d.admin_status()
    assert status["failures"] == {"exit": 4} and status["restarts"] == 4
    assert "after a crash of a ready child (" in d.log_text()
    assert d.stop() == 0


def test_exit_on_failed_exits_non_zero(daemon_factory: DaemonFactory) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake", "--exit-during-load", "1")
    overrides = {"supervision": {**CRASH_LOOP["supervision"], "exit_on_failed": True}}
    d = daemon_factory(overrides, binary=fake, wait_ready=False)
    assert d.wait_exit(60) == 1
    assert "exited during load: exited with code 1" in d.log_text()
    assert "failed to load model (fake)" in d.log_text()  # the child's last words travel with the failure
