"""``ClusterLimiter`` with a real redis-server: two limiters stand for two replicas. The shared limit,
the fair wait, the deadline, a cancelled waiter, and Redis killed and back (local and refuse)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from proxy.cluster.limiter import ClusterLimiter
from proxy.errors import Rejected, SharedLimitsUnavailable
from proxy.settings import ClusterFallback, ClusterSettings, TenantSettings
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.needs_tool("redis-server")

TENANT = TenantSettings("t", max_concurrency=2, max_queue=8, queue_timeout_s=30.0)


async def until(pred: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


Make = Callable[..., Awaitable[ClusterLimiter]]


@pytest.fixture
async def make(redis_server: RedisServer) -> AsyncIterator[Make]:
    made: list[ClusterLimiter] = []

    async def factory(
        on_redis_error: ClusterFallback = "local", replicas: int = 2, ttl_s: float = 3.0
    ) -> ClusterLimiter:
        limiter = ClusterLimiter(
            ClusterSettings(
                redis_server.url, replicas=replicas, on_redis_error=on_redis_error, lease_ttl_s=ttl_s
            )
        )
        made.append(limiter)
        return limiter

    yield factory
    for limiter in made:
        await limiter.aclose()


async def test_two_replicas_never_hold_more_than_the_limit_and_waiters_get_freed_leases(make: Make) -> None:
    replicas = [await make(), await make()]
    held = 0
    most = 0

    async def request(i: int) -> None:
        nonlocal held, most
        lease = await replicas[i % 2].acquire("m", TENANT, 1)
        held += 1
        most = max(most, held)
        await asyncio.sleep(0.05)
        held -= 1
        lease.release()

    await asyncio.gather(*(request(i) for i in range(8)))
    assert most == 2  # the limit was reached, never passed, across both
    await until(lambda: all(r.held == 0 for r in replicas), "every lease released")


async def test_a_waiter_gives_up_at_its_deadline(make: Make) -> None:
    a, b = await make(), await make()
    short = TenantSettings("t", max_concurrency=1, queue_timeout_s=0.3)
    lease = await a.acquire("m", short, 1)
    with pytest.raises(Rejected) as refused:
        await b.acquire("m", short, 1)
    assert refused.value.reason == "queue_timeout"
    assert "retry-after" in refused.value.headers
    lease.release()
    # Its place in line was given back: the next one is granted at once.
    await until(lambda: a.held == 0, "the lease released")
    (await b.acquire("m", short, 1)).release()


async def test_a_cancelled_waiter_leaves_the_line(make: Make) -> None:
    a, b = await make(), await make()
    one = TenantSettings("t", max_concurrency=1, max_queue=1)
    lease = await a.acquire("m", one, 1)
    waiter = asyncio.create_task(b.acquire("m", one, 1))
    await asyncio.sleep(0.1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await until(lambda: not b._tasks, "the place given back")
    # The line (max_queue 1) has room again: another waiter may queue, and gets the lease.
    other = asyncio.create_task(b.acquire("m", one, 1))
    await asyncio.sleep(0.1)
    lease.release()
    (await asyncio.wait_for(other, 10)).release()


async def test_redis_killed_local_fallback_then_cluster_again(
    make: Make, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # One replica in the set: its local share is the whole limit of 2.
    limiter = await make("local", replicas=1)
    short = TenantSettings("t", max_concurrency=2, queue_timeout_s=0.2)
    running = await limiter.acquire("m", TENANT, 1)
    assert limiter.mode == "cluster"
    await asyncio.gather(*(limiter.leases.ping() for _ in range(6)))  # a pool of several connections
    redis_server.kill()
    caplog.set_level(logging.INFO, logger="llamagate.cluster")
    # Local limits: 2 // 1 replica = 2, the request running on its Redis lease counted: one more, at once
    # (no hang on the dead Redis).
    first = await asyncio.wait_for(limiter.acquire("m", TENANT, 1), 5)
    assert limiter.mode == "local"
    assert first.local
    with pytest.raises(Rejected):
        await limiter.acquire("m", short, 1)
    for _ in range(5):
        with pytest.raises(Rejected):
            await limiter.acquire("m", short, 1)
    lost = [r for r in caplog.records if "Redis unreachable" in r.getMessage()]
    assert len(lost) == 1  # one line for the switch, not one per request

    redis_server.start()  # same port, empty
    await until(lambda: limiter.mode == "cluster", "cluster mode back")
    assert [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
    # Both requests that ran through the outage count in Redis again (the one admitted under the
    # fallback too): the limit of 2 is reached, a third waits.
    assert not first.local
    another = await make("local", replicas=2)  # another replica sees them
    with pytest.raises(Rejected):
        await another.acquire("m", short, 1)
    first.release()
    (await another.acquire("m", TENANT, 1)).release()
    running.release()
    # Its pooled connections, which the dead Redis closed, are made again: no second switch.
    wide = TenantSettings("t", max_concurrency=6)
    for _ in range(3):
        for lease in await asyncio.gather(*(limiter.acquire("m", wide, 1) for _ in range(4))):
            lease.release()
    await until(lambda: not limiter._tasks, "the releases done")
    assert limiter.mode == "cluster"
    assert len([r for r in caplog.records if "Redis unreachable" in r.getMessage()]) == 1


async def test_the_local_fallback_counts_requests_running_on_redis_leases(
    make: Make, redis_server: RedisServer
) -> None:
    """A tenant limited to 2 across 2 replicas: each replica's share under the fallback is 1, and a
    request still running on a lease Redis granted before it died is that 1 (an outside chaos run saw a
    replica at 2 when only the fallback's own requests counted)."""
    limiter = await make("local", replicas=2)
    short = TenantSettings("t", max_concurrency=2, queue_timeout_s=0.2)
    running = await limiter.acquire("m", short, 1)
    assert not running.local
    redis_server.kill()
    with pytest.raises(Rejected):
        await asyncio.wait_for(limiter.acquire("m", short, 1), 5)
    assert limiter.mode == "local"
    running.release()
    fallback = await asyncio.wait_for(limiter.acquire("m", short, 1), 5)
    assert fallback.local
    with pytest.raises(Rejected):
        await limiter.acquire("m", short, 1)
    fallback.release()


async def test_redis_killed_refuse_answers_503_with_retry_after(
    make: Make, redis_server: RedisServer
) -> None:
    limiter = await make("refuse")
    redis_server.kill()
    with pytest.raises(SharedLimitsUnavailable) as refused:
        await asyncio.wait_for(limiter.acquire("m", TENANT, 1), 5)
    assert refused.value.status == 503
    assert int(refused.value.headers["retry-after"]) >= 1
    assert limiter.mode == "refuse"
    redis_server.start()
    await until(lambda: limiter.mode == "cluster", "cluster mode back")
    (await limiter.acquire("m", TENANT, 1)).release()


async def test_held_leases_are_renewed_past_their_ttl(make: Make) -> None:
    a, b = await make(ttl_s=1.0), await make(ttl_s=1.0)
    one = TenantSettings("t", max_concurrency=1, queue_timeout_s=0.2)
    lease = await a.acquire("m", one, 1)
    end = time.monotonic() + 2.5  # well past the TTL: the renewer keeps it
    while time.monotonic() < end:
        with pytest.raises(Rejected):
            await b.acquire("m", one, 1)
    lease.release()
    await until(lambda: a.held == 0, "released")
    (await b.acquire("m", TenantSettings("t", max_concurrency=1), 1)).release()


def test_the_lease_benchmark_runs_and_reports_each_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.benchmarks import cli, lease

    out = tmp_path / "lease.json"
    argv = ["--requests", "30", "--concurrency", "3", "--out", str(out)]
    assert cli.run("lease", None, lease.add_arguments, lease.handle, argv) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"sequential", "concurrent_3"}
    assert all(figures["p50_ms"] > 0 for figures in results.values())
    assert "lease admission, sequential: p50" in capsys.readouterr().out


