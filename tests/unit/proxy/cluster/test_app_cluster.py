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
        assert p.lane.gate.in_flight == 0


async def _idle(p: Proxy, redis: Redis) -> bool:
    return p.lane.gate.in_flight == 0 and await _zero(redis)


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
        assert p.lane.gate.in_flight == 0 and p.fake.requests == 1
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
        redis = Redis.from_url(redis_server.url)
        try:
            # The answer's last byte can reach the client before the proxy has given back the permit
            # and the lease; with one of each and no queue, the next request would be refused for it.
            await until(lambda: _idle(p, redis), "the first request's permit and lease given back")
            running = asyncio.create_task(c.post("/v1/chat/completions", json=slow))
            await until(lambda: _count(redis, 1), "the lease held")
            refused = await c.post("/v1/chat/completions", json=CHAT)
        finally:
            await redis.aclose()
        assert refused.status_code == 429 and "across the replicas" in refused.text, refused.text
        assert int(refused.headers["retry-after"]) >= 3  # about the 3 s the tenant's requests take
        assert (await running).status_code == 200


# --- the promises of one daemon hold across replicas (issue 38) -------------------------------------------


async def _pair(
    proxy_factory: ProxyFactory, redis_server: RedisServer, tenants: tuple[TenantSettings, ...], **kw: object
) -> tuple[FakeLlama, dict[str, object]]:
    fake = FakeLlama(secret=SECRET, tokens=4)
    await fake.start()
    return fake, {"tenants": tenants, "cluster": cluster(redis_server), "fake": fake, **kw}


async def test_max_wait_zero_at_the_cluster_wide_limit_is_a_429_at_once(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    """``X-LlamaGate-Max-Wait: 0`` means a slot now or a 429 now, also while the tenant's leases are all
    held on another replica (the shared line used to wait the tenant's whole queue_timeout_s)."""
    _, settings = await _pair(proxy_factory, redis_server, TENANTS)
    async with proxy_factory(**settings) as a, proxy_factory(**settings) as b:
        b.state.reload(a.settings)
        headers = {"authorization": f"Bearer {a.keys['user']}"}
        slow = {**CHAT, "fake_delay_ms": 3000}
        async with a.client() as ca, httpx.AsyncClient(base_url=b.url, headers=headers, timeout=30) as cb:
            running = [asyncio.create_task(ca.post("/v1/chat/completions", json=slow)) for _ in range(2)]
            redis = Redis.from_url(redis_server.url)
            try:
                await until(lambda: _count(redis, 2), "the tenant's two leases held on replica a")
            finally:
                await redis.aclose()
            started = time.monotonic()
            now_or_never = await cb.post(
                "/v1/chat/completions", json=CHAT, headers={"x-llamagate-max-wait": "0"}
            )
            took = time.monotonic() - started
            assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
        assert now_or_never.status_code == 429, now_or_never.text
        assert took < 1.0, took
        assert "own maximum wait" in now_or_never.json()["error"]["message"]


async def test_an_interactive_request_overtakes_a_waiting_batch_one_across_replicas(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    """Priorities with aging hold in the shared line as in one gate: a batch request waiting on replica
    a for the tenant's one lease is passed by an interactive request that arrives later on replica b
    (well within the 10 s aging bound), and both are served. The batch request waits on the replica
    whose lease is freed, so it is woken first: only the line's order puts the other one first."""
    tenants = (TenantSettings("team", max_concurrency=1, max_queue=8, queue_timeout_s=20, priority=10),)
    _, settings = await _pair(proxy_factory, redis_server, tenants)
    finished: list[str] = []

    async def post(client: httpx.AsyncClient, name: str, priority: str) -> int:
        r = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "fake_delay_ms": 400},
            headers={"x-llamagate-priority": priority},
        )
        finished.append(name)
        return r.status_code

    async with proxy_factory(**settings) as a, proxy_factory(**settings) as b:
        b.state.reload(a.settings)
        headers = {"authorization": f"Bearer {a.keys['user']}"}
        redis = Redis.from_url(redis_server.url)
        try:
            async with a.client() as ca, httpx.AsyncClient(base_url=b.url, headers=headers, timeout=30) as cb:
                first = asyncio.create_task(post(ca, "first", "interactive"))
                await until(lambda: _count(redis, 1), "the tenant's one lease held")
                batch = asyncio.create_task(post(ca, "batch", "batch"))
                await until(lambda: _queued(redis, 1), "the batch request waiting in the shared line")
                interactive = asyncio.create_task(post(cb, "interactive", "interactive"))
                await until(lambda: _queued(redis, 2), "the interactive request waiting too")
                assert await asyncio.gather(first, batch, interactive) == [200, 200, 200]
        finally:
            await redis.aclose()
        assert finished == ["first", "interactive", "batch"]


