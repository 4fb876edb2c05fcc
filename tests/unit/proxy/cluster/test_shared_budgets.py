"""The budget windows in Redis (``proxy.cluster.budgets``) against a real redis-server: two limiters stand
for two replicas sharing a tenant's budgets; the same rules as the in-memory ``Budgets``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.accounts.budgets import Refusal
from proxy.cluster.budgets import SharedBudgets, SharedTicket
from proxy.cluster.limiter import ClusterLimiter
from proxy.errors import SharedLimitsUnavailable
from proxy.settings import BudgetSettings, ClusterSettings
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.needs_tool("redis-server")

TOKENS = BudgetSettings(tokens_per_minute=200)


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[tuple[SharedBudgets, SharedBudgets]]:
    limiters = [ClusterLimiter(ClusterSettings(redis_server.url, replicas=2)) for _ in range(2)]
    try:
        yield SharedBudgets(limiters[0], 60.0), SharedBudgets(limiters[1], 60.0)
    finally:
        for limiter in limiters:
            await limiter.aclose()


async def admit(
    b: SharedBudgets, budgets: BudgetSettings, reserve: int | None
) -> SharedTicket | Refusal | None:
    return await verdict(b, budgets, "k1", None, reserve)


async def verdict(
    b: SharedBudgets,
    budgets: BudgetSettings | None,
    key_id: str,
    key_budgets: BudgetSettings | None,
    reserve: int | None,
) -> SharedTicket | Refusal | None:
    checked = await b.check("t", budgets, key_id, key_budgets, reserve)
    return None if checked is None else checked.ticket or checked.refusal


async def test_reserves_are_held_across_replicas_then_one_overshoots(
    pair: tuple[SharedBudgets, SharedBudgets],
) -> None:
    a, b = pair
    held = [await admit(x, TOKENS, 64) for x in (a, b, a)]  # 3 x 64 = 192 <= 200
    over = await admit(b, TOKENS, 64)  # no room for its reserve, but below the limit: the one overshooter
    assert all(isinstance(t, SharedTicket) for t in (*held, over))
    refused = await admit(a, TOKENS, 64)  # the overshooter is taken and the others still run
    assert isinstance(refused, Refusal) and refused.budget == "tokens_per_minute" and refused.in_flight
    assert refused.retry_after_s >= 1.0
    for x, t in zip((a, b, a, b), (*held, over), strict=True):
        assert isinstance(t, SharedTicket)
        await x.send_charge(t, 64)  # charged: 256 used, nothing held
    spent = await admit(a, TOKENS, 1)
    assert isinstance(spent, Refusal) and not spent.in_flight and spent.used == 256
    assert 0 < spent.retry_after_s <= 61  # when enough of the minute's charges leave it


async def test_requests_per_minute_is_exact_across_replicas(
    pair: tuple[SharedBudgets, SharedBudgets],
) -> None:
    a, b = pair
    rpm = BudgetSettings(requests_per_minute=2)
    assert isinstance(await admit(a, rpm, None), SharedTicket)
    assert isinstance(await admit(b, rpm, None), SharedTicket)
    third = await admit(a, rpm, None)
    assert isinstance(third, Refusal) and third.budget == "requests_per_minute" and third.used == 2
    assert 0 < third.retry_after_s <= 61


async def test_a_key_budget_and_no_budget(pair: tuple[SharedBudgets, SharedBudgets]) -> None:
    a, b = pair
    assert await a.check("t", None, "k1", None, 64) is None  # nothing to ask Redis
    key = BudgetSettings(requests_per_minute=1)
    assert isinstance(await verdict(a, None, "k1", key, None), SharedTicket)
    refused = await verdict(b, None, "k1", key, None)
    assert isinstance(refused, Refusal) and refused.subject == "key"
    assert isinstance(await verdict(b, None, "k2", key, None), SharedTicket)  # another key


async def test_redis_down_local_leaves_it_to_the_replica_refuse_answers_503(
    redis_server: RedisServer,
) -> None:
    local = ClusterLimiter(ClusterSettings(redis_server.url, on_redis_error="local"))
    refuse = ClusterLimiter(ClusterSettings(redis_server.url, on_redis_error="refuse"))
    try:
        redis_server.kill()
        assert await SharedBudgets(local, 60.0).check("t", TOKENS, "k", None, 64) is None
        assert local.mode == "local"
        with pytest.raises(SharedLimitsUnavailable):
            await SharedBudgets(refuse, 60.0).check("t", TOKENS, "k", None, 64)
    finally:
        await local.aclose()
        await refuse.aclose()
