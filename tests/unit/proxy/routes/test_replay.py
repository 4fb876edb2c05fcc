"""A request whose child dies before any byte of its answer reached the client runs once more on the next
child (``proxy.routes.replay``): the whole app on a real port, the fake llama-server as the children, the
test playing the supervisor (the snapshot says the child died, then that the next one is READY)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from proxy.routes import replay
from proxy.routes.table import ROUTES
from proxy.settings import TenantSettings, Timeouts
from tests.fakes.fake_upstream import FakeLlama, eventually
from tests.unit.proxy.conftest import SECRET, Proxy, ProxyFactory

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
DEADLINE_S = 10.0
DEAD = {"state": "BACKOFF", "ready": False, "base_url": None, "secret": None, "retry_after_s": 3.0}


def dies(p: Proxy, at_token: int) -> None:
    """The model's child dies during its next answer; the supervisor sees it at once."""
    p.fake.die_at_token = at_token
    p.fake.on_death = lambda: p.source.update(reason="exited: killed by SIGKILL", **DEAD)


@asynccontextmanager
async def next_child(p: Proxy, generation: int = 2) -> AsyncIterator[FakeLlama]:
    """The supervisor's next child, READY."""
    child = FakeLlama(secret=SECRET, tokens=4)
    await child.start()
    try:
        p.source.update(
            state="READY",
            ready=True,
            reason=None,
            base_url=child.base_url,
            secret=SECRET,
            generation=generation,
        )
        yield child
    finally:
        await child.stop()


async def replays(p: Proxy) -> dict[str, float]:
    async with p.client("admin") as c:
        text = (await c.get("/metrics")).text
    return {
        reason: float(v)
        for reason, v in re.findall(
            r'^llamagate_replays_total\{model="gemma-3-270m",reason="(\w+)"\} (\S+)$', text, re.M
        )
    }


def access(caplog: pytest.LogCaptureFixture, route: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    return [
        rec.fields  # type: ignore[attr-defined]
        for rec in caplog.records
        if rec.name == "llamagate.access" and rec.fields.get("route") == route  # type: ignore[attr-defined]
    ]


def waiting(p: Proxy) -> Callable[[], bool]:
    """The request is being handled and holds no slot: it waits for the next child."""
    adm = p.lane.gate
    return lambda: p.fake.deaths == 1 and p.state.active == 1 and adm.held == 0 and adm.queued == 0


async def stream_lines(c: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, list[str], str | None]:
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line]
        return r.status_code, lines, r.headers.get("retry-after")


