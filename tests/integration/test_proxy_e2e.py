"""The proxy through the real daemon with the real llama-server and demo model: the openai SDK unchanged,
the auth matrix, the documented statuses, and logs that hold no key and no prompt."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from openai import AuthenticationError, NotFoundError, OpenAI, PermissionDeniedError

from proxy.auth import new_key
from tests.integration.conftest import DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PROMPT = "ZEBRA-PROMPT-7731 say hello"


def test_openai_sdk_unchanged(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"proxy": {"model_aliases": ["gpt-4o-mini"]}})
    client = OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0)

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8

    stream = client.chat.completions.create(
        model="gpt-4o-mini",  # a configured alias
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert 0 < chunks[-1].usage.completion_tokens <= 8

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert completion.choices[0].text is not None and completion.usage is not None
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True))
    assert len(pieces) >= 2

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_headers={"X-Request-ID": "e2e-42"},
    )
    assert raw.headers["x-request-id"] == "e2e-42"


def test_auth_matrix_and_revocation(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    url = d.base_url
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(timeout=60, trust_env=False) as c:

        def post(headers: dict[str, str]) -> httpx.Response:
            return c.post(f"{url}/v1/chat/completions", json=body, headers=headers)

        r = post({})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert post({"Authorization": f"Basic {d.inference_key}"}).status_code == 401
        stranger, _ = new_key("default", frozenset({"inference"}))
        assert post({"Authorization": f"Bearer {stranger}"}).status_code == 401
        assert post({"Authorization": f"Bearer {d.inference_key}"}).status_code == 200
        for path in ("/slots", "/metrics", "/admin/identity"):
            assert (
                c.get(url + path, headers={"Authorization": f"Bearer {d.inference_key}"}).status_code == 403
            )
            assert c.get(url + path, headers={"Authorization": f"Bearer {d.admin_key}"}).status_code == 200
        # /props: the machine-revealing fields for admin keys only (docs/api.md).
        props = c.get(url + "/props", headers={"Authorization": f"Bearer {d.inference_key}"}).json()
        assert props["total_slots"] == 2 and "model_path" not in props and "build_info" not in props
        props = c.get(url + "/props", headers={"Authorization": f"Bearer {d.admin_key}"}).json()
        assert props["model_path"] and props["build_info"]
        tok = c.post(
            url + "/tokenize",
            json={"content": "hello world"},
            headers={"Authorization": f"Bearer {d.admin_key}"},
        )
        assert tok.status_code == 200 and len(tok.json()["tokens"]) >= 2

        # Revoke the inference key: drop it from the config and reload.
        d.write_config({"keys": [k for k in d.config["keys"] if k["id"] != d.inference_key[3:15]]})
        d.signal(signal.SIGHUP)
        wait_until(
            lambda: post({"Authorization": f"Bearer {d.inference_key}"}).status_code == 401, "revocation"
        )
        assert post({"Authorization": f"Bearer {d.admin_key}"}).status_code == 200

    client = OpenAI(base_url=url + "/v1", api_key=d.inference_key, max_retries=0)
    with pytest.raises(AuthenticationError):
        client.models.list()
    admin = OpenAI(base_url=url + "/v1", api_key=d.admin_key, max_retries=0)
    assert admin.models.list().data[0].id == MODEL


def test_documented_statuses_and_clean_logs(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"proxy": {"max_body_bytes": 40000}})
    auth = {"Authorization": f"Bearer {d.inference_key}"}
    with httpx.Client(base_url=d.base_url, timeout=60, trust_env=False, headers=auth) as c:

        def error(r: httpx.Response, status: int) -> dict[str, object]:
            assert r.status_code == status, r.text
            assert r.headers.get("x-request-id")
            err: dict[str, object] = r.json()["error"]
            assert {"message", "type", "code"} <= set(err)
            return err

        error(c.post("/v1/chat/completions", content=b"{oops"), 400)
        error(c.post("/v1/chat/completions", content=b"[]"), 400)
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 50000}]})
        error(c.post("/v1/chat/completions", content=big), 413)
        assert (
            error(c.post("/v1/chat/completions", json={"model": "gpt-9", "messages": []}), 404)["code"]
            == "model_not_found"
        )
        error(c.get("/v1/nothing-here"), 404)
        error(c.get("/v1/chat/completions"), 405)
        ok = c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
            headers={"X-Conversation-Id": "resume-me"},
        )
        assert ok.status_code == 200
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 4,
                "stream": True,
            },
        ) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        # The child's own refusal passes through with its status and body.
        huge = {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 1}
        r = c.post("/v1/completions", json=huge)
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
        # llama.cpp's own test_context_size_exceeded (and its stream twin), through the proxy: the chat
        # that cannot fit is answered 400 with the child's figures, streamed or not (llamagate asks the
        # child for a stream either way), not left waiting.
        book = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={"messages": book * 400, "stream": stream})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "exceed_context_size_error" and error["n_prompt_tokens"] > error["n_ctx"]

    client = OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0)
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(PermissionDeniedError):
        OpenAI(base_url=d.base_url, api_key=d.inference_key, max_retries=0).get("/slots", cast_to=object)

    access = [r for r in d.log_records() if r.get("logger") == "llamagate.access"]
    assert any(r.get("outcome") == "rejected:payload_too_large" for r in access)
    assert any(
        r.get("route") == "/v1/chat/completions" and r.get("status") == 200 and r.get("ttft_ms")
        for r in access
    )
    text = d.log_text()
    assert PROMPT not in text and "ZEBRA" not in text
    for key in (d.inference_key, d.admin_key):
        assert key not in text and key[16:] not in text


def test_prompt_size_checked_with_the_childs_tokenizer_before_a_slot(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(
        {
            "llama": {"ctx_per_slot": 512},
            "tenants": [{"name": "default", "max_concurrency": 2, "max_queue": 8, "check_prompt_size": True}],
        }
    )
    auth = {"Authorization": f"Bearer {d.inference_key}"}
    with httpx.Client(base_url=d.base_url, timeout=120, trust_env=False, headers=auth) as c:
        long_chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "word " * 700}],
            "max_tokens": 4,
        }
        r = c.post("/v1/chat/completions", json=long_chat)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "exceed_context_size_error" and error["code"] == 400
        assert error["n_ctx"] == 512 and error["n_prompt_tokens"] >= 700
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 700, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["n_prompt_tokens"] >= 700
        ok = c.post(
            "/v1/chat/completions", json={**long_chat, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert ok.status_code == 200
    outcomes = [r.get("outcome") for r in d.log_records() if r.get("logger") == "llamagate.access"]
    assert outcomes.count("rejected:context_size") == 2  # refused by the proxy, not by the child


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def test_embeddings_through_the_daemon_when_the_child_serves_them(daemon_factory: DaemonFactory) -> None:
    # The demo model is generative: llama-server's OpenAI route needs a pooling type for it (without one
    # it answers 400 "Pooling type 'none' is not OAI compatible").
    d = daemon_factory({"llama": {"embeddings": True, "extra_args": ["--pooling", "mean"]}})
    with OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key, max_retries=0) as client:
        answer = client.embeddings.create(model=MODEL, input=["a lighthouse", "a lighthouse", "tax law"])
    vectors = [item.embedding for item in answer.data]
    assert [item.index for item in answer.data] == [0, 1, 2]
    assert len(vectors[0]) == 576  # the demo model's embedding length (llama.embedding_length)
    # Computed from each input (batched numerics make equal inputs close, not bit-identical).
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
    # Admitted like the other inference routes: the permit is back once answered.
    wait_until(lambda: d.readyz()[1]["in_flight"] == 0, "the embeddings permit released")
