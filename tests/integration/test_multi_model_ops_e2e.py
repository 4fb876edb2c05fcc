"""Several models, operations, against the real llama-server and the demo model loaded twice: "chat"
(also "chat-alias", two slots of 512 tokens) and "embed" (embeddings, mean pooling, one slot of 256).
The admin and counting routes reach the model they name (``?model=`` on a GET, the body's ``model`` on
a POST) and each answer is that child's own; ``/admin/load`` shows each model's gate; the daemon's log
names the model of every child line; ``llamagate status`` prints both models; an unloaded on_demand
model is not loaded by ``/props`` but is by ``/tokenize``."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.integration.conftest import Daemon, DaemonFactory
from tests.integration.test_multi_model_e2e import open_stream

pytestmark = pytest.mark.integration


def two_models(factory: DaemonFactory, **embed: Any) -> dict[str, Any]:
    common = {"path": str(factory.model), "sha256": factory.model_sha256, "threads": 1}
    return {
        "llama": {"prompt_cache_mib": 0, "ctx_checkpoints": 0},
        "models": [
            {**common, "name": "chat", "aliases": ["chat-alias"], "slots": 2, "ctx_per_slot": 512},
            {
                **common,
                "name": "embed",
                "slots": 1,
                "ctx_per_slot": 256,
                "embeddings": True,
                "extra_args": ["--pooling", "mean"],
                **embed,
            },
        ],
    }


def get(d: Daemon, path: str, key: str, **params: str) -> httpx.Response:
    return httpx.get(d.base_url + path, params=params, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def post(d: Daemon, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_admin_and_counting_routes_reach_the_model_they_name(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(two_models(daemon_factory))
    admin = d.admin_key

    # /props: each child's own settings (its alias, its context per slot).
    props = {m: get(d, "/props", admin, model=m).json() for m in ("chat", "chat-alias", "embed")}
    assert props["chat"]["model_alias"] == props["chat-alias"]["model_alias"] == "chat"
    assert props["embed"]["model_alias"] == "embed"
    assert props["chat"]["default_generation_settings"]["n_ctx"] == 512
    assert props["embed"]["default_generation_settings"]["n_ctx"] == 256
    assert props["chat"]["total_slots"] == 2 and props["embed"]["total_slots"] == 1
    # Without a model: the first always model, as with one model.
    assert get(d, "/props", admin).json()["model_alias"] == "chat"

    # /slots: that child's slots.
    assert len(get(d, "/slots", admin, model="chat").json()) == 2
    assert len(get(d, "/slots", admin, model="embed").json()) == 1
    assert len(get(d, "/slots", admin).json()) == 2

    # Counting routes: the body's model picks the child; both tokenize (the same model file).
    tokens = {}
    for m in ("embed", "chat-alias"):
        r = post(d, "/tokenize", d.inference_key, {"model": m, "content": "a document about llamas"})
        assert r.status_code == 200, r.text
        tokens[m] = r.json()["tokens"]
    assert tokens["embed"] == tokens["chat-alias"] and tokens["embed"]
    r = post(
        d,
        "/v1/chat/completions/input_tokens",
        d.inference_key,
        {"model": "chat", "messages": [{"role": "user", "content": "Say hi."}]},
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text

    # A model nobody serves: 404 listing what is served, on a GET and on a POST.
    for r in (
        get(d, "/slots", admin, model="nope"),
        post(d, "/tokenize", d.inference_key, {"model": "nope", "content": "x"}),
    ):
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert "'chat', 'embed'" in r.json()["error"]["message"]

    # /admin/load: each model's gate, and the totals. A request in flight shows on its model.
    with OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0, timeout=120) as c:
        chunks = open_stream(c, "chat", "Count from one to thirty in words.", 48)
        assert next(chunks).model == "chat"
        load = get(d, "/admin/load", admin).json()
        rest = list(chunks)
    assert rest
    assert set(load["models"]) == {"chat", "embed"}
    assert load["models"]["chat"]["slots"] == 2 and load["models"]["embed"]["slots"] == 1
    assert load["models"]["chat"]["in_flight"] == 1 and load["models"]["embed"]["in_flight"] == 0
    assert load["slots"] == 3 and load["in_flight"] == 1
    assert [t["in_flight"] for t in load["tenants"] if t["name"] == "default"] == [1]

    # The daemon's log: the supervisor's and the child's own lines name their model.
    records = d.log_records()
    for name in ("chat", "embed"):
        assert any(
            r.get("logger") == "llamagate.supervisor"
            and r.get("model") == name
            and r["msg"] == "llama-server READY"
            for r in records
        ), name
        assert any(r.get("logger") == "llamagate.child" and r.get("model") == name for r in records), name
    assert all(r.get("model") in ("chat", "embed") for r in records if r.get("logger") == "llamagate.child")

    # The top level of /admin/identity speaks for both models.
    top = d.admin_identity()["status"]
    assert (top["state"], top["ready"], top["not_ready"], top["default_model"]) == ("READY", True, [], "chat")
    assert top["restarts"] == 0 and top["last_failure"] is None

    # llamagate status: a line and an identity per model.
    status = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--url", d.base_url, "--key", admin],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    out = status.stdout
    assert "    chat           READY (always), 2 slots x 512 tokens" in out
    assert "    embed          READY (always), 1 slots x 256 tokens" in out
    assert "  restarts     0 (all models)" in out
    assert "  model chat\n    model file   " in out and "  model embed\n    model file   " in out
    assert "alias embed, threads 1/1, 1 slots x 256" in out


def test_an_unloaded_model_answers_props_not_loaded_and_tokenize_loads_it(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(two_models(daemon_factory, residency="on_demand", idle_unload_s=600))
    r = get(d, "/props", d.admin_key, model="embed")
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text
    assert "the model 'embed' is not running" in r.json()["error"]["message"]
    assert "an inference or counting request loads it" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert get(d, "/slots", d.admin_key, model="embed").status_code == 503
    assert d.admin_identity()["models"]["embed"]["loaded"] is False  # a GET never loads

    r = post(d, "/tokenize", d.inference_key, {"model": "embed", "content": "hello there"})
    assert r.status_code == 200 and r.json()["tokens"], r.text
    assert d.admin_identity()["models"]["embed"]["loads"] == 1
    assert get(d, "/props", d.admin_key, model="embed").json()["model_alias"] == "embed"
    assert len(get(d, "/slots", d.admin_key, model="embed").json()) == 1
