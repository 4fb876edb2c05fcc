"""Routes, statuses, headers and error shapes, through a real uvicorn port in front of the fake child."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.unit.proxy.conftest import SECRET, ProxyFactory
from tests.unit.proxy.raw_upstream import RawRequest
from tests.unit.proxy.test_app_upstream_faults import DEADLINE_S, proxy_on

CHAT = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def assert_error_shape(
    response: httpx.Response, status: int, code: str | int | None = None
) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    if code is not None:
        assert error["code"] == code
    return dict(error)


async def test_probes_need_no_credentials_and_say_nothing_secret(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot={"info": {"uptime_s": 12.5, "restarts": 1}}) as p, p.client(None) as c:
        r = await c.get("/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = await c.get("/readyz")
        assert r.status_code == 200
        body = r.json()
        assert body["ready"] is True and body["state"] == "READY" and body["restarts"] == 1
        assert SECRET not in r.text and str(p.fake.port) not in r.text
        p.source.update(ready=False, state="BACKOFF", reason="child exited with signal 9", retry_after_s=3.2)
        r = await c.get("/readyz")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "4"
        assert r.json()["reason"] == "child exited with signal 9" and r.json()["state"] == "BACKOFF"
        assert SECRET not in r.text


async def test_not_ready_answers_503_with_retry_after(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        p.source.update(ready=False, state="STARTING", reason="loading model", retry_after_s=7)
        r = await c.post("/v1/chat/completions", json=CHAT)
        error = assert_error_shape(r, 503, "not_ready")
        assert "loading model" in str(error["message"])
        assert r.headers["retry-after"] == "7"
        assert p.fake.requests == 0


async def test_failed_promises_no_retry_but_says_how_to_recover(proxy_factory: ProxyFactory) -> None:
    # FAILED retries nothing by itself: no Retry-After and no retry_after_s that would promise one.
    async with proxy_factory() as p, p.client() as c:
        recovery = "fix the cause, then send SIGHUP"
        p.source.update(
            ready=False, state="FAILED", reason="gave up", retry_after_s=None, info={"recovery": recovery}
        )
        r = await c.get("/readyz")
        assert r.status_code == 503 and "retry-after" not in r.headers
        assert "retry_after_s" not in r.json() and r.json()["recovery"] == recovery
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert_error_shape(r, 503, "not_ready")
        assert "retry-after" not in r.headers


async def test_chat_and_completions_pass_through(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "tok tok tok tok"
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "tok tok"
        r = await c.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "gemma-3-270m"


def sse_events(n_tokens: int) -> list[bytes]:
    """llama-server's chat stream: the role, n content deltas, the finish, the usage, [DONE]."""
    tail = ',"created":1,"id":"chatcmpl-x","model":"gemma-3-270m","object":"chat.completion.chunk"'
    role = '{"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]' + tail + "}"
    token = '{"choices":[{"index":0,"delta":{"content":"tok "}}]' + tail + "}"
    finish = '{"choices":[{"index":0,"finish_reason":"length","delta":{}}]' + tail + "}"
    counts = f'"completion_tokens":{n_tokens},"prompt_tokens":8,"total_tokens":{n_tokens + 8}'
    usage = '{"choices":[],"usage":{' + counts + "}" + tail + "}"
    data = [role, *[token] * n_tokens, finish, usage, "[DONE]"]
    return [f"data: {d}\n\n".encode() for d in data]


