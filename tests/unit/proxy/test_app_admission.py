"""Admission, disconnects, child faults and deadlines through the whole app (uvicorn + fake child)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import re
import time

import httpx
import pytest

from proxy.settings import TenantSettings, Timeouts
from supervisor.logs import JsonFormatter
from tests.fakes.fake_upstream import eventually
from tests.unit.proxy.conftest import Proxy, ProxyFactory

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


wait_for = eventually


async def gauges(p: Proxy) -> dict[str, float]:
    async with p.client("admin") as c:
        text = (await c.get("/metrics")).text
    out: dict[str, float] = {}
    for name in ("llamagate_in_flight_requests", "llamagate_queued_requests"):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return out


def limited(
    max_concurrency: int = 2, max_queue: int = 2, queue_timeout_s: float = 30
) -> tuple[TenantSettings, ...]:
    return (
        TenantSettings(
            "team", max_concurrency=max_concurrency, max_queue=max_queue, queue_timeout_s=queue_timeout_s
        ),
        TenantSettings(
            "other", max_concurrency=max_concurrency, max_queue=max_queue, queue_timeout_s=queue_timeout_s
        ),
        TenantSettings("ops"),
    )


async def test_tenant_limit_queue_and_fast_429(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(tenants=limited(2, 2)) as p, p.client() as c:
        slow = {**CHAT, "fake_delay_ms": 400}

        async def one() -> tuple[int, float, httpx.Response]:
            r = await c.post("/v1/chat/completions", json=slow)
            return r.status_code, time.monotonic(), r  # when the answer was complete, in this process

        results = await asyncio.gather(*(one() for _ in range(6)))
        statuses = sorted(s for s, _, _ in results)
        assert statuses == [200, 200, 200, 200, 429, 429]
        assert p.fake.max_active == 2  # the child never saw more than the tenant's limit
        first_ok_done = min(at for s, at, _ in results if s == 200)
        for status, done_at, r in results:
            if status == 429:
                # Refused without waiting for a slot: answered before any admitted request finished.
                assert done_at < first_ok_done
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
        assert await gauges(p) == {"llamagate_in_flight_requests": 0, "llamagate_queued_requests": 0}


async def test_a_freed_slot_goes_to_a_queued_request_only_within_its_tenants_limit(
    proxy_factory: ProxyFactory,
) -> None:
    tenants = (
        TenantSettings("team", max_concurrency=2, max_queue=5, queue_timeout_s=30),
        TenantSettings("other", max_concurrency=2, max_queue=5, queue_timeout_s=30),
        TenantSettings("ops"),
    )
    async with proxy_factory(tenants=tenants, snapshot={"slots": 4}) as p, p.client() as team:
        # Held until the test lets go (cancels them): no race with a delay running out on a busy machine.
        held = [
            asyncio.ensure_future(team.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 600_000}))
            for _ in range(2)
        ]
        await wait_for(lambda: p.fake.active == 2)
        queued = asyncio.ensure_future(team.post("/v1/chat/completions", json=CHAT))
        await wait_for(lambda: p.state.queued == 1)
        # Another tenant's request comes and goes: its permit frees a slot, and the slots are not full,
        # but "team" is still at its limit, so its queued request must stay queued.
        async with p.client("other") as other:
            assert (await other.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert p.state.queued == 1 and not queued.done()
        assert {load.name: load.in_flight for load in p.lane.gate.loads()}["team"] == 2
        assert p.fake.max_active == 3  # team's 2 and the other tenant's 1
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        assert (await queued).status_code == 200  # its turn came when team's share freed


async def test_two_tenants_hammering_both_progress(proxy_factory: ProxyFactory) -> None:
    fake_tenants = limited(3, 50)
    async with proxy_factory(tenants=fake_tenants, snapshot={"slots": 2}) as p:
        done: dict[str, list[float]] = {"user": [], "other": []}

        async def hammer(key: str, n: int) -> None:
            async with p.client(key) as c:
                for _ in range(n):
                    r = await c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 20})
                    assert r.status_code == 200
                    done[key].append(time.monotonic())

        await asyncio.gather(*(hammer("user", 6) for _ in range(4)), hammer("other", 6))
        # The single client of "other" finished long before the 4 clients of "user" did: it got turns.
        assert max(done["other"]) < max(done["user"])
        assert p.fake.max_active <= 2
        assert p.state.in_flight == 0 and p.state.queued == 0


async def test_disconnect_mid_stream_releases_the_permit_and_cancels_upstream(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llamagate.access")
    async with proxy_factory() as p, p.client() as c:
        body = {**CHAT, "stream": True, "max_tokens": 10_000, "fake_token_interval_ms": 5}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if "tok" in line:
                    break
            assert p.state.in_flight == 1
        await wait_for(lambda: p.state.in_flight == 0)
        await wait_for(lambda: p.fake.client_gone == 1 and p.fake.active == 0)
        await wait_for(
            lambda: any(getattr(rec, "fields", {}).get("outcome") == "client_gone" for rec in caplog.records)
        )


async def test_a_client_that_leaves_after_the_last_event_had_the_whole_answer(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """SDKs close the connection once they have ``[DONE]``; the child's stream may end a moment later.
    That client is not gone: the answer is ``ok`` and the child's stream is read to its end (not cut)."""
    caplog.set_level(logging.INFO, logger="llamagate.access")
    async with proxy_factory() as p, p.client() as c:
        body = {**CHAT, "stream": True, "fake_end_after_ms": 1000}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    break
            assert p.fake.active == 1  # the child's stream has not ended yet

        def access() -> list[logging.LogRecord]:
            return [rec for rec in caplog.records if rec.name == "llamagate.access"]

        await wait_for(lambda: len(access()) == 1)
        fields = access()[0].fields  # type: ignore[attr-defined]
        assert (fields["status"], fields["outcome"]) == (200, "ok")
        assert p.fake.client_gone == 0 and p.fake.active == 0  # the child's stream was read to its end