async def _queued(redis: Redis, n: int) -> bool:
    waiting = 0
    async for key in redis.scan_iter("llamagate:{team}:queue:*"):
        waiting += await redis.zcard(key)
    return waiting == n


async def test_rate_limit_headers_of_one_replica_count_tokens_spent_through_another(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    from proxy.settings import BudgetSettings

    limit = 100_000
    tenants = (
        TenantSettings("team", max_concurrency=2, budgets=BudgetSettings(tokens_per_minute=limit)),
        *TENANTS[1:],
    )
    _, settings = await _pair(proxy_factory, redis_server, tenants)
    async with proxy_factory(**settings) as a, proxy_factory(**settings) as b:
        b.state.reload(a.settings)
        headers = {"authorization": f"Bearer {a.keys['user']}"}
        redis = Redis.from_url(redis_server.url)
        try:
            async with a.client() as ca, httpx.AsyncClient(base_url=b.url, headers=headers, timeout=30) as cb:
                first = await ca.post("/v1/chat/completions", json=CHAT)
                assert first.status_code == 200
                usage = first.json()["usage"]
                spent = usage["prompt_tokens"] + usage["completion_tokens"]
                # Nothing was spent before it: what it shows left is the limit less its own reserve.
                reserve = limit - int(first.headers["x-ratelimit-remaining-tokens"])
                assert reserve > 0

                async def charged() -> bool:  # the charge reaches Redis off the request's path
                    return await _window_tokens(redis) == spent

                await until(charged, "replica a's charge in the shared window")
                second = await cb.post("/v1/chat/completions", json=CHAT)
        finally:
            await redis.aclose()
        assert second.status_code == 200
        assert int(second.headers["x-ratelimit-limit-tokens"]) == limit
        # Replica b alone has seen no token spent: its own figure would be limit - reserve.
        assert int(second.headers["x-ratelimit-remaining-tokens"]) == limit - reserve - spent


async def _window_tokens(redis: Redis) -> int:
    amounts = await redis.hvals("llamagate:{team}:budget:tenant:team:tokens_per_minute")
    return sum(int(v) for v in amounts)


async def test_shared_windows_survive_a_restart_of_every_replica(
    proxy_factory: ProxyFactory, redis_server: RedisServer
) -> None:
    """The windows live in Redis: replicas that all restart (no store) still find the requests counted."""
    from proxy.settings import BudgetSettings

    tenants = (
        TenantSettings("team", max_concurrency=2, budgets=BudgetSettings(requests_per_minute=2)),
        *TENANTS[1:],
    )
    _, settings = await _pair(proxy_factory, redis_server, tenants)
    async with proxy_factory(**settings) as a, a.client() as ca:
        statuses = [(await ca.post("/v1/chat/completions", json=CHAT)).status_code for _ in range(2)]
        assert statuses == [200, 200]
        keys, key = a.settings, a.keys["user"]
    async with proxy_factory(**settings) as again:
        again.state.reload(keys)
        headers = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=again.url, headers=headers, timeout=30) as c:
            refused = await c.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "requests_per_minute"
