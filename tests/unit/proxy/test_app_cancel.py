"""``GET /admin/requests`` and ``DELETE /admin/requests/{id}`` through the whole app (uvicorn + fake
child): what is listed, how a queued and a running request end when cancelled, what a cancel cannot
do, and the header rules of ``X-LlamaGate-Priority`` / ``X-LlamaGate-Max-Wait`` on the request path."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from proxy.settings import TenantSettings
from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import Proxy, ProxyFactory

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
ONE_SLOT = {"slots": 1}


async def listed(p: Proxy) -> list[dict[str, object]]:
    async with p.client("admin") as c:
        r = await c.get("/admin/requests")
    assert r.status_code == 200, r.text
    rows = r.json()["requests"]
    assert isinstance(rows, list)
    return rows


def tokens(row: dict[str, object]) -> int:
    value = row["tokens"]
    assert isinstance(value, int)
    return value


async def metric(p: Proxy, name: str, **labels: str) -> float:
    async with p.client("admin") as c:
        text = (await c.get("/metrics")).text
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m[2])
    return total


async def test_listing_shows_queued_and_running_requests_and_no_prompt(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot=ONE_SLOT) as p, p.client() as c:
        slow = {**CHAT, "stream": True, "fake_token_interval_ms": 50, "max_tokens": 400}
        running = asyncio.create_task(
            c.post("/v1/chat/completions", json=slow, headers={"x-request-id": "run-1"})
        )
        await eventually(lambda: p.fake.active == 1)
        queued = asyncio.create_task(
            c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "q-1"})
        )
        await eventually(lambda: p.lane.gate.queued == 1)
        rows = await listed(p)
        by_id = {row["id"]: row for row in rows}
        assert set(by_id) == {"run-1", "q-1"}
        assert [row["id"] for row in rows] == ["q-1", "run-1"]  # queued first
        run, queue = by_id["run-1"], by_id["q-1"]
        assert run["state"] == "running" and queue["state"] == "queued"
        assert run["tenant"] == queue["tenant"] == "team"
        assert run["key_id"] == p.entries["user"].key_id
        assert run["model"] == p.lane.name and run["route"] == "/v1/chat/completions"
        assert isinstance(run["running_s"], float) and queue["running_s"] is None
        assert isinstance(queue["waited_s"], float) and queue["waited_s"] >= 0
        assert set(run) == {
            "id",
            "tenant",
            "key_id",
            "model",
            "route",
            "state",
            "waited_s",
            "running_s",
            "tokens",
        }
        assert "hello" not in json.dumps(rows)  # never the prompt
        # The tokens so far come from the stream's meter while it runs.
        (entry,) = p.state.inflight.find("run-1")
        await eventually(lambda: tokens(entry.row(0.0)) >= 3)
        assert tokens({row["id"]: row for row in await listed(p)}["run-1"]) >= 3
        async with p.client("admin") as admin:
            assert (await admin.delete("/admin/requests/run-1")).status_code == 200
        assert (await running).status_code == 200 and (await queued).status_code == 200
        assert await listed(p) == []  # every entry left at its end
        assert len(p.state.inflight) == 0


async def test_cancelling_a_queued_request_takes_it_out_of_its_queue_with_410(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory(snapshot=ONE_SLOT) as p, p.client() as c:
        hold = asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 800}))
        await eventually(lambda: p.fake.active == 1)
        queued = asyncio.create_task(
            c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "q-9"})
        )
        await eventually(lambda: p.lane.gate.queued == 1)
        async with p.client("admin") as admin:
            r = await admin.delete("/admin/requests/q-9")
        assert r.status_code == 200, r.text
        (row,) = r.json()["cancelled"]
        assert row["id"] == "q-9" and row["state"] == "queued"
        # Out of its queue and off the list by the time DELETE answered.
        assert p.lane.gate.queued == 0
        assert "q-9" not in [row["id"] for row in await listed(p)]
        answer = await queued
        assert answer.status_code == 410
        assert answer.json()["error"] == {
            "message": "the request 'q-9' was cancelled by an operator",
            "type": "cancelled_error",
            "code": "cancelled_by_operator",
        }
        assert answer.headers["x-request-id"] == "q-9"
        assert (await hold).status_code == 200  # the running one was not touched
        assert p.fake.requests == 1  # the cancelled one never reached the child
        assert await metric(p, "llamagate_cancelled_requests_total", state="queued") == 1


async def test_cancelling_a_running_stream_ends_it_with_an_error_event_and_closes_the_child(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory(snapshot=ONE_SLOT) as p, p.client() as c:
        body = {**CHAT, "stream": True, "max_tokens": 2000, "fake_token_interval_ms": 20}
        events: list[bytes] = []

        async def stream() -> int:
            async with c.stream(
                "POST", "/v1/chat/completions", json=body, headers={"x-request-id": "s-1"}
            ) as r:
                async for chunk in r.aiter_bytes():
                    events.append(chunk)
                return r.status_code

        task = asyncio.create_task(stream())
        await eventually(lambda: len(events) >= 3)
        async with p.client("admin") as admin:
            r = await admin.delete("/admin/requests/s-1")
        assert r.status_code == 200 and r.json()["cancelled"][0]["state"] == "running"
        assert await listed(p) == []  # gone by the time DELETE answered
        assert await task == 200
        text = b"".join(events).decode()
        last = text.strip().split("\n\n")[-1]
        assert last.startswith("data: ")
        assert json.loads(last[len("data: ") :])["error"]["type"] == "cancelled_error"
        assert "[DONE]" not in text
        assert text.count('"content"') < 2000  # stopped, long before its 2000 tokens
        await eventually(lambda: p.fake.client_gone == 1)  # the child saw its connection closed
        await eventually(lambda: p.lane.gate.held == 0)
        assert await metric(p, "llamagate_cancelled_requests_total", state="running") == 1


async def test_cancelling_a_running_non_streamed_request_answers_410(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot=ONE_SLOT) as p, p.client() as c:
        body = {**CHAT, "max_tokens": 2000, "fake_token_interval_ms": 20}
        task = asyncio.create_task(c.post("/v1/chat/completions", json=body, headers={"x-request-id": "w-1"}))
        await eventually(lambda: p.fake.active == 1)
        await eventually(
            lambda: bool(p.state.inflight.find("w-1")) and p.state.inflight.find("w-1")[0].state == "running"
        )
        async with p.client("admin") as admin:
            assert (await admin.delete("/admin/requests/w-1")).status_code == 200
        answer = await task
        assert answer.status_code == 410 and answer.json()["error"]["code"] == "cancelled_by_operator"
        await eventually(lambda: p.fake.client_gone == 1)


async def test_cancel_refusals(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p:
        async with p.client("admin") as admin:
            r = await admin.delete("/admin/requests/nope")
            assert r.status_code == 404 and "no request 'nope'" in r.json()["error"]["message"]
        async with p.client("user") as user:  # admin scope only, both rows
            assert (await user.get("/admin/requests")).status_code == 403
            assert (await user.delete("/admin/requests/nope")).status_code == 403


async def test_priority_and_max_wait_headers(proxy_factory: ProxyFactory) -> None:
    tenants = (
        TenantSettings("team", max_concurrency=4, max_queue=8, queue_timeout_s=10, priority=10),
        TenantSettings("other", max_concurrency=4, max_queue=8, queue_timeout_s=10),
        TenantSettings("ops"),
    )
    async with proxy_factory(snapshot=ONE_SLOT, tenants=tenants) as p, p.client() as c:
        for name, value in (("X-LlamaGate-Priority", "urgent"), ("X-LlamaGate-Max-Wait", "-1")):
            r = await c.post("/v1/chat/completions", json=CHAT, headers={name: value})
            assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
        assert p.fake.requests == 0  # refused before anything reached the child

        hold = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                json={**CHAT, "fake_delay_ms": 20000},
                headers={"x-request-id": "hold"},
            )
        )
        await eventually(lambda: p.fake.active == 1)
        # Its own maximum wait: refused long before the tenant's 10 s, saying whose limit it was.
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-LlamaGate-Max-Wait": "0.05"})
        assert r.status_code == 429 and "the request's own maximum wait" in r.json()["error"]["message"]
        # Lowered to batch (0): it waits under priority 0, beside the tenant's own 10.
        low = asyncio.create_task(
            c.post("/v1/chat/completions", json=CHAT, headers={"X-LlamaGate-Priority": "batch"})
        )
        await eventually(lambda: p.lane.gate.queued == 1)
        async with p.client("admin") as admin:
            load = (await admin.get("/admin/load")).json()
        assert {"priority": 0, "in_flight": 0, "queued": 1} in load["priorities"]
        assert {"priority": 10, "in_flight": 1, "queued": 0} in load["priorities"]
        assert load["models"][p.lane.name]["priorities"] == load["priorities"]
        assert await metric(p, "llamagate_priority_queued_requests", priority="0") == 1
        assert await metric(p, "llamagate_priority_in_flight_requests", priority="10") == 1
        async with p.client("admin") as admin:  # the slot goes to the queued one
            assert (await admin.delete("/admin/requests/hold")).status_code == 200
        assert (await hold).status_code == 410 and (await low).status_code == 200


async def test_a_request_cannot_raise_its_priority_above_its_tenants(proxy_factory: ProxyFactory) -> None:
    tenants = (
        TenantSettings("team", max_concurrency=4, max_queue=8, queue_timeout_s=10, priority=0),
        TenantSettings("other", max_concurrency=4, max_queue=8, queue_timeout_s=10),
        TenantSettings("ops"),
    )
    async with proxy_factory(snapshot=ONE_SLOT, tenants=tenants) as p, p.client() as c:
        hold = asyncio.create_task(
            c.post(
                "/v1/chat/completions",
                json={**CHAT, "fake_delay_ms": 20000},
                headers={"x-request-id": "hold"},
            )
        )
        await eventually(lambda: p.fake.active == 1)
        asked_high = asyncio.create_task(
            c.post("/v1/chat/completions", json=CHAT, headers={"X-LlamaGate-Priority": "interactive"})
        )
        await eventually(lambda: p.lane.gate.queued == 1)
        levels = {lv.priority: lv.queued for lv in p.lane.gate.priority_loads()}
        assert levels.get(0) == 1 and not levels.get(10)  # counted as the tenant's batch (0)
        async with p.client("admin") as admin:
            assert (await admin.delete("/admin/requests/hold")).status_code == 200
        assert (await hold).status_code == 410 and (await asked_high).status_code == 200


async def test_an_empty_listing_and_no_key(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p:
        assert await listed(p) == []
        async with httpx.AsyncClient(base_url=p.url) as anonymous:
            assert (await anonymous.get("/admin/requests")).status_code == 401