async def test_disconnect_while_queued_leaves_the_queue(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(tenants=limited(1, 5)) as p, p.client() as c:
        holder = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 1000}))
        await wait_for(lambda: p.state.in_flight == 1)
        queued = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await wait_for(lambda: p.state.queued == 1)
        queued.cancel()
        await wait_for(lambda: p.state.queued == 0)
        assert (await holder).status_code == 200
        assert p.fake.requests == 1  # the abandoned one never reached the child
        await wait_for(lambda: p.state.in_flight == 0)


async def test_storm_of_cancellations_leaves_gauges_at_zero(proxy_factory: ProxyFactory) -> None:
    rng = random.Random(11)
    async with proxy_factory(tenants=limited(3, 6), snapshot={"slots": 4}) as p:
        clients = [p.client(rng.choice(["user", "other"])) for _ in range(6)]
        answers: list[tuple[int, str]] = []  # (status, last line) of every request that was not cancelled
        most: dict[str, int] = {}  # highest in-flight count each tenant reached, seen every loop turn
        storming = True

        async def watch_tenants() -> None:
            while storming:
                for load in p.lane.gate.loads():
                    most[load.name] = max(most.get(load.name, 0), load.in_flight)
                await asyncio.sleep(0)

        async def one(c: httpx.AsyncClient) -> None:
            body = {**CHAT, "stream": rng.random() < 0.7, "max_tokens": rng.randint(1, 200)}
            body["fake_token_interval_ms"] = rng.choice([0, 1, 3])
            body["fake_delay_ms"] = rng.choice([0, 0, 20])
            if body["stream"]:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line]
                    answers.append((r.status_code, lines[-1] if lines else ""))
            else:
                r = await c.post("/v1/chat/completions", json=body)
                answers.append((r.status_code, r.text))

        watcher = asyncio.ensure_future(watch_tenants())
        tasks = [asyncio.ensure_future(one(clients[i % 6])) for i in range(60)]
        for _ in range(15):
            await asyncio.sleep(rng.uniform(0.005, 0.03))
            for t in rng.sample(tasks, 4):
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        storming = False
        await watcher
        for c in clients:
            await c.aclose()
        # Only our cancels may end a request early: no client-side error, no assert swallowed by gather.
        unexpected = [r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)]
        assert not unexpected, unexpected[:3]
        assert len(answers) == sum(r is None for r in results) > 0
        for status, last in answers:
            assert status in (200, 429), (status, last)
            if status == 200 and last.startswith("data: "):
                assert last == "data: [DONE]"  # a stream that was not cancelled ran to its end
            if status == 429:
                assert json.loads(last)["error"]["type"] == "rate_limit_error"
        assert {s for s, _ in answers} == {200, 429}  # the queue limit was reached, too
        # Per tenant: never more than its limit of 3, even when a queued request was dispatched.
        assert all(n <= 3 for n in most.values()) and max(most.values()) == 3, most
        await wait_for(lambda: p.state.in_flight == 0 and p.state.queued == 0 and p.state.active == 0)
        await wait_for(lambda: p.fake.active == 0)
        assert p.fake.max_active <= 4
        assert await gauges(p) == {"llamagate_in_flight_requests": 0, "llamagate_queued_requests": 0}


