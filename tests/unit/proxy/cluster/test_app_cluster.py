"""The shared limits through the whole app: two proxies (two replicas) on one real redis-server in front
of one fake child, the lease taken at admission and given back on every path, the 503 of ``refuse``."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
from redis.asyncio import Redis

from proxy.settings import ClusterSettings, TenantSettings
from tests.fakes.fake_llama import FakeLlama
from tests.helpers.redis_server import RedisServer
from tests.unit.proxy.conftest import SECRET, Proxy, ProxyFactory

pytestmark = pytest.mark.needs_tool("redis-server")

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
TENANTS = (
    TenantSettings("team", max_concurrency=2, max_queue=8, queue_timeout_s=20),
    TenantSettings("other", max_concurrency=4),
    TenantSettings("ops", max_concurrency=4),
)


def cluster(redis: RedisServer, on_redis_error: str = "local") -> ClusterSettings:
    return ClusterSettings(redis.url, replicas=2, on_redis_error=on_redis_error, lease_ttl_s=3.0)  # type: ignore[arg-type]


async def until(pred: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


async def mode(p: Proxy) -> str:
    async with p.client("admin") as c:
        text = (await c.get("/metrics")).text
    (found,) = re.findall(r'^llamagate_cluster_mode\{mode="(\w+)"\} 1\.0$', text, re.M)
    return found


async def live_leases(redis: Redis) -> int:
    total = 0
    async for key in redis.scan_iter("llamagate:*:lease:*"):
        secs, micros = await redis.time()
        total += await redis.zcount(key, f"({secs * 1000 + micros // 1000}", "+inf")
    return total


async def test_two_replicas_share_the_tenants_limit(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    fake = FakeLlama(secret=SECRET, tokens=4)
    await fake.start()
    settings = {"tenants": TENANTS, "cluster": cluster(redis_server), "fake": fake}
    async with proxy_factory(**settings) as a, proxy_factory(**settings) as b:
        # The same key on both (one replica set): a's, on b's address too.
        b.state.reload(a.settings)
        slow = {**CHAT, "fake_delay_ms": 300}
        headers = {"authorization": f"Bearer {a.keys['user']}"}
        async with a.client() as ca, httpx.AsyncClient(base_url=b.url, headers=headers, timeout=30) as cb:
            results = await asyncio.gather(*(c.post("/v1/chat/completions", json=slow) for c in (ca, cb) * 3))
        assert [r.status_code for r in results] == [200] * 6
        assert fake.max_active == 2  # each replica's gate alone would have let 4 through
        assert await mode(a) == "cluster"
        redis = Redis.from_url(redis_server.url)
        try:
            await until(lambda: _zero(redis), "every lease given back")
        finally:
            await redis.aclose()


async def _zero(redis: Redis) -> bool:
    return await live_leases(redis) == 0


async def test_a_client_that_leaves_while_waiting_for_a_lease_holds_nothing(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    async with proxy_factory(tenants=TENANTS, cluster=cluster(redis_server)) as p, p.client() as c:
        slow = {**CHAT, "fake_delay_ms": 1500}
        running = [asyncio.create_task(c.post("/v1/chat/completions", json=slow)) for _ in range(2)]
        redis = Redis.from_url(redis_server.url)
        try:
            await until(lambda: _count(redis, 2), "two leases held")
            headers = {"authorization": f"Bearer {p.keys['user']}"}
            async with httpx.AsyncClient(base_url=p.url, headers=headers, timeout=0.3) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post("/v1/chat/completions", json=CHAT)
            assert p.fake.max_active == 2  # the third never reached the child
            assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
            await until(lambda: _zero(redis), "every lease given back")
            assert await redis.zcard("llamagate:{team}:queue:gpt-4o-mini") == 0  # its place too
        finally:
            await redis.aclose()
        assert p.lane.admission.in_flight == 0


async def _count(redis: Redis, n: int) -> bool:
    return await live_leases(redis) == n


async def test_refuse_answers_503_with_retry_after_while_redis_is_down(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    async with proxy_factory(tenants=TENANTS, cluster=cluster(redis_server, "refuse")) as p, p.client() as c:
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        redis_server.kill()
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("unavailable_error", "shared_limits_unavailable")
        assert await mode(p) == "refuse"
        assert p.lane.admission.in_flight == 0 and p.fake.requests == 1
        redis_server.start()

        async def back() -> bool:
            return await mode(p) == "cluster"

        await until(back, "cluster mode back")
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_without_a_redis_url_there_is_no_limiter(proxy_factory: ProxyFactory) -> None:
    async with proxy_factory(tenants=TENANTS) as p, p.client() as c:
        assert p.state.cluster is None
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert await mode(p) == "off"


async def test_a_requests_budget_holds_across_two_replicas(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    from proxy.settings import BudgetSettings

    fake = FakeLlama(secret=SECRET, tokens=4)
    await fake.start()
    budgeted = (
        TenantSettings("team", max_concurrency=2, budgets=BudgetSettings(requests_per_minute=3)),
        *TENANTS[1:],
    )
    settings = {"tenants": budgeted, "cluster": cluster(redis_server), "fake": fake}
    async with proxy_factory(**settings) as a, proxy_factory(**settings) as b:
        b.state.reload(a.settings)
        headers = {"authorization": f"Bearer {a.keys['user']}"}
        async with a.client() as ca, httpx.AsyncClient(base_url=b.url, headers=headers, timeout=30) as cb:
            statuses = [(await c.post("/v1/chat/completions", json=CHAT)).status_code for c in (ca, cb, ca)]
            refused = await cb.post("/v1/chat/completions", json=CHAT)
        assert statuses == [200, 200, 200]  # each replica alone would admit 3 of its own
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "requests_per_minute"
        assert 1 <= int(refused.headers["retry-after"]) <= 60


async def test_a_refusal_of_the_shared_line_says_when_a_slot_is_likely_free(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    """A tenant at its limit across the replicas is told to come back after one of its recent service
    times (this replica's gate knows them), as one replica alone says, not after the probe's second."""
    tenants = (TenantSettings("team", max_concurrency=1, max_queue=0, queue_timeout_s=20),)
    async with proxy_factory(tenants=tenants, cluster=cluster(redis_server)) as p, p.client() as c:
        slow = {**CHAT, "fake_delay_ms": 3000}
        assert (await c.post("/v1/chat/completions", json=slow)).status_code == 200  # a service time
        running = asyncio.create_task(c.post("/v1/chat/completions", json=slow))
        redis = Redis.from_url(redis_server.url)
        try:
            await until(lambda: _count(redis, 1), "the lease held")
            refused = await c.post("/v1/chat/completions", json=CHAT)
        finally:
            await redis.aclose()
        assert refused.status_code == 429 and "across the replicas" in refused.text, refused.text
        assert int(refused.headers["retry-after"]) >= 3  # about the 3 s the tenant's requests take
        assert (await running).status_code == 200
