"""The routes of issue 13 through a real uvicorn port in front of the fake child: /health, /props,
counting, CORS, the Anthropic route's credentials and errors, refused routes, feature-gated routes, and
metric labels. Streams of each format against the real child are in
tests/integration/test_api_routes_e2e.py."""

from __future__ import annotations

import dataclasses
import json

import httpx

from proxy.settings import CorsSettings, TenantSettings
from tests.unit.proxy.conftest import ProxyFactory

CHAT = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
MESSAGES = {"model": "gemma-3-270m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


async def test_health_answers_as_llama_server_from_readiness(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client(None) as c:
        for path in ("/health", "/v1/health"):
            r = await c.get(path)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        p.source.update(ready=False, state="STARTING", reason="loading model", retry_after_s=4)
        r = await c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "4"
        assert r.json() == {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
        p.source.update(state="READY", reason="draining")  # ready=False still: a draining daemon
        r = await c.get("/v1/health")
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]


async def test_props_hides_machine_fields_from_inference_keys(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.get("/props")  # the fake answers {"total_slots": 4, "build_info": "fake"}
        assert r.status_code == 200 and r.json() == {"total_slots": 4}
        r = await c.get("/props", headers={"authorization": f"Bearer {p.keys['admin']}"})
        assert r.json() == {"total_slots": 4, "build_info": "fake"}
        assert (await c.get("/props", headers={"authorization": "Bearer nope"})).status_code == 401


async def test_counting_routes_take_no_slot_and_are_rate_bounded_per_tenant(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory(count_rate_per_s=0.01, count_burst=2) as p, p.client() as c:
        body = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "a b c"}]}
        r = await c.post("/v1/chat/completions/input_tokens", json=body)
        assert r.status_code == 200 and r.json() == {"input_tokens": 11}
        assert (await c.post("/tokenize", json={"content": "a b"})).json() == {"tokens": [0, 1]}
        assert p.lane.gate.in_flight == 0
        r = await c.post("/tokenize", json={"content": "a b"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        # Another tenant has its own bucket; a wrong model is refused like on the generation routes.
        other = {"authorization": f"Bearer {p.keys['other']}"}
        r = await c.post("/tokenize", json={"content": "x", "model": "nope"}, headers=other)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (await c.post("/tokenize", json={"content": "x"}, headers=other)).status_code == 200


def requests_counted(exposition: bytes) -> list[bytes]:
    return [line for line in exposition.splitlines() if line.startswith(b"llamagate_requests_total")]


async def test_cors_is_off_by_default(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        origin = {"origin": "https://app.example"}
        r = await c.options(
            "/v1/chat/completions", headers={**origin, "access-control-request-method": "POST"}
        )
        assert r.status_code == 405
        assert not [h for h in r.headers if h.startswith("access-control-")]
        r = await c.post("/v1/chat/completions", json=CHAT, headers=origin)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_cors_preflight_before_auth_and_allow_origin_on_answers(proxy_factory: ProxyFactory) -> None:
    cors = CorsSettings(allowed_origins=("https://app.example",))
    async with proxy_factory(cors=cors) as p, p.client(None) as c:
        ok, other = {"origin": "https://app.example"}, {"origin": "https://evil.example"}
        pre = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
        counted = requests_counted(p.state.metrics.render())
        r = await c.options("/v1/chat/completions", headers={**ok, **pre})  # no key at all
        assert r.status_code == 200
        assert requests_counted(p.state.metrics.render()) == counted  # a preflight is not a request
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"]
        assert "access-control-allow-credentials" not in r.headers
        r = await c.options("/v1/chat/completions", headers={**other, **pre})
        assert r.status_code == 405 and not [h for h in r.headers if h.startswith("access-control-")]
        # Real answers: errors and streams too, for the allowed origin only.
        r = await c.post("/v1/chat/completions", json=CHAT, headers=ok)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        key = {"authorization": f"Bearer {p.keys['user']}"}
        async with c.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers={**ok, **key}
        ) as s:
            assert s.status_code == 200 and s.headers["access-control-allow-origin"] == "https://app.example"
            assert [line async for line in s.aiter_lines() if line][-1] == "data: [DONE]"
        r = await c.post("/v1/chat/completions", json=CHAT, headers={**other, **key})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        # "*" answers "*" and never with credentials; "*" headers echo what the preflight asks for.
        anything = CorsSettings(allowed_origins=("*",), allowed_headers=("*",))
        p.state.reload(dataclasses.replace(p.settings, cors=anything))
        asks = {"access-control-request-method": "GET", "access-control-request-headers": "x-stainless-os"}
        r = await c.options("/v1/models", headers={**other, **asks})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert r.headers["access-control-allow-headers"] == "x-stainless-os"
        assert "access-control-allow-credentials" not in r.headers


async def test_messages_route_takes_x_api_key_and_answers_anthropic_errors(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory() as p, p.client(None) as c:
        r = await c.post("/v1/messages", json=MESSAGES)
        assert r.status_code == 401 and r.headers.get("x-request-id")
        assert r.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": r.json()["error"]["message"]},
        }
        # The key in x-api-key reaches the child (the fake has no /v1/messages: its 404, Anthropic-shaped).
        r = await c.post("/v1/messages", json=MESSAGES, headers={"x-api-key": p.keys["user"]})
        assert r.status_code == 404 and r.json()["type"] == "error"
        assert r.json()["error"] == {"type": "not_found_error", "message": "File Not Found"}
        assert p.fake.last_headers["authorization"] != f"Bearer {p.keys['user']}"  # the per-boot secret
        r = await c.post("/v1/messages/count_tokens", json=MESSAGES, headers={"x-api-key": "lg_bad"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        # Authorization wins over x-api-key when both are sent.
        both = {"authorization": "Bearer lg_000000000000_" + "A" * 43, "x-api-key": p.keys["user"]}
        assert (await c.post("/v1/messages", json=MESSAGES, headers=both)).status_code == 401
        # x-api-key means nothing on the OpenAI routes.
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": p.keys["user"]})
        assert r.status_code == 401 and "error" in r.json() and "type" in r.json()["error"]
        p.source.update(ready=False, state="BACKOFF", reason="child exited", retry_after_s=3)
        r = await c.post("/v1/messages", json=MESSAGES, headers={"x-api-key": p.keys["user"]})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["type"] == "overloaded_error"


async def test_sdk_placeholder_key_is_the_anonymous_tenant_from_loopback(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(anonymous_tenant="team") as p, p.client(None) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-no-key"})
        assert r.status_code == 200
        r = await c.post("/v1/messages/count_tokens", json=MESSAGES, headers={"x-api-key": "placeholder"})
        assert r.status_code == 404  # reached the child (the fake has no such route), not a 401
        bad = {"authorization": "Bearer lg_0123456789ab_tooshort"}
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=bad)).status_code == 401


async def test_refused_routes_say_why(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/chat/completions/control", json={"id": "x", "action": "reasoning_end"})
        assert r.status_code == 404 and "not served through llamagate" in r.json()["error"]["message"]
        r = await c.get("/cors-proxy")
        assert r.status_code == 404 and "forgery" in r.json()["error"]["message"]
        r = await c.post("/props", json={})
        assert r.status_code == 405 and r.headers["allow"] == "GET"
        assert (await c.post("/slots/0?action=erase", json={})).status_code == 404
        assert p.fake.requests == 0


async def test_feature_routes_only_when_the_child_serves_them(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        for path in ("/v1/rerank", "/rerank", "/embeddings", "/v1/embeddings"):
            r = await c.post(path, json={"query": "q", "documents": ["a"], "input": "x"})
            assert r.status_code == 404 and "is not enabled" in r.json()["error"]["message"], path
        p.source.update(reranking=True)
        r = await c.post("/v1/rerank", json={"query": "q", "documents": ["a"]})
        assert r.status_code == 404 and r.json()["error"]["message"] == "File Not Found"  # the fake's own


async def test_every_route_is_labeled_by_its_own_path(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        await c.post("/v1/messages", json=MESSAGES, headers={"x-api-key": p.keys["user"]})
        await c.post("/completion", json={"prompt": "p", "n_predict": 2})
        await c.post("/tokenize", json={"content": "a"})
        await c.get("/health")
        admin = httpx.Headers({"authorization": f"Bearer {p.keys['admin']}"})
        text = (await c.get("/metrics", headers=admin)).text
        for route in ("/v1/messages", "/completion", "/tokenize", "/health"):
            assert f'route="{route}"' in text, route


async def test_generation_routes_are_token_capped_and_model_checked(proxy_factory: ProxyFactory) -> None:
    """The tenant's max_tokens reaches every generation dialect's own field (or max_tokens, which
    llama-server reads on all of them), and a model the server does not serve is refused before a slot."""
    tenants = (TenantSettings("team", max_concurrency=4, max_queue=8, max_tokens=5),)
    async with proxy_factory(tenants=tenants) as p, p.client() as c:
        cases = [
            ("/v1/responses", {"input": "x", "max_output_tokens": 500}, "max_output_tokens"),
            ("/responses", {"input": "x"}, "max_tokens"),
            ("/v1/messages", {"messages": [], "max_tokens": 500}, "max_tokens"),
            ("/completion", {"prompt": "x", "n_predict": 500}, "n_predict"),
            ("/infill", {"input_prefix": "a", "input_suffix": "b"}, "max_tokens"),
        ]
        for route, body, field in cases:
            headers = {"x-api-key": p.keys["user"]} if route == "/v1/messages" else {}
            await c.post(route, json=body, headers=headers)
            assert json.loads(p.fake.last_body)[field] == 5, route
            r = await c.post(route, json={**body, "model": "other-model"}, headers=headers)
            assert r.status_code == 404, route