async def test_stream_is_relayed_event_by_event_with_done_and_usage() -> None:
    # Lockstep: the upstream sends event k+1 only once the client has read event k. A proxy that
    # buffers (the whole stream, or just more than one event) never lets the client see event k, so the
    # upstream never sends the rest: the deadline below fails the test instead of a late pass.
    events = sse_events(6)
    seen = [asyncio.Event() for _ in events]

    async def lockstep(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for k, event in enumerate(events):
            request.writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await request.writer.drain()
            if k + 1 < len(events):
                await seen[k].wait()
        request.writer.write(b"0\r\n\r\n")
        return True

    body = {**CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    async with proxy_on(lockstep) as (c, _):
        lines: list[str] = []
        async with asyncio.timeout(DEADLINE_S), c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream"
            assert r.headers.get("x-request-id")
            async for line in r.aiter_lines():
                if line:
                    seen[len(lines)].set()
                    lines.append(line)
    assert [f"{line}\n\n".encode() for line in lines] == events  # each one, whole and in order
    assert lines[-1] == "data: [DONE]"
    parsed = [json.loads(line[6:]) for line in lines[:-1]]
    assert sum(1 for e in parsed if e["choices"] and e["choices"][0]["delta"].get("content")) == 6
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] == 6


async def test_stream_through_the_fake_child_ends_with_done_and_usage(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        body = {**CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content")) == 6
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


async def test_request_id_kept_when_well_formed_replaced_otherwise_and_forwarded(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "client-abc.123"})
        assert r.headers["x-request-id"] == "client-abc.123"
        assert p.fake.last_headers["x-request-id"] == "client-abc.123"
        for bad in ("x" * 200, "has space", "semi;colon"):
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": bad})
            assert r.headers["x-request-id"] != bad
            assert p.fake.last_headers["x-request-id"] == r.headers["x-request-id"]
        r = await c.get("/nope", headers={"x-request-id": "err-1"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "err-1"


async def test_client_credentials_and_conversation_id_never_reach_the_child(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"x-conversation-id": "resume-me"})
        assert r.status_code == 200
        assert p.fake.last_headers["authorization"] == f"Bearer {SECRET}"
        assert "x-conversation-id" not in p.fake.last_headers
        assert p.keys["user"] not in json.dumps(p.fake.last_headers)


async def test_auth_matrix(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client(None) as c:
        user, admin, admin_only = p.keys["user"], p.keys["admin"], p.keys["admin_only"]
        cases = [
            ({}, 401),
            ({"authorization": f"Basic {user}"}, 401),
            ({"authorization": "Bearer lg_000000000000_" + "A" * 43}, 401),
            ({"authorization": "Bearer"}, 401),
            ({"authorization": f"Bearer {user}"}, 200),
            ({"authorization": f"Bearer {admin_only}"}, 403),
        ]
        for headers, status in cases:
            r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == status, (headers, r.text)
            if status == 401:
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert_error_shape(r, 401)
        for method, path in (
            ("GET", "/slots"),
            ("GET", "/metrics"),
            ("GET", "/admin/identity"),
        ):
            r = await c.request(method, path, headers={"authorization": f"Bearer {user}"})
            assert_error_shape(r, 403)
            r = await c.request(method, path, headers={"authorization": f"Bearer {admin}"})
            assert r.status_code == 200, (path, r.text)
            r = await c.request(method, path)
            assert r.status_code == 401
        # Counting needs no slot: any key may count (docs/api.md); a stranger may not.
        r = await c.post("/tokenize", json={"content": "a b c"}, headers={"authorization": f"Bearer {user}"})
        assert r.status_code == 200 and r.json() == {"tokens": [0, 1, 2]}
        assert (await c.post("/tokenize", json={"content": "a"})).status_code == 401
        r = await c.post("/tokenize", json={"content": "a b c"}, headers={"authorization": f"Bearer {admin}"})
        assert r.status_code == 200 and r.json() == {"tokens": [0, 1, 2]}


async def test_revoked_key_is_refused_after_reload(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        import dataclasses

        p.state.reload(dataclasses.replace(p.settings, keys=(p.entries["admin"],)))
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert_error_shape(r, 401)


async def test_identity_for_admins(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client("admin") as c:
        r = await c.get("/admin/identity")
        assert r.status_code == 200 and r.json()["llama_cpp_commit"] == "0c1e570"


async def test_unknown_route_and_wrong_method(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        assert_error_shape(await c.post("/v2/responses", json={}), 404, "not_found")
        assert_error_shape(await c.get("/no-such-route"), 404, "not_found")
        r = await c.get("/v1/chat/completions")
        assert_error_shape(r, 405, "method_not_allowed")
        assert "POST" in r.headers["allow"]


async def test_embeddings_route_only_when_the_child_serves_them(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/embeddings", json={"input": "x"})
        assert_error_shape(r, 404)


async def test_embeddings_are_forwarded_to_the_child_and_answered_whole() -> None:
    answer = json.dumps(
        {
            "object": "list",
            "model": "gemma-3-270m",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5, 1.0]}],
            "usage": {"prompt_tokens": 2, "total_tokens": 2},
        }
    ).encode()
    seen: list[tuple[RawRequest, bytes]] = []
    release = asyncio.Event()

    async def child(request: RawRequest) -> bool:
        seen.append((request, await request.body()))
        await release.wait()  # holds its slot until the test has looked at the admission gauges
        request.writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(answer), answer)
        )
        return True

    # "stream" and "max_tokens" mean nothing to embeddings: the body goes through untouched, whole.
    raw = b'{"model":"gemma-3-270m","input":["hello world"],"encoding_format":"float","stream":true}'
    async with proxy_on(child, snapshot={"embeddings": True}) as (c, _):
        pending = asyncio.ensure_future(
            c.post("/v1/embeddings", content=raw, headers={"content-type": "application/json"})
        )
        async with asyncio.timeout(DEADLINE_S):  # admitted like any inference request: it holds a permit
            while (await c.get("/readyz")).json()["in_flight"] != 1:  # noqa: ASYNC110 - polled over HTTP
                await asyncio.sleep(0.01)
        release.set()
        r = await pending
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.content == answer
        request, body = seen[0]
        assert (request.method, request.target, body) == ("POST", "/v1/embeddings", raw)
        assert request.headers["authorization"] == f"Bearer {SECRET}"  # the per-boot secret, not the key
        assert request.headers["x-request-id"] == r.headers["x-request-id"]
        readyz = (await c.get("/readyz")).json()
        assert (readyz["in_flight"], readyz["queued"]) == (0, 0)
        assert len(seen) == 1


@pytest.mark.parametrize(
    ("raw", "status"),
    [(b"{not json", 400), (b"[1, 2]", 400), (b"", 400), (b'"str"', 400), (b"\xff\xfe\x00", 400)],
)
async def test_bad_json_is_400_not_the_childs_500(
    proxy_factory: ProxyFactory, raw: bytes, status: int
) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error_shape(r, status)
        assert p.fake.requests == 0


async def test_body_limit_by_declared_length_and_by_counted_bytes(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(max_body_bytes=1000) as p, p.client() as c:
        big = json.dumps({**CHAT, "pad": "x" * 2000}).encode()
        assert_error_shape(await c.post("/v1/chat/completions", content=big), 413, "payload_too_large")

        async def chunked():  # type: ignore[no-untyped-def]
            for i in range(0, len(big), 100):
                yield big[i : i + 100]

        r = await c.post("/v1/chat/completions", content=chunked())
        assert_error_shape(r, 413, "payload_too_large")
        assert p.fake.requests == 0


async def test_unknown_model_is_404_and_an_alias_is_rewritten(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        error = assert_error_shape(await c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-5"}), 404)
        assert error["code"] == "model_not_found"
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o-mini"})
        assert r.status_code == 200
        assert json.loads(p.fake.last_body)["model"] == "gemma-3-270m"


async def test_child_errors_pass_through_with_status_and_body(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "fake_status": 400})
        assert r.status_code == 400
        assert r.json() == {"error": {"code": 400, "message": "fake error", "type": "invalid_request_error"}}
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "fake_status": 500})
        assert r.status_code == 500 and r.json()["error"]["type"] == "invalid_request_error"


async def test_tenant_token_cap(proxy_factory: ProxyFactory) -> None:
    from proxy.settings import TenantSettings

    tenants = (TenantSettings("team", max_tokens=3), TenantSettings("ops"), TenantSettings("other"))
    async with proxy_factory(tenants=tenants) as p, p.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
        assert r.json()["usage"]["completion_tokens"] == 3
        r = await c.post("/v1/chat/completions", json={"messages": CHAT["messages"]})
        assert json.loads(p.fake.last_body)["max_tokens"] == 3


async def test_prompt_too_large_is_refused_before_taking_a_slot(proxy_factory: ProxyFactory) -> None:
    from proxy.settings import TenantSettings

    tenants = (TenantSettings("team", check_prompt_size=True), TenantSettings("ops"), TenantSettings("other"))
    async with proxy_factory(tenants=tenants, snapshot={"ctx_per_slot": 32}) as p, p.client() as c:
        long_chat = {"messages": [{"role": "user", "content": "word " * 40}]}
        r = await c.post("/v1/chat/completions", json=long_chat)
        error = assert_error_shape(r, 400, 400)
        assert error["type"] == "exceed_context_size_error"
        assert error["n_prompt_tokens"] == 48 and error["n_ctx"] == 32
        r = await c.post("/v1/completions", json={"prompt": "w " * 40})
        assert assert_error_shape(r, 400)["n_prompt_tokens"] == 40
        assert p.fake.requests == 0  # never reached a slot
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await c.post("/v1/completions", json={"prompt": "short"})).status_code == 200


async def test_unreachable_child_is_503_with_retry_after(proxy_factory: ProxyFactory) -> None:
    # The child refused the connection (it died a moment ago): nothing reached it, so the answer is a
    # retryable 503 that a load balancer may send to another replica, not a 502 (docs/deploy.md).
    async with proxy_factory() as p, p.client() as c:
        await p.fake.stop()
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert assert_error_shape(r, 503, "not_ready")["type"] == "unavailable_error"
        assert r.headers["retry-after"] == "1"
        assert p.state.in_flight == 0


async def test_head_only_on_the_probes(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client("admin") as c:
        assert (await c.head("/healthz")).status_code == 200
        assert (await c.head("/v1/models")).status_code == 405
        assert (await c.head("/slots")).status_code == 405
