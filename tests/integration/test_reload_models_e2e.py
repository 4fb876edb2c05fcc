"""SIGHUP, model by model, against the real llama-server and the demo model served under two names
("chat" and "other"; one slot, a small context and one thread each): a flag the binary refuses leaves
that model on its old child and the other untouched; a FAILED model comes back on an unchanged config;
a supervision change reaches every model's prober; a changed context is served by a new child only
once it passed the gate, the old one answering until then."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Daemon, DaemonFactory, process_gone, wait_until
from tests.integration.test_multi_model_e2e import child_pid, client, model, models_status

pytestmark = pytest.mark.integration

KEPT = "; kept the previous settings"


def two(factory: DaemonFactory, other: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    return {
        "llama": {"prompt_cache_mib": 0, "ctx_checkpoints": 0},
        "models": [model(factory, "chat"), model(factory, "other", **(other or {}))],
        **over,
    }


def ask(d: Daemon, name: str) -> str:
    with client(d) as c:
        answer = c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
    assert answer.model == name
    return answer.choices[0].message.content or ""


def readyz_model(d: Daemon, name: str) -> dict[str, Any]:
    state: dict[str, Any] = d.readyz()[1]["models"][name]
    return state


def test_a_flag_the_binary_refuses_keeps_that_model_on_its_old_child(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(two(daemon_factory))
    pids = {n: child_pid(d, n) for n in ("chat", "other")}
    d.write_config(two(daemon_factory, {"extra_args": ["--bogus-flag"]}))
    d.signal(signal.SIGHUP)
    d.wait_for(lambda code, body: body.get("last_reload") is not None, "the reload's outcome", timeout=120)
    refused = "reload rejected: llama-server refused its arguments: error: invalid argument: --bogus-flag"
    code, body = d.readyz()
    assert code == 200 and body["models"]["other"]["last_reload"] == refused + KEPT
    # The daemon's line names the model (the default one, "chat", would speak unnamed).
    assert body["last_reload"] == refused.replace("rejected: ", "rejected: model 'other': ") + KEPT
    assert ask(d, "other") and ask(d, "chat")
    assert {n: child_pid(d, n) for n in ("chat", "other")} == pids  # neither child was touched


def test_sighup_with_the_config_unchanged_brings_a_failed_model_back(daemon_factory: DaemonFactory) -> None:
    # "other" serves its own name for the demo model (a hard link, else a copy), which can go away.
    path, away = daemon_factory.folder / "other.gguf", daemon_factory.folder / "other.gguf.away"
    try:
        os.link(daemon_factory.model, path)
    except OSError:
        shutil.copyfile(daemon_factory.model, path)
    d = daemon_factory(
        two(daemon_factory, {"path": str(path)}, supervision={"max_restarts": 0, "backoff_initial_s": 0.5})
    )
    chat_pid, other_pid = child_pid(d, "chat"), child_pid(d, "other")
    assert other_pid is not None
    path.rename(away)  # the running child keeps its mapping; a new one cannot open the file
    # A crash of the ready child is restarted, never FAILED; its restart cannot start, and with
    # max_restarts 0 that first failed start gives up.
    os.kill(other_pid, signal.SIGKILL)
    d.wait_for(lambda code, b: b["models"]["other"]["state"] == "FAILED", "the model to give up")
    code, failed = d.readyz()
    assert failed["models"]["other"]["reason"].startswith(
        "gave up: 1 failed start within 300 s (max_restarts 0); last: "
    )
    away.rename(path)  # the cause goes away outside the config
    d.signal(signal.SIGHUP)
    d.wait_for(lambda code, b: code == 200 and b["models"]["other"]["state"] == "READY", "READY again", 120)
    assert ask(d, "other")
    assert code == 503 and "SIGHUP" in failed["models"]["other"]["recovery"]  # what it promised
    assert child_pid(d, "chat") == chat_pid and child_pid(d, "other") not in (None, other_pid)


def test_a_supervision_change_reaches_every_models_prober(daemon_factory: DaemonFactory) -> None:
    # An hour between liveness probes: a child that stops answering would go unnoticed for that long.
    d = daemon_factory(two(daemon_factory, supervision={"health_interval_s": 3600}))
    d.write_config({"supervision": {"health_interval_s": 0.5, "health_timeout_s": 1}})
    d.signal(signal.SIGHUP)
    d.wait_for(lambda code, body: body.get("last_reload") == "applied", "the reload to apply")
    supervision = {n: models_status(d)[n]["status"].get("supervision") for n in ("chat", "other")}
    # From outside: both children stop answering (SIGSTOP); each model's prober notices at the new
    # interval, not in an hour.
    pids = [pid for pid in (child_pid(d, n) for n in ("chat", "other")) if pid is not None]
    assert len(pids) == 2
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for name in ("chat", "other"):
            d.wait_for(
                lambda code, body, n=name: (
                    body["models"][n]["state"] != "READY" or body["models"][n]["restarts"] >= 1
                ),
                f"{name}'s prober to notice",
                timeout=60,
            )
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # if it is still the stopped child, let it end normally
    # And from the inside: what each model's supervisor says it probes by.
    assert all(s is not None and s["health_interval_s"] == 0.5 for s in supervision.values()), supervision


def test_a_changed_context_is_served_by_the_old_child_until_the_new_one_passed_the_gate(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(two(daemon_factory))
    old_pid, chat_pid = child_pid(d, "other"), child_pid(d, "chat")
    statuses: list[int] = []
    serving: list[int | None] = []  # the model's child, polled through the reload
    done = threading.Event()

    def requests() -> None:
        headers = {"Authorization": f"Bearer {d.inference_key}"}
        body = {"model": "other", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}
        with httpx.Client(base_url=d.base_url, headers=headers, timeout=120, trust_env=False) as c:
            while not done.is_set():
                statuses.append(c.post("/v1/chat/completions", json=body).status_code)

    asker = threading.Thread(target=requests)
    asker.start()
    try:
        wait_until(lambda: len(statuses) >= 2, "requests before the reload", timeout=120)
        d.write_config(two(daemon_factory, {"ctx_per_slot": 1024}))
        d.signal(signal.SIGHUP)

        def switched() -> bool:
            serving.append(child_pid(d, "other"))
            assert readyz_model(d, "other")["ready"], "the model stopped being ready during the reload"
            return serving[-1] != old_pid

        wait_until(switched, "the new child to serve", timeout=180)
        before = len(statuses)
        wait_until(lambda: len(statuses) >= before + 2, "requests after the switch", timeout=120)
    finally:
        done.set()
        asker.join(150)
    assert statuses and set(statuses) == {200}, statuses
    # The old child until the switch, then the new one: never none, never a third.
    assert serving[0] == old_pid and set(serving) == {old_pid, serving[-1]} and None not in serving
    assert readyz_model(d, "other")["ctx_per_slot"] == 1024
    wait_until(lambda: old_pid is not None and process_gone(old_pid), "the old child to stop", timeout=60)
    # The reload ends, and says "applied", only once the old child has drained and stopped.
    wait_until(lambda: d.readyz()[1]["last_reload"] == "applied", "the reload to be applied", timeout=60)
    assert child_pid(d, "chat") == chat_pid
    assert ask(d, "other")
