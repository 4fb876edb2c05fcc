"""One set of budget rules: the in-memory ``Budgets`` (``proxy.accounts.budgets``) and the Lua scripts that
count the same budgets in Redis for the replicas (``proxy.cluster.budget_scripts``) are driven with the
same random admissions and charges, and must agree on every decision (admitted or refused, and which
subject's budget refused) and on the rate-limit figures an admitted request's answer shows.

Seeded, so a failure names its seed and reproduces. Every trial runs in well under a minute, so no window
expires in between: the rules compared are admission, holds, the overshooter and the counts.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator

import pytest

from proxy.accounts.budgets import Budgets, Refusal, Ticket
from proxy.cluster.budgets import SharedBudgets, SharedTicket
from proxy.cluster.limiter import ClusterLimiter
from proxy.cluster.steps import rate_limit_headers
from proxy.settings import BudgetSettings, ClusterSettings
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.needs_tool("redis-server")

TRIALS = 30
STEPS = 40
# Figures from small sets of round numbers: sums meet the limits exactly as often as they pass them, so
# every boundary of the rules (``<=`` against ``<``) is crossed in some trial.


@pytest.fixture
async def shared(redis_server: RedisServer) -> AsyncIterator[SharedBudgets]:
    limiter = ClusterLimiter(ClusterSettings(redis_server.url, replicas=2))
    try:
        yield SharedBudgets(limiter, 60.0)
    finally:
        await limiter.aclose()


def _budgets(rng: random.Random) -> BudgetSettings:
    return BudgetSettings(
        tokens_per_minute=rng.choice([None, 40, 60, 100, 150]),
        tokens_per_day=rng.choice([None, None, 100, 200]),
        requests_per_minute=rng.choice([None, 1, 3, 6]),
    )


def _figures(headers: list[tuple[bytes, bytes]]) -> dict[bytes, int]:
    """The limit and remaining figures of rate-limit headers (resets depend on the clock)."""
    wanted = (b"x-ratelimit-limit-", b"x-ratelimit-remaining-")
    return {name: int(value) for name, value in headers if name.startswith(wanted)}


@pytest.mark.parametrize("seed", range(TRIALS))
async def test_python_and_lua_budgets_decide_alike(shared: SharedBudgets, seed: int) -> None:
    rng = random.Random(seed)
    tenant, key = f"t{seed}", f"k{seed}"
    tenant_budgets, key_budgets = _budgets(rng), rng.choice([None, _budgets(rng)])
    local = Budgets({tenant: tenant_budgets})
    running: list[tuple[Ticket, SharedTicket]] = []
    for step in range(STEPS):
        where = f"seed {seed} step {step} ({tenant_budgets}, key {key_budgets})"
        if running and rng.random() < 0.45:
            ticket, remote = running.pop(rng.randrange(len(running)))
            tokens = rng.choice([0, 10, 20, 30, 50])
            local.charge(ticket, tokens, time.time())
            await shared.send_charge(remote, tokens)
            continue
        reserve = rng.choice([None, 10, 20, 30, 50])
        ticket = Ticket(tenant, key, reserve, key_budgets)
        mine = local.admit(ticket, time.time())
        theirs = await shared.check(tenant, tenant_budgets, key, key_budgets, reserve)
        if theirs is None:  # no budget at all: nothing to ask Redis
            assert tenant_budgets == BudgetSettings() and key_budgets in (None, BudgetSettings()), where
            assert not isinstance(mine, Refusal), where
            continue
        if isinstance(mine, Refusal):
            assert theirs.refusal is not None, f"{where}: Python refused ({mine.budget}), Lua admitted"
            assert theirs.refusal.in_flight == mine.in_flight, where
            continue
        assert theirs.ticket is not None, f"{where}: Lua refused ({theirs.refusal}), Python admitted"
        assert _figures(rate_limit_headers(theirs)) == _figures(ticket.headers), where
        running.append((ticket, theirs.ticket))
