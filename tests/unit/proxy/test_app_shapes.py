"""The request path with the fake child: slots taken per request shape, refusals before admission,
non-streamed answers assembled from a child stream (so a client that leaves stops the child), cache
detail hidden from inference keys."""

from __future__ import annotations

import asyncio

from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import ProxyFactory

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
CMPL = {"model": "gpt-4o-mini", "prompt": "hi"}


async def test_a_wide_request_takes_its_slots_and_a_too_wide_one_is_400(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot={"slots": 2}) as p, p.client() as c:
        body = {**CMPL, "prompt": ["a", "b"], "stream": True, "max_tokens": 10_000}
        async with c.stream("POST", "/v1/completions", json={**body, "fake_token_interval_ms": 5}) as r:
            async for line in r.aiter_lines():
                if "tok" in line:
                    break
            assert p.state.in_flight == 2
            queued = asyncio.ensure_future(c.post("/v1/completions", json={**CMPL, "max_tokens": 1}))
            await eventually(lambda: p.state.queued == 1)
        assert (await queued).status_code == 200
        r2 = await c.post("/v1/completions", json={**CMPL, "n": 3})
        assert r2.status_code == 400 and "the server's slots, 2" in r2.json()["error"]["message"]
        assert p.fake.requests == 2  # the refused one never reached the child
        await eventually(lambda: p.state.in_flight == 0)


async def test_non_streamed_answers_come_from_a_child_stream(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        r = await c.post("/v1/completions", json={**CMPL, "max_tokens": 3})
        assert r.status_code == 200
        answer = r.json()
        assert answer["choices"][0]["text"] == "tok tok tok" and answer["object"] == "text_completion"
        assert answer["usage"]["completion_tokens"] == 3
        assert "timings" not in answer  # an inference key sees no cache detail
        async with p.client("admin") as admin:
            seen = (await admin.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})).json()
        assert seen["choices"][0]["message"] == {"role": "assistant", "content": "tok tok"}
        assert seen["timings"]["predicted_n"] == 2


async def test_a_non_streamed_client_that_leaves_stops_the_child(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        body = {**CHAT, "max_tokens": 10_000, "fake_token_interval_ms": 5}
        pending = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
        await eventually(lambda: p.fake.active == 1)
        pending.cancel()
        await eventually(lambda: p.fake.client_gone == 1 and p.fake.active == 0)
        await eventually(lambda: p.state.in_flight == 0 and p.state.lingering == 0)
