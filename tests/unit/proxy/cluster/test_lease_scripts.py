"""The lease scripts (``proxy.cluster.scripts``) against a real redis-server: count, expiry, renew,
release, the fair line across callers, the total across models."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from proxy.cluster.leases import TOTAL, Group, LeaseAsk, RedisLeases

pytestmark = pytest.mark.needs_tool("redis-server")

TTL_MS = 10_000


def ask(member: str, limit: int = 2, slots: int = 1, max_queue: int = 8, model: str = "m") -> LeaseAsk:
    return LeaseAsk(member, slots, (Group("t", model, limit),), max_queue)


async def until(pred: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


async def test_counts_up_to_the_limit_and_puts_the_next_in_line(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    assert (await leases.acquire(ask("a"), TTL_MS))[0] == "granted"
    assert (await leases.acquire(ask("b"), TTL_MS))[0] == "granted"
    outcome, soonest = await leases.acquire(ask("c"), TTL_MS)
    assert outcome == "wait"
    assert 0 < soonest <= TTL_MS / 1000
    assert await leases.count(Group("t", "m", 2)) == 2


async def test_a_wide_request_takes_one_lease_per_slot(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    assert (await leases.acquire(ask("a", limit=3, slots=2), TTL_MS))[0] == "granted"
    assert await leases.count(Group("t", "m", 3)) == 2
    assert (await leases.acquire(ask("b", limit=3, slots=2), TTL_MS))[0] == "wait"
    assert (await leases.acquire(ask("c", limit=3, slots=1), TTL_MS))[0] == "wait"  # behind b: fair


async def test_release_frees_at_once(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    for m in "ab":
        await leases.acquire(ask(m), TTL_MS)
    assert (await leases.acquire(ask("c"), TTL_MS))[0] == "wait"
    await leases.release(ask("a"))
    assert (await leases.acquire(ask("c"), TTL_MS))[0] == "granted"


async def test_an_unrenewed_lease_expires_within_its_ttl(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    started = time.monotonic()
    await leases.acquire(ask("a"), 300)  # a dead replica's: never renewed
    await leases.acquire(ask("b"), TTL_MS)  # a live one's (it keeps the key itself alive)
    assert (await leases.acquire(ask("c"), TTL_MS))[0] == "wait"

    async def granted() -> bool:
        return (await leases.acquire(ask("c"), TTL_MS))[0] == "granted"

    await until(granted, "the dead lease to expire")
    assert time.monotonic() - started >= 0.3  # not before the TTL: they counted until then


async def test_renewed_leases_outlive_their_ttl(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    held = [ask("a"), ask("b")]
    for a in held:
        await leases.acquire(a, 300)
    end = time.monotonic() + 1.0  # more than three TTLs
    while time.monotonic() < end:
        assert await leases.renew(held, 300) == 2
        assert (await leases.acquire(ask("c"), TTL_MS))[0] == "wait"
        await asyncio.sleep(0.05)


async def test_renew_puts_back_leases_redis_lost(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    held = [ask("a"), ask("b")]
    for a in held:
        await leases.acquire(a, TTL_MS)
    await redis_client.flushall()  # a Redis that restarted empty
    assert (await leases.acquire(ask("c"), TTL_MS))[0] == "granted"
    await leases.release(ask("c"))
    await leases.renew(held, TTL_MS)  # the requests holding them still run: they count again
    assert (await leases.acquire(ask("c"), TTL_MS))[0] == "wait"


async def test_the_line_is_first_come_first_served_across_callers(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    for m in "ab":
        await leases.acquire(ask(m), TTL_MS)
    assert (await leases.acquire(ask("first"), TTL_MS))[0] == "wait"
    assert (await leases.acquire(ask("second"), TTL_MS))[0] == "wait"
    await leases.release(ask("a"))
    # The second asks first (another replica, a shorter backoff): the freed lease is not its.
    assert (await leases.acquire(ask("second"), TTL_MS))[0] == "wait"
    assert (await leases.acquire(ask("first"), TTL_MS))[0] == "granted"
    await leases.release(ask("b"))
    assert (await leases.acquire(ask("second"), TTL_MS))[0] == "granted"


async def test_a_waiter_that_stops_asking_leaves_the_line(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    for m in "ab":
        await leases.acquire(ask(m), TTL_MS)
    assert (await leases.acquire(ask("gone"), 300))[0] == "wait"  # its replica dies here
    assert (await leases.acquire(ask("next"), TTL_MS))[0] == "wait"
    await leases.release(ask("a"))

    async def granted() -> bool:
        return (await leases.acquire(ask("next"), TTL_MS))[0] == "granted"

    await until(granted, "the dead waiter to leave the line")


async def test_a_full_line_refuses(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    for m in "ab":
        await leases.acquire(ask(m, max_queue=1), TTL_MS)
    assert (await leases.acquire(ask("c", max_queue=1), TTL_MS))[0] == "wait"
    assert (await leases.acquire(ask("d", max_queue=1), TTL_MS))[0] == "full"
    assert (await leases.acquire(ask("c", max_queue=1), TTL_MS))[0] == "wait"  # keeps its place
    assert (await leases.acquire(ask("e", max_queue=0), TTL_MS))[0] == "full"


async def test_the_total_holds_across_models(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)

    def both(member: str, model: str) -> LeaseAsk:
        return LeaseAsk(member, 1, (Group("t", model, 2), Group("t", TOTAL, 2)), 8)

    assert (await leases.acquire(both("a", "x"), TTL_MS))[0] == "granted"
    assert (await leases.acquire(both("b", "y"), TTL_MS))[0] == "granted"
    assert (await leases.acquire(both("c", "x"), TTL_MS))[0] == "wait"  # x has room, the total has none
    await leases.release(both("b", "y"))
    assert (await leases.acquire(both("c", "x"), TTL_MS))[0] == "granted"


async def test_tenants_do_not_share_leases(redis_client: Redis) -> None:
    leases = RedisLeases(redis_client)
    for m in "ab":
        await leases.acquire(ask(m, limit=2), TTL_MS)
    other = LeaseAsk("z", 1, (Group("u", "m", 2),), 8)
    assert (await leases.acquire(other, TTL_MS))[0] == "granted"
