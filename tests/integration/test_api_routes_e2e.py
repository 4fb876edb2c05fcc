"""Issue 13's routes through the real daemon, the real llama-server and the demo model, each with the
official client where one exists: the openai SDK's Responses API, the anthropic SDK's Messages API,
llama-server's native /completion, token counting, unversioned paths, CORS, /health; then, for every
streaming format, admission (429 + Retry-After over capacity), a leaving client freeing its slot, and
time to first token observed in /metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.integration.conftest import Daemon, DaemonFactory, wait_until

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PROMPT = "QUOKKA-PROMPT-5521 tell a story"
ORIGIN = "https://app.example"


def ttft_count(d: Daemon) -> float:
    r = httpx.get(
        d.base_url + "/metrics",
        headers={"Authorization": f"Bearer {d.admin_key}"},
        timeout=30,
        trust_env=False,
    )
    r.raise_for_status()
    m = re.search(
        r'^llamagate_time_to_first_token_seconds_count\{model="[^"-][^"]*",tenant="default"\} (\S+)$',
        r.text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def test_official_clients_on_every_new_route(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(
        {
            "proxy": {"cors": {"allowed_origins": [ORIGIN]}, "anonymous_tenant": "default"},
            "tenants": [{"name": "default", "max_concurrency": 2, "max_queue": 8, "check_prompt_size": True}],
        }
    )
    with ExitStack() as clients:
        _official_clients(d, clients)


def _official_clients(d: Daemon, clients: ExitStack) -> None:
    # Every client is closed at the end: a socket left to the garbage collector fails the test run.
    v1 = d.base_url + "/v1"
    openai = clients.enter_context(OpenAI(base_url=v1, api_key=d.inference_key, max_retries=0))

    # OpenAI Responses, plain and streamed.
    before = ttft_count(d)
    reply = openai.responses.create(model=MODEL, input=PROMPT, max_output_tokens=8)
    assert reply.output_text and reply.usage is not None and 0 < reply.usage.output_tokens <= 8
    events = list(openai.responses.create(model=MODEL, input=PROMPT, max_output_tokens=8, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.completed"]
    assert text and len(done) == 1 and done[0].response.usage is not None
    assert 0 < done[0].response.usage.output_tokens <= 8
    assert ttft_count(d) == before + 1  # the streamed one

    # Anthropic Messages with Anthropic's client: base_url at llamagate, the key as its api_key.
    claude = clients.enter_context(
        anthropic.Anthropic(base_url=d.base_url, api_key=d.inference_key, max_retries=0)
    )
    message = claude.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": PROMPT}]
    )
    assert message.content and message.content[0].type == "text" and message.content[0].text
    assert 0 < message.usage.output_tokens <= 8
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": PROMPT}]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed and 0 < final.usage.output_tokens <= 8
    assert ttft_count(d) == before + 2
    raw_stream = claude.messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": PROMPT}], stream=True
    )
    kinds = [event.type for event in raw_stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index, call-overload]
    count = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": PROMPT}])
    assert count.input_tokens > 5

    auth = {"Authorization": f"Bearer {d.inference_key}"}
    with httpx.Client(base_url=d.base_url, timeout=120, trust_env=False, headers=auth) as c:
        # llama-server's native completion, with n_probs: a slot taken, probabilities returned.
        r = c.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "n_probs": 2})
        assert r.status_code == 200, r.text
        probs = r.json()["completion_probabilities"]
        assert len(probs) == 3 and len(probs[0]["top_logprobs"]) == 2
        with c.stream(
            "POST", "/completion", json={"prompt": PROMPT, "n_predict": 3, "n_probs": 1, "stream": True}
        ) as s:
            assert s.status_code == 200
            native = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        assert native[-1]["stop"] is True and any(e["content"] for e in native)
        assert ttft_count(d) == before + 4

        # check_prompt_size counts Responses and Messages prompts with the child's own counting routes.
        huge = "word " * 5000
        r = c.post("/v1/responses", json={"model": MODEL, "input": huge, "max_output_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
        assert r.json()["error"]["n_prompt_tokens"] >= 5000
        r = c.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": huge}]},
        )
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"

        # /infill on a model without fill-in-the-middle tokens: the door says so (404, as a route the model
        # lacks), where the child would answer 501 (issue 54; its gate read the FIM tokens at load).
        r = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):", "n_predict": 3})
        assert r.status_code == 404 and "fill-in-the-middle" in r.json()["error"]["message"]

        # Counting without a slot, for an inference key.
        chat_body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
        r = c.post("/v1/chat/completions/input_tokens", json=chat_body)
        assert r.status_code == 200 and r.json()["input_tokens"] > 5
        r = c.post("/v1/responses/input_tokens", json={"model": MODEL, "input": PROMPT})
        assert r.status_code == 200 and r.json()["input_tokens"] > 5
        r = c.post("/tokenize", json={"content": "hello world"})
        assert r.status_code == 200 and len(r.json()["tokens"]) >= 2
        r = c.post("/apply-template", json=chat_body)
        assert r.status_code == 200 and PROMPT in r.json()["prompt"]
        props = c.get("/props").json()
        assert props["model_alias"] == MODEL and "model_path" not in props and "build_info" not in props

        # /health as llama-server answers it; CORS from an allowed origin and from another one.
        h = httpx.get(d.base_url + "/health", timeout=30, trust_env=False)
        assert h.status_code == 200 and h.json() == {"status": "ok"}
        preflight = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        r = httpx.options(
            d.base_url + "/v1/chat/completions", headers={"Origin": ORIGIN, **preflight}, trust_env=False
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        r = httpx.options(
            d.base_url + "/v1/chat/completions",
            headers={"Origin": "https://elsewhere.example", **preflight},
            trust_env=False,
        )
        assert not [h for h in r.headers if h.lower().startswith("access-control-")]
        r = c.post("/v1/chat/completions", json={**chat_body, "max_tokens": 2}, headers={"Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN

    # A client configured without /v1 uses the unversioned paths.
    bare = clients.enter_context(OpenAI(base_url=d.base_url, api_key=d.inference_key, max_retries=0))
    chat = bare.chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": PROMPT}]
    )
    assert chat.choices[0].message.content and [m.id for m in bare.models.list()] == [MODEL]
    assert bare.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4).output_text

    # Anonymous mode: the SDKs' placeholder key from loopback is the anonymous tenant.
    placeholder = clients.enter_context(
        OpenAI(base_url=d.base_url + "/v1", api_key="sk-no-key-required", max_retries=0)
    )
    assert placeholder.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2).output_text
    r = httpx.post(
        d.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        headers={"Authorization": "Bearer lg_0123456789ab_malformed"},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 401

    # A chat stream with OpenAI's client, which closes the connection as soon as it has [DONE]: the
    # client had the whole answer, the access log says "ok" (not "client_gone").
    rid = "e2e-chat-stream"
    chunks = list(
        openai.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            extra_headers={"X-Request-ID": rid},
        )
    )
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in chunks)

    def line_of(request_id: str) -> list[dict[str, Any]]:
        return [r for r in d.log_records() if r.get("request_id") == request_id]

    wait_until(lambda: bool(line_of(rid)), "the chat stream's access-log line")
    assert [(r.get("status"), r.get("outcome")) for r in line_of(rid)] == [(200, "ok")]

    access = [r for r in d.log_records() if r.get("logger") == "llamagate.access"]
    # Every client here read its answer to the stream's last event: none of them left early.
    assert [r.get("route") for r in access if r.get("outcome") == "client_gone"] == []
    routes = {r.get("route") for r in access}
    assert {"/v1/responses", "/v1/messages", "/completion", "/chat/completions", "/tokenize"} <= routes
    assert {"/v1/messages/count_tokens", "/v1/chat/completions/input_tokens", "/responses"} <= routes
    for route in ("/v1/messages", "/v1/responses", "/completion"):  # streamed and measured
        assert any(r.get("ttft_ms") and r.get("tokens") for r in access if r.get("route") == route), route
    assert [r.get("route") for r in access if r.get("outcome") == "rejected:context_size"] == [
        "/v1/responses",
        "/v1/messages",
    ]  # refused by the proxy before a slot, not by the child
    text = d.log_text()
    assert "QUOKKA" not in text and d.inference_key not in text


# A prompt long enough that the child is still busy with it (a second or more) while the test checks
# admission and then leaves, and a base model (Gemma 3 270M) that keeps generating after it: an instruct
# model may end its answer at once, and the Anthropic and Responses routes do not pass ignore_eos on. One
# batch (under 2,048 tokens): the child finishes a batch before it can notice the client left, and 2,500
# words cost 66 s of the suite.
LONG = "word " * 600


def _user(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _responses(prompt: str, n: int) -> dict[str, Any]:
    return {"model": MODEL, "input": prompt, "max_output_tokens": n, "stream": True}


def _messages(prompt: str, n: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": n, "messages": _user(prompt), "stream": True}


def _completion(prompt: str, n: int) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": n, "stream": True}


def _chat(prompt: str, n: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": n, "messages": _user(prompt), "stream": True}


# (route, request body, bytes that only a token event of its stream carries)
STREAMS: list[tuple[str, Callable[[str, int], dict[str, Any]], bytes]] = [
    ("/v1/responses", _responses, b"response.output_text.delta"),
    ("/v1/messages", _messages, b"content_block_delta"),
    ("/completion", _completion, b'"content":"'),
    ("/chat/completions", _chat, b'"content":"'),
]


def test_every_streaming_format_is_admitted_measured_and_freed(
    daemon_factory: DaemonFactory, gemma_model: Path
) -> None:
    from supervisor.artifacts.demo_model import GEMMA

    gemma = {"path": str(gemma_model), "sha256": GEMMA.sha256, "alias": MODEL}  # served under MODEL
    d = daemon_factory(
        {
            "llama": {"model": gemma},
            "tenants": [{"name": "default", "max_concurrency": 1, "max_queue": 0, "queue_timeout_s": 5}],
        }
    )
    auth = {"Authorization": f"Bearer {d.inference_key}"}
    admin = {"Authorization": f"Bearer {d.admin_key}"}
    with httpx.Client(base_url=d.base_url, timeout=300, trust_env=False, headers=auth) as c:

        def busy_slots() -> int:
            return sum(1 for s in c.get("/slots", headers=admin).json() if s["is_processing"])

        def proxy_idle() -> bool:
            code, body = d.readyz()
            return code == 200 and body["in_flight"] == 0 and body["queued"] == 0

        for route, body, token_marker in STREAMS:
            # The 200 goes out when a slot starts the prompt: from here the tenant's one permit is taken.
            # Its own prompt per route: a prefix cached from the previous route would be skipped.
            with c.stream("POST", route, json=body(f"{route} {LONG}", 2000)) as held:
                assert held.status_code == 200, route
                assert busy_slots() == 1, route  # the child is working on it
                # The tenant's queue holds none: refused at once, with Retry-After, in the route's shape.
                r = c.post(route, json=body(PROMPT, 2))
                assert r.status_code == 429, (route, r.text)
                assert int(r.headers["retry-after"]) >= 1
                shape = r.json()
                if route == "/v1/messages":
                    assert shape["type"] == "error" and shape["error"]["type"] == "rate_limit_error"
                else:
                    assert shape["error"]["type"] == "rate_limit_error"
                assert busy_slots() == 1, route  # still working on the first one when its client leaves
            # The client left: the proxy's permit and the child's slot are both freed.
            wait_until(proxy_idle, f"{route}: permit released", timeout=120)
            wait_until(lambda: busy_slots() == 0, f"{route}: child slot freed", timeout=120)
            before = ttft_count(d)
            rid = "ttft-" + route.strip("/").replace("/", "-")
            with c.stream("POST", route, json=body(PROMPT, 4), headers={"X-Request-ID": rid}) as again:
                assert again.status_code == 200, route
                assert token_marker in b"".join(again.iter_raw()), route
            assert ttft_count(d) == before + 1, route
            wait_until(
                lambda rid=rid: any(r.get("request_id") == rid for r in d.log_records()),
                f"{route}: access log",
            )
            record = next(r for r in d.log_records() if r.get("request_id") == rid)
            assert record["route"] == route and record["ttft_ms"] and record["tokens"] >= 1, record
