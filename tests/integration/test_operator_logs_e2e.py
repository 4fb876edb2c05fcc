"""The real llama-server's own error line reaches /readyz, `status` and the log, without the GPU notice."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.conftest import DaemonFactory

pytestmark = pytest.mark.integration


def test_a_child_that_refuses_its_arguments_is_failed_in_its_own_words(daemon_factory: DaemonFactory) -> None:
    # Accepted by config check (llamagate cannot know every flag of the binary); the child refuses it.
    d = daemon_factory(
        {"llama": {"extra_args": ["--bogus-flag"]}, "supervision": {"max_restarts": 0}}, wait_ready=False
    )
    body = d.wait_for(lambda code, b: b.get("state") == "FAILED", "FAILED", timeout=120)
    said = "exited during load: exited with code 1: error: invalid argument: --bogus-flag"
    assert said in body["reason"] and said in body["last_failure"]
    status = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", d.base_url],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert status.returncode == 1 and said in status.stdout
    [failed] = [r for r in d.log_records() if r.get("msg", "").startswith("llama-server FAILED")]
    tail = failed["child_log_tail"]
    assert tail.startswith("error: invalid argument: --bogus-flag"), tail
    assert "no usable GPU" not in tail
    assert d.stop() == 0
