"""SIGHUP with llama settings that cannot work, against the real llama-server and the demo model: the
daemon stays READY on the settings it had, says why in /readyz and status, and still answers; and a
FAILED daemon comes back with a SIGHUP once its config is fixed."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import pytest
from openai import OpenAI

from tests.fakes.fake_child import make_fake_binary
from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

KEPT = "; kept the previous settings"


def chat(d: Daemon) -> str:
    with OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
    return answer.choices[0].message.content or ""


def status(d: Daemon) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", d.base_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout


def last_reload(d: Daemon) -> Any:
    return d.readyz()[1].get("last_reload")


def spawned_argvs(d: Daemon) -> list[str]:
    return [str(r["argv"]) for r in d.log_records() if r.get("msg") == "starting llama-server"]


def test_an_unknown_llama_flag_is_rejected_and_the_working_child_keeps_serving(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    pid = d.child_pid
    d.write_config({"llama": {"extra_args": ["--bogus-flag"]}})
    d.signal(signal.SIGHUP)
    wait_until(lambda: last_reload(d) is not None, "the reload's outcome", timeout=120)
    expected = (
        "reload rejected: llama-server refused its arguments: error: invalid argument: --bogus-flag" + KEPT
    )
    code, body = d.readyz()
    assert (code, body["ready"], body["last_reload"]) == (200, True, expected)
    assert d.admin_status()["last_reload"] == expected
    assert expected in d.log_text()
    assert f"last reload  {expected}" in status(d)
    # The binary judged the arguments before anything was stopped: same child, same generation.
    assert body["generation"] == 1 and d.child_pid == pid
    assert len(spawned_argvs(d)) == 1
    assert chat(d)


def test_settings_that_fail_at_load_roll_back_to_the_previous_ones(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory()
    first_pid = d.child_pid
    assert first_pid is not None
    missing = str(daemon_factory.folder / "missing-adapter.gguf")
    # The parser accepts --lora FILE; only loading the adapter fails, in the new child started beside the
    # old one (the host has memory for both): the old child never stops serving.
    d.write_config({"llama": {"extra_args": ["--lora", missing]}})
    d.signal(signal.SIGHUP)
    wait_until(lambda: last_reload(d) is not None, "the reload's outcome", timeout=180)
    reason = last_reload(d)
    assert reason.startswith("reload rejected: llama-server exited during load") and reason.endswith(KEPT)
    code, body = d.readyz()
    assert code == 200 and body["last_reload"] == reason and body["state"] == "READY"
    assert body["generation"] == 1 and d.child_pid == first_pid
    argvs = spawned_argvs(d)
    assert ["--lora" in argv for argv in argvs] == [False, True]
    assert chat(d)
    # A fixed config then applies (the llama settings equal the running ones: no restart).
    d.write_config({"llama": {"extra_args": []}})
    d.signal(signal.SIGHUP)
    wait_until(lambda: last_reload(d) == "applied", "the fixed config to apply")
    assert d.readyz()[1]["generation"] == 1 and d.child_pid == first_pid


def test_failed_says_how_to_recover_and_a_sighup_with_a_fixed_config_does(
    daemon_factory: DaemonFactory,
) -> None:
    fake = make_fake_binary(daemon_factory.folder / "fake", "--exit-during-load", "1")
    crash_loop = {"supervision": {"max_restarts": 1, "backoff_initial_s": 0.1, "backoff_max_s": 0.1}}
    d = daemon_factory(crash_loop, binary=fake, wait_ready=False)
    body = d.wait_for(lambda code, b: b.get("state") == "FAILED", "FAILED", timeout=60)
    r = d._client.get(f"{d.base_url}/readyz")
    assert r.status_code == 503 and "retry-after" not in r.headers
    assert "retry_after_s" not in body and "SIGHUP" in body["recovery"]
    assert f"recovery     {body['recovery']}" in status(d)
    d.write_config({"llama": {"binary": str(daemon_factory.binary)}})
    d.signal(signal.SIGHUP)
    body = d.wait_ready()
    assert body["last_reload"] == "applied" and "recovery" not in body
    assert chat(d)