async def test_a_renewal_that_lands_after_its_release_is_undone(
    make: Make, redis_server: RedisServer
) -> None:
    from redis.asyncio import Redis

    limiter = await make()
    lease = await limiter.acquire("m", TENANT, 1)
    lease.release()
    await until(lambda: not limiter._tasks, "the release done")
    # A renewal sent just before the release, arriving after it (another connection): the lease is back.
    await limiter._renew_now([lease.ask])
    client = Redis.from_url(redis_server.url)
    try:
        key = lease.ask.groups[0].key
        # Well before its TTL (3 s) would end it: released again, not left to count.
        deadline = time.monotonic() + 1.5
        while await client.zcard(key) and time.monotonic() < deadline:  # noqa: ASYNC110 - polling Redis
            await asyncio.sleep(0.02)
        assert await client.zcard(key) == 0
    finally:
        await client.aclose()


async def test_a_hung_redis_costs_a_request_one_timeout_then_the_fallback_answers(
    redis_server: RedisServer,
) -> None:
    # redis-py retries a timed-out call by default; the limiter retries a broken connection only.
    timeout_s = 0.5
    limiter = ClusterLimiter(ClusterSettings(redis_server.url, replicas=1, socket_timeout_s=timeout_s))
    try:
        (await limiter.acquire("m", TENANT, 1)).release()  # a pooled connection, as in service
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)  # hung: the connection stays, nothing answers
        try:
            started = time.monotonic()
            lease = await limiter.acquire("m", TENANT, 1)
            took = time.monotonic() - started
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert lease.local and limiter.mode == "local"
        assert took < 2 * timeout_s, took  # one timeout, not one per try
        lease.release()
    finally:
        await limiter.aclose()