async def test_a_non_streamed_answer_whose_child_died_comes_whole_from_the_next_child(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llamagate.access")
    async with proxy_factory() as p, p.client() as c:
        dies(p, at_token=2)  # two tokens generated, then killed: the client has seen nothing
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await eventually(waiting(p), DEADLINE_S)
        assert p.lane.gate.lingering == 0  # the dead child's permit went back without a linger
        async with next_child(p) as child:
            r = await asyncio.wait_for(task, DEADLINE_S)
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["choices"][0]["message"]["content"] == "tok tok tok tok"
            assert answer["usage"]["completion_tokens"] == 4
            assert (p.fake.requests, child.requests) == (1, 1)
            assert await replays(p) == {"closed": 1.0}
    (line,) = access(caplog)
    assert line["replayed"] == 1 and line["status"] == 200 and line["outcome"] == "ok"
    assert line["tokens"] == 4  # the final attempt's, not the dead child's two


async def test_a_child_whose_snapshot_first_loses_its_address_is_waited_for_all_the_same(
    proxy_factory: ProxyFactory,
) -> None:
    # The supervisor saw the exit but has not stepped out of READY yet: READY, and no address.
    async with proxy_factory() as p, p.client() as c:
        p.fake.die_at_token = 2
        p.fake.on_death = lambda: p.source.update(base_url=None, secret=None)
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await eventually(waiting(p), DEADLINE_S)
        p.source.update(reason="exited: killed by SIGKILL", **DEAD)
        async with next_child(p) as child:
            r = await asyncio.wait_for(task, DEADLINE_S)
            assert r.status_code == 200, r.text
            assert child.requests == 1
        assert await replays(p) == {"closed": 1.0}


async def test_a_stream_whose_child_died_in_the_prompt_is_served_by_the_next_child(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory() as p, p.client() as c:
        dies(p, at_token=0)  # the child's 200 headers went out, then it died before any event
        task = asyncio.ensure_future(stream_lines(c, CHAT))
        await eventually(waiting(p), DEADLINE_S)
        async with next_child(p) as child:
            status, lines, _ = await asyncio.wait_for(task, DEADLINE_S)
            assert child.requests == 1
        assert await replays(p) == {"closed": 1.0}
    assert status == 200
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in e for e in events)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == (
        "tok tok tok tok"
    )


async def test_a_stream_that_sent_tokens_ends_with_an_error_event_and_is_not_replayed(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llamagate.access")
    async with proxy_factory() as p, p.client() as c:
        child = FakeLlama(secret=SECRET, tokens=4)
        await child.start()
        try:
            p.fake.die_at_token = 2
            # The next child is READY the moment this one dies: a replay would find it at once.
            p.fake.on_death = lambda: p.source.update(base_url=child.base_url, generation=2)
            status, lines, _ = await asyncio.wait_for(stream_lines(c, {**CHAT, "max_tokens": 50}), DEADLINE_S)
            assert child.requests == 0
        finally:
            await child.stop()
        assert await replays(p) == {}
    assert status == 200 and "data: [DONE]" not in lines
    assert json.loads(lines[-1][6:])["error"]["type"] == "upstream_error"
    assert sum("tok" in line for line in lines) == 2
    (line,) = access(caplog)
    assert line["replayed"] == 0 and line["outcome"] == "upstream_error"


async def test_a_second_death_is_not_replayed_again(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        dies(p, at_token=2)
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await eventually(waiting(p), DEADLINE_S)
        async with next_child(p) as second:
            second.die_at_token = 1
            second.on_death = lambda: p.source.update(reason="exited: killed by SIGKILL", **DEAD)
            r = await asyncio.wait_for(task, DEADLINE_S)
            assert second.deaths == 1
        assert r.status_code == 502, r.text
        # Alone with the second child when it died: poison, never sent again (proxy.admission.poison).
        assert r.json()["error"]["code"] == "poison_request"
        async with next_child(p, generation=3) as third:
            await eventually(lambda: p.state.active == 0, DEADLINE_S)
            assert third.requests == 0
        assert await replays(p) == {"closed": 1.0}
        assert p.lane.gate.held == 0


async def test_no_child_before_the_deadline_gets_the_503_with_retry_after(
    proxy_factory: ProxyFactory,
) -> None:
    timeouts = Timeouts(connect_s=2, first_token_s=0.5, total_s=1.0)
    async with proxy_factory(timeouts=timeouts) as p, p.client() as c:
        dies(p, at_token=1)
        r = await asyncio.wait_for(c.post("/v1/chat/completions", json=CHAT), DEADLINE_S)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "not_ready"
        assert r.headers["retry-after"] == "3"  # the supervisor's estimate, as for a request arriving now
        # A stream in its prompt waits until its first-token deadline, and gets the same answer.
        p.fake.die_at_token = 0
        p.source.update(state="READY", ready=True, base_url=p.fake.base_url, secret=SECRET, generation=2)
        status, lines, retry_after = await asyncio.wait_for(stream_lines(c, CHAT), DEADLINE_S)
        assert status == 503 and retry_after == "3"
        assert json.loads(lines[0])["error"]["code"] == "not_ready"
        assert await replays(p) == {"closed": 2.0}
        assert p.state.active == 0 and p.lane.gate.held == 0 and p.lane.gate.queued == 0


async def test_a_model_that_gave_up_ends_the_wait_at_once(proxy_factory: ProxyFactory) -> None:
    # FAILED: no child is coming, so the request does not wait for its deadline (60 s here).
    async with proxy_factory() as p, p.client() as c:
        dies(p, at_token=1)
        p.fake.on_death = lambda: p.source.update(
            state="FAILED", ready=False, base_url=None, reason="gave up", retry_after_s=None
        )
        r = await asyncio.wait_for(c.post("/v1/chat/completions", json=CHAT), DEADLINE_S)
        assert r.status_code == 503 and "retry-after" not in r.headers
        assert "gave up" in r.json()["error"]["message"]


async def test_a_client_that_leaves_during_the_wait_holds_nothing(
    proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llamagate.access")
    tenants = (TenantSettings("team", max_concurrency=1, max_queue=1),)
    async with proxy_factory(tenants=tenants) as p, p.client() as c:
        dies(p, at_token=0)
        task = asyncio.ensure_future(stream_lines(c, CHAT))
        await eventually(waiting(p), DEADLINE_S)
        task.cancel()  # the client closes its connection
        await asyncio.gather(task, return_exceptions=True)
        adm = p.lane.gate
        await eventually(lambda: p.state.active == 0, DEADLINE_S)
        assert (adm.held, adm.queued, adm.lingering) == (0, 0, 0)
        async with next_child(p) as child:
            # The tenant's one slot and one queue place are free: it is served at once.
            r = await asyncio.wait_for(c.post("/v1/chat/completions", json=CHAT), DEADLINE_S)
            assert r.status_code == 200 and child.requests == 1  # the one that left never came back
    (gone, served) = access(caplog)
    assert gone["outcome"] == "client_gone" and gone["replayed"] == 1 and gone["status"] == 499
    assert served["replayed"] == 0


async def test_a_child_that_hangs_up_but_lives_is_not_asked_again(
    proxy_factory: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay, "DEATH_GRACE_S", 0.2)
    async with proxy_factory() as p, p.client() as c:
        p.fake.die_at_token = 0  # a hang-up, and the snapshot stays READY on the same child
        r = await asyncio.wait_for(c.post("/v1/chat/completions", json=CHAT), DEADLINE_S)
        assert r.status_code == 502 and p.fake.requests == 1
        assert await replays(p) == {}


async def test_a_child_gone_before_the_request_reached_it_is_replayed_as_refused(
    proxy_factory: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with proxy_factory() as p, p.client() as c:
        await p.fake.stop()  # dead, and the supervisor has not noticed yet: the snapshot says READY
        watching = asyncio.Event()
        watch = p.lane.watch

        async def spied(*args: Any) -> Any:
            watching.set()
            return await watch(*args)

        monkeypatch.setattr(p.lane, "watch", spied)
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await asyncio.wait_for(watching.wait(), DEADLINE_S)  # refused, and waiting to learn why
        p.source.update(reason="exited: killed by SIGKILL", **DEAD)
        async with next_child(p) as child:
            r = await asyncio.wait_for(task, DEADLINE_S)
            assert r.status_code == 200 and child.requests == 1
        assert await replays(p) == {"refused": 1.0}


def test_every_generation_route_is_replayable() -> None:
    # None of today's generation routes has an effect beyond generating (embeddings and rerank too).
    generation = [r for r in ROUTES if r.takes_slots]
    assert len(generation) == 16 and all(r.replayable for r in generation)


async def test_a_drain_ends_the_wait_with_the_503_of_a_stopping_daemon(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory() as p, p.client() as c:
        dies(p, at_token=1)
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await eventually(waiting(p), DEADLINE_S)
        drained = asyncio.ensure_future(p.state.drain(DEADLINE_S))  # SIGTERM: no child is coming
        r = await asyncio.wait_for(task, DEADLINE_S)  # long before its total deadline (60 s)
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert await asyncio.wait_for(drained, DEADLINE_S) is True


async def test_a_model_removed_during_the_wait_ends_it_with_the_original_failure(
    proxy_factory: ProxyFactory,
) -> None:
    async with proxy_factory() as p, p.client() as c:
        dies(p, at_token=1)
        task = asyncio.ensure_future(c.post("/v1/chat/completions", json=CHAT))
        await eventually(waiting(p), DEADLINE_S)
        lane = p.lane
        p.state.router.remove(lane.name)  # a SIGHUP took the model out of the config
        r = await asyncio.wait_for(task, DEADLINE_S)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert lane.gate.held == 0 and lane.active == 0
