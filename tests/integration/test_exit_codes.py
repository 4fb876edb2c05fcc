"""Exit codes of the real daemon, and the example configuration after the documented steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.fake_child import make_fake_binary
from tests.integration.conftest import DaemonFactory, process_gone, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_ctrl_c_to_serve_exits_130_after_stopping_the_child(daemon_factory: DaemonFactory) -> None:
    # The fake child loads in a moment; the daemon, its signal handling and its stop are the real ones.
    fake = make_fake_binary(daemon_factory.folder / "fake")
    d = daemon_factory(binary=fake)
    child = d.child_pid
    assert child is not None
    d.signal(signal.SIGINT)
    assert d.wait_exit() == 130
    wait_until(lambda: process_gone(child), "the child to be gone")
    assert "SIGINT received" in d.log_text()


def test_sigterm_to_serve_still_exits_0(daemon_factory: DaemonFactory) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake")
    d = daemon_factory(binary=fake)
    assert d.stop() == 0


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=REPO,
    )


def test_the_example_config_passes_config_check_after_the_documented_steps() -> None:
    # docs/deploy.md: `llamagate build`, `llamagate model fetch`, then `config check` (cache hits
    # when the session already built and fetched).
    for step in (("build",), ("model", "fetch")):
        done = _cli(*step)
        assert done.returncode == 0, done.stdout + done.stderr
    checked = _cli("config", "check", "--config", str(REPO / "deploy" / "config.example.yaml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "checked on this host: binary, model file and sha256, memory budget" in checked.stdout


def test_verify_json_into_a_closed_pipe_ends_quietly(llama_server_binary: Path) -> None:
    # `llamagate verify --json | head -0`: the reader is gone before the first write.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "supervisor", "verify", "--json", "--no-serve"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
            cwd=REPO,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