async def test_child_dying_mid_stream_ends_the_stream_with_an_error_event(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory() as p, p.client() as c:
        body = {**CHAT, "stream": True, "max_tokens": 50, "fake_die_after": 3}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        assert "data: [DONE]" not in lines
        last = json.loads(lines[-1][6:])
        assert last["error"]["type"] == "upstream_error"
        assert sum("tok" in line for line in lines) == 3
        assert p.state.in_flight == 0


async def test_first_token_deadline(proxy_factory: ProxyFactory) -> None:
    timeouts = Timeouts(connect_s=2, first_token_s=0.2, total_s=60)
    async with proxy_factory(timeouts=timeouts) as p, p.client() as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True, "fake_delay_ms": 3000})
        assert r.status_code == 504
        assert "first token" in r.json()["error"]["message"]
        await wait_for(lambda: p.fake.client_gone == 1)  # the child was told (its socket closed)
        assert p.state.in_flight == 0


async def test_total_deadline_mid_stream(proxy_factory: ProxyFactory) -> None:
    timeouts = Timeouts(connect_s=2, first_token_s=10, total_s=0.3)
    async with proxy_factory(timeouts=timeouts) as p, p.client() as c:
        body = {**CHAT, "stream": True, "max_tokens": 1000, "fake_token_interval_ms": 10}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line]
        assert json.loads(lines[-1][6:])["error"]["type"] == "upstream_timeout"
        assert p.state.in_flight == 0


async def test_capacity_follows_the_childs_slots(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(snapshot={"slots": 1}) as p, p.client() as c:
        await asyncio.gather(
            *(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 30}) for _ in range(4))
        )
        assert p.fake.max_active == 1
        p.source.update(slots=3, generation=2)
        p.fake.max_active = 0
        await asyncio.gather(
            *(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 100}) for _ in range(4))
        )
        assert p.fake.max_active == 3


async def test_reload_swaps_limits_without_leaking_permits(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(tenants=limited(1, 10)) as p, p.client() as c:
        first = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 300}))
        await wait_for(lambda: p.state.in_flight == 1)
        p.state.reload(dataclasses.replace(p.settings, tenants=limited(3, 10)))
        more = [
            asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 300}))
            for _ in range(2)
        ]
        await wait_for(lambda: p.state.in_flight == 3)
        results = await asyncio.gather(first, *more)
        assert [r.status_code for r in results] == [200, 200, 200]
        assert p.state.in_flight == 0


async def test_drain_waits_for_in_flight_requests(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        assert await p.state.drain(0.1)
        pending = asyncio.ensure_future(c.post("/v1/chat/completions", json={**CHAT, "fake_delay_ms": 300}))
        await wait_for(lambda: p.state.in_flight == 1)
        p.source.update(ready=False, state="STOPPING", reason="draining")
        assert not await p.state.drain(0.01)
        refused = await c.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503
        assert await p.state.drain(5.0)
        assert (await pending).status_code == 200


async def test_logs_hold_no_key_and_no_prompt(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    prompt = "MY-SECRET-PROMPT-TEXT"
    async with proxy_factory() as p:
        async with p.client() as c:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 3}
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                async for _ in r.aiter_bytes():
                    pass
            await c.post("/v1/chat/completions", json={**body, "model": prompt})
            await c.post("/v1/chat/completions", content=prompt.encode())
            await c.post("/v1/chat/completions", json={**body, "fake_status": 400})
            await c.get(f"/{p.keys['user']}")
        async with p.client(None) as c:
            await c.post(
                "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {p.keys['user']}x"}
            )
            await c.post(
                "/v1/chat/completions", json=body, headers={"authorization": f"Token {p.keys['admin']}"}
            )
    formatter = JsonFormatter()
    # Everything the server side logged (the test's own httpx client logs its URLs: not ours).
    ours = [rec for rec in caplog.records if not rec.name.startswith(("httpx", "httpcore"))]
    rendered = "\n".join(formatter.format(rec) for rec in ours)
    access = [rec for rec in caplog.records if rec.name == "llamagate.access"]
    assert len(access) >= 7
    for key in p.keys.values():
        assert key not in rendered
        assert key[16:] not in rendered  # not even the secret part
    assert prompt not in rendered
    fields = access[0].fields  # type: ignore[attr-defined]
    assert {
        "request_id",
        "tenant",
        "key_id",
        "route",
        "status",
        "queue_wait_ms",
        "ttft_ms",
        "tokens",
        "duration_ms",
        "outcome",
    } <= set(fields)
    stream_line = next(r.fields for r in access if r.fields.get("ttft_ms") is not None)  # type: ignore[attr-defined]
    assert stream_line["tokens"] == 3 and stream_line["outcome"] == "ok" and stream_line["tenant"] == "team"
    outcomes = {r.fields["outcome"] for r in access}  # type: ignore[attr-defined]
    assert {
        "ok",
        "rejected:model_not_found",
        "rejected:bad_request",
        "rejected:unauthorized",
        "upstream_error",
    } <= outcomes
