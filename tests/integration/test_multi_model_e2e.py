"""Several models behind one door, against the real llama-server and the demo model loaded twice: once
as a chat model ("chat", also called "chat-alias"), once with embeddings ("embed"); one slot, a small
context and one thread each. Both serve through one key, at the same time; a child killed with SIGKILL
leaves the other serving while it recovers; an on_demand model loads on its first request and is
stopped once idle; SIGHUP removing a model stops only its child; a set that does not fit is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk

from tests.integration.conftest import Daemon, DaemonFactory, process_gone, wait_until

pytestmark = pytest.mark.integration


def model(factory: DaemonFactory, name: str, **extra: Any) -> dict[str, Any]:
    entry = {
        "name": name,
        "path": str(factory.model),
        "sha256": factory.model_sha256,
        "slots": 1,
        "ctx_per_slot": 512,
        "threads": 1,
    }
    return {**entry, **extra}


def two_models(factory: DaemonFactory, **embed: Any) -> dict[str, Any]:
    return {
        "llama": {"prompt_cache_mib": 0, "ctx_checkpoints": 0},
        "models": [
            model(factory, "chat", aliases=["chat-alias"]),
            model(factory, "embed", embeddings=True, extra_args=["--pooling", "mean"], **embed),
        ],
    }


def client(d: Daemon) -> OpenAI:
    return OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0, timeout=120)


def open_stream(c: OpenAI, model: str, prompt: str, max_tokens: int) -> Iterator[ChatCompletionChunk]:
    """A chat answer streaming from ``model``: the chunks, read as the test goes."""
    stream = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True
    )
    return iter(stream)


def chat(d: Daemon, name: str = "chat") -> str:
    with client(d) as c:
        answer = c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
    assert answer.model == "chat"
    return answer.choices[0].message.content or ""


def embed(d: Daemon) -> list[float]:
    with client(d) as c:
        answer = c.embeddings.create(model="embed", input="a document about llamas")
    return answer.data[0].embedding


def models_status(d: Daemon) -> dict[str, Any]:
    models: dict[str, Any] = d.admin_identity()["models"]
    return models


def child_pid(d: Daemon, name: str) -> int | None:
    pid = models_status(d)[name]["status"]["child_pid"]
    return int(pid) if pid is not None else None


def listed(d: Daemon) -> dict[str, str]:
    r = httpx.get(
        f"{d.base_url}/v1/models", headers={"Authorization": f"Bearer {d.inference_key}"}, timeout=10
    )
    r.raise_for_status()
    return {m["id"]: m["llamagate"]["state"] for m in r.json()["data"]}


def test_two_models_serve_through_one_key_at_the_same_time(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(two_models(daemon_factory))
    assert listed(d) == {"chat": "loaded", "embed": "loaded"}
    code, body = d.readyz()
    assert code == 200 and body["not_ready"] == [] and set(body["models"]) == {"chat", "embed"}
    pids = {child_pid(d, "chat"), child_pid(d, "embed")}
    assert None not in pids and len(pids) == 2  # one child per model

    # An embeddings request runs and completes while a chat stream is open on the other model.
    with client(d) as c:
        chunks = open_stream(c, "chat-alias", "Count to twenty.", 48)
        first = next(chunks)
        assert first.model == "chat"
        vector = embed(d)
        rest = list(chunks)
    assert len(vector) > 0 and rest

    status = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", d.base_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0
    assert "    chat           READY (always), 1 slots x 512 tokens" in status.stdout
    assert "    embed          READY (always), 1 slots x 512 tokens" in status.stdout

    # llama-server's series from both children, each with its model's label.
    metrics = httpx.get(
        f"{d.base_url}/metrics", headers={"Authorization": f"Bearer {d.admin_key}"}, timeout=30
    ).text
    for name in ("chat", "embed"):
        assert f'llamagate_upstream_scrape_ok{{model="{name}"}} 1.0' in metrics
        assert any(
            line.startswith("llamacpp_tokens_predicted_total{") and f'model="{name}"' in line
            for line in metrics.splitlines()
        )

    # A model nobody serves: 404 naming what is served.
    with client(d) as c, pytest.raises(Exception) as refused:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert getattr(refused.value, "status_code", None) == 404
    assert "'chat', 'embed'" in str(refused.value)


def test_kill_9_of_one_child_leaves_the_other_serving_while_it_recovers(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(two_models(daemon_factory))
    chat_pid, embed_pid = child_pid(d, "chat"), child_pid(d, "embed")
    assert chat_pid is not None and embed_pid is not None
    os.kill(chat_pid, signal.SIGKILL)
    wait_until(lambda: process_gone(chat_pid), "the chat child to die")
    wait_until(
        lambda: models_status(d)["chat"]["status"]["state"] != "READY" or child_pid(d, "chat") != chat_pid,
        "the chat model's supervisor to notice",
    )
    # The other model answers while the first is down or coming back.
    assert embed(d)
    assert models_status(d)["embed"]["status"]["state"] == "READY"
    d.wait_for(
        lambda code, body: code == 200 and body["models"]["chat"]["restarts"] >= 1,
        "the chat model to recover",
    )
    assert child_pid(d, "embed") == embed_pid  # never touched
    assert models_status(d)["embed"]["status"]["restarts"] == 0
    assert chat(d)


def test_an_on_demand_model_loads_on_its_first_request_and_unloads_when_idle(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(two_models(daemon_factory, residency="on_demand", idle_unload_s=2))
    assert listed(d) == {"chat": "loaded", "embed": "unloaded"}
    code, body = d.readyz()
    assert code == 200 and body["models"]["embed"]["state"] == "UNLOADED"  # on_demand: not in readiness
    assert child_pid(d, "embed") is None

    # Two requests for the cold model at once share one load.
    results: list[list[float]] = []
    threads = [threading.Thread(target=lambda: results.append(embed(d))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 2 and all(results)
    assert models_status(d)["embed"]["loads"] == 1
    pid = child_pid(d, "embed")
    assert pid is not None

    wait_until(lambda: process_gone(pid), "the idle on_demand child to be stopped", timeout=90)
    assert listed(d)["embed"] == "unloaded"
    assert chat(d)  # the always model is untouched
    assert embed(d)  # and the on_demand one comes back on the next request
    assert models_status(d)["embed"]["loads"] == 2


def test_sigterm_drains_every_model_then_stops_every_child(daemon_factory: DaemonFactory) -> None:
    overrides = two_models(daemon_factory)
    overrides["proxy"] = {"drain_timeout_s": 120}  # a busy 2-core machine may take seconds per stream
    d = daemon_factory(overrides)
    pids = [child_pid(d, "chat"), child_pid(d, "embed")]
    with client(d) as c:
        chunks = open_stream(c, "chat", "Count from one to fifty in words.", 24)
        assert next(chunks).choices
        d.signal(signal.SIGTERM)
        d.wait_for(lambda code, b: code == 503 and b["ready"] is False, "readiness off", timeout=10)
        rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason in ("length", "stop")
    assert d.wait_exit() == 0
    assert all(pid is not None and process_gone(pid) for pid in pids)


def test_sighup_removing_one_model_stops_only_that_child(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(two_models(daemon_factory))
    chat_pid, embed_pid = child_pid(d, "chat"), child_pid(d, "embed")
    assert chat_pid is not None and embed_pid is not None
    config = dict(d.config)
    config["models"] = [m for m in config["models"] if m["name"] == "chat"]
    d.config = config
    d.config_path.write_text(yaml.safe_dump(config))
    d.signal(signal.SIGHUP)
    wait_until(lambda: process_gone(embed_pid), "the removed model's child to stop", timeout=60)
    d.wait_for(lambda code, body: body.get("last_reload") == "applied", "the reload to apply")
    assert child_pid(d, "chat") == chat_pid
    assert list(models_status(d)) == ["chat"]
    assert chat(d)
    with client(d) as c, pytest.raises(Exception) as refused:
        c.embeddings.create(model="embed", input="x")
    assert getattr(refused.value, "status_code", None) == 404


def test_sighup_changing_one_model_restarts_only_that_child(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(two_models(daemon_factory))
    chat_pid, embed_pid = child_pid(d, "chat"), child_pid(d, "embed")
    assert chat_pid is not None and embed_pid is not None
    config = dict(d.config)
    config["models"] = [{**m, "ctx_per_slot": 256} if m["name"] == "embed" else m for m in config["models"]]
    d.config = config
    d.config_path.write_text(yaml.safe_dump(config))
    # Requests for the model while it restarts: never a 404 (it is still served), a 503 to retry at most.
    statuses: list[tuple[int, str | None]] = []
    done = threading.Event()

    def ask() -> None:
        headers = {"Authorization": f"Bearer {d.inference_key}"}
        with httpx.Client(base_url=d.base_url, headers=headers, timeout=60) as c:
            while not done.is_set():
                r = c.post("/v1/embeddings", json={"model": "embed", "input": "llamas"})
                statuses.append((r.status_code, r.headers.get("retry-after")))

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        d.signal(signal.SIGHUP)
        d.wait_for(
            lambda code, body: (
                code == 200
                and body.get("last_reload") == "applied"
                and body["models"].get("embed", {}).get("ctx_per_slot") == 256
                and body["models"]["embed"]["ready"]
            ),
            "the changed model to be READY on its new settings",
        )
    finally:
        done.set()
        asker.join(90)
    assert statuses and all(code == 200 or (code == 503 and retry is not None) for code, retry in statuses), (
        statuses
    )
    assert process_gone(embed_pid) and child_pid(d, "embed") != embed_pid
    assert child_pid(d, "chat") == chat_pid  # untouched
    assert embed(d) and chat(d)


def test_always_models_that_do_not_fit_together_are_refused_with_the_numbers(
    daemon_factory: DaemonFactory,
) -> None:
    from supervisor.budget.plan import MIB
    from supervisor.config.load import parse_config
    from supervisor.daemon.prepare_models import prepare_models
    from supervisor.progress import NullProgress

    # Each model needs about 1.3 GiB (its prompt cache is budgeted); give the pair room for 1.5 of them:
    # each fits alone, both do not. The margin (0.5 of a model) absorbs memory moving meanwhile.
    overrides = two_models(daemon_factory)
    overrides["llama"] = {"prompt_cache_mib": 1024, "binary": str(daemon_factory.binary)}
    one = parse_config(yaml.safe_dump({"models": [overrides["models"][0]], "llama": overrides["llama"]}))
    (alone,) = prepare_models(one, progress=NullProgress())
    budget = alone.prepared.budget
    headroom = budget.available_bytes - int(1.5 * budget.required_bytes)
    overrides["supervision"] = {"memory_headroom_mib": headroom // MIB}
    d = daemon_factory(overrides, wait_ready=False)
    assert d.wait_exit(120) == 2
    log = d.log_text()
    assert "the models do not fit in memory together" in log
    assert "every always model" in log and "MiB needed" in log and "MiB usable" in log
    assert "chat (always)" in log and "embed (always)" in log


def test_a_models_config_with_a_bad_field_is_refused_by_its_path(daemon_factory: DaemonFactory) -> None:
    overrides = two_models(daemon_factory)
    overrides["models"][1]["residency"] = "sometimes"
    overrides["tenants"] = [{"name": "default", "models": ["chat", "nope"]}]
    d = daemon_factory(overrides, wait_ready=False)
    assert d.wait_exit(60) == 2
    log = d.log_text()
    assert "models[1].residency: must be one of always, on_demand" in log
    assert "tenants[0].models[1]: 'nope' is not a served model" in log
    done = subprocess.run(
        [sys.executable, "-m", "supervisor", "config", "check", "--config", str(d.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2


def test_plan_adds_up_every_always_model_and_the_largest_on_demand_one(
    daemon_factory: DaemonFactory, tmp_path: Any
) -> None:
    config = two_models(daemon_factory, residency="on_demand")
    config["llama"]["binary"] = str(daemon_factory.binary)
    path = tmp_path / "models.yaml"

    def plan(headroom_mib: int) -> subprocess.CompletedProcess[str]:
        path.write_text(yaml.safe_dump({**config, "supervision": {"memory_headroom_mib": headroom_mib}}))
        return subprocess.run(
            [sys.executable, "-m", "supervisor", "plan", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    fits = plan(256)
    assert fits.returncode == 0, fits.stderr
    assert "chat (always):" in fits.stdout and "embed (on_demand):" in fits.stdout
    assert "-a embed" in fits.stdout and "--embeddings" in fits.stdout
    assert "every always model + the largest on_demand one:" in fits.stdout and "\nfits\n" in fits.stdout
    refused = plan(10**7)  # 10 TB of headroom: nothing fits
    assert refused.returncode == 1 and "does not fit" in refused.stdout
