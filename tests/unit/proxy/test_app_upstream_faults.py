"""The proxy on a real port in front of a raw loopback server that misbehaves: hangs, hang-ups."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from proxy.app import create_app
from proxy.auth import new_key
from proxy.settings import KeyEntry, TenantSettings, Timeouts
from tests.fakes.fake_upstream import FakeLlama, StaticSource, eventually, one_model, serve, snapshot_for
from tests.unit.proxy.conftest import SECRET, ProxyFactory, default_settings
from tests.unit.proxy.raw_upstream import Handler, RawRequest, RawUpstream

DEADLINE_S = 10.0


@asynccontextmanager
async def proxy_on(
    handler: Handler, snapshot: dict[str, object] | None = None, **changes: object
) -> AsyncIterator[tuple[httpx.AsyncClient, RawUpstream]]:
    server = await RawUpstream(handler).start()
    keys: dict[str, str] = {}
    entries: dict[str, KeyEntry] = {}
    for name, tenant, scopes in (("user", "team", {"inference"}), ("admin", "ops", {"inference", "admin"})):
        keys[name], entries[name] = new_key(tenant, frozenset(scopes))  # type: ignore[arg-type]
    settings = default_settings(entries, **changes)
    source = StaticSource(snapshot_for(server.base_url, SECRET, **(snapshot or {})))
    app = create_app(settings, source, one_model(source, "gpt-4o-mini"))
    try:
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
            client.headers["authorization"] = f"Bearer {keys['admin']}"
            yield client, server
    finally:
        await server.stop()


hung_up: list[RawRequest] = []


async def hang_until_hung_up(request: RawRequest) -> bool:
    with contextlib.suppress(ConnectionError):  # a reset is a hang-up too
        await request.reader.read()  # returns at EOF: the proxy gave up and closed the connection
    hung_up.append(request)
    return False


async def test_admin_and_model_routes_have_a_deadline() -> None:
    fast = Timeouts(connect_s=2, first_token_s=0.3, total_s=60)
    async with proxy_on(hang_until_hung_up, timeouts=fast) as (client, server):
        for path in ("/slots", "/props"):
            r = await client.get(path)
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "upstream_timeout"
        r = await client.post("/tokenize", json={"content": "hi"})
        assert r.status_code == 504
        async with asyncio.timeout(DEADLINE_S):
            while not all(r in hung_up for r in server.requests):  # noqa: ASYNC110 - server's state
                await asyncio.sleep(0.01)
        assert len(server.requests) == 3


def checked_tenants() -> tuple[TenantSettings, ...]:
    return (
        TenantSettings("team", check_prompt_size=True),
        TenantSettings("ops", check_prompt_size=True),
    )


async def test_prompt_size_check_that_times_out_is_a_504_not_a_500() -> None:
    fast = Timeouts(connect_s=2, first_token_s=0.3, total_s=60)
    async with proxy_on(hang_until_hung_up, timeouts=fast, tenants=checked_tenants()) as (client, _):
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 504, r.text
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 504, r.text


async def test_prompt_size_check_whose_answer_is_cut_is_a_502_not_a_500() -> None:
    async def cut(request: RawRequest) -> bool:
        await request.body()
        request.writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"tokens":[1,')
        return False

    async with proxy_on(cut, tenants=checked_tenants()) as (client, _):
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "upstream_error"


async def test_query_string_reaches_the_child_verbatim() -> None:
    seen: list[str] = []

    async def record(request: RawRequest) -> bool:
        seen.append(request.target)
        request.writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n[]"
        )
        return True

    async with proxy_on(record) as (client, _):
        r = await client.get("/slots?fail_on_no_slot=1&x=%0D%0A")
        assert r.status_code == 200
    assert seen == ["/slots?fail_on_no_slot=1&x=%0D%0A"]


async def test_a_restart_during_the_upload_sends_the_prompt_check_to_the_new_child(
    proxy_factory: ProxyFactory,
) -> None:
    tenants = (TenantSettings("team", check_prompt_size=True),)
    async with proxy_factory(tenants=tenants) as p, p.client() as c:
        new = FakeLlama(secret=SECRET, tokens=2)
        await new.start()
        gate = asyncio.Event()
        body = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()

        async def upload() -> AsyncIterator[bytes]:
            yield body[:5]
            await gate.wait()
            yield body[5:]

        try:
            task = asyncio.ensure_future(c.post("/v1/completions", content=upload()))
            await eventually(lambda: p.state.active == 1, DEADLINE_S)
            await p.fake.stop()  # the child dies while the body is on its way
            p.source.update(base_url=new.base_url, generation=2)
            gate.set()
            r = await task
            assert r.status_code == 200, r.text
            assert new.requests == 1
        finally:
            await new.stop()
