"""The admission pipeline's steps shared with the other replicas (``proxy.admission.pipeline``), present
only with ``cluster.redis_url``: the budgets as every replica counts them (``SharedBudgetStep``) and the
tenant's concurrency as leases (``LeaseStep``). Both wait, refuse and degrade as their modules say
(``proxy.cluster.budgets``, ``proxy.cluster.limiter``); here they only meet the pipeline's interface.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proxy.accounts.budgets import RateHeaders
from proxy.accounts.budgets import rate_limit_headers as budget_headers
from proxy.admission.pipeline import Ask, Grant, Spent
from proxy.cluster.budgets import Checked, SharedBudgets, SharedTicket
from proxy.cluster.limiter import ClusterLease, ClusterLimiter
from proxy.errors import Rejected

# Seconds until a tenant's slot of a model is likely free, as this replica's gate has seen its requests
# take: the Retry-After of a refusal in the shared line, which knows no service times.
EstimateWait = Callable[[str, str], float]


class SharedBudgetStep:
    def __init__(self, shared: SharedBudgets) -> None:
        self.shared = shared

    async def take(self, ask: Ask, grant: Grant) -> _SharedHold:
        tenant = ask.tenant
        checked = await self.shared.check(
            tenant.name, tenant.budgets, ask.key_id, ask.key_budgets, ask.reserve
        )
        if checked is None:
            return _SharedHold(self.shared, None)
        grant.show(rate_limit_headers(checked))  # the cluster's figures, in place of this replica's
        if checked.refusal is not None:
            raise checked.refusal.error()
        return _SharedHold(self.shared, checked.ticket)


class _SharedHold:
    __slots__ = ("_shared", "_ticket")

    def __init__(self, shared: SharedBudgets, ticket: SharedTicket | None) -> None:
        self._shared, self._ticket = shared, ticket

    def close(self, spent: Spent | None) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            self._shared.charge(ticket, 0 if spent is None else spent.tokens)


class LeaseStep:
    def __init__(self, limiter: ClusterLimiter, estimate_wait: EstimateWait) -> None:
        self.limiter = limiter
        self._estimate_wait = estimate_wait

    async def take(self, ask: Ask, grant: Grant) -> ClusterLease:
        loop = asyncio.get_running_loop()
        started = loop.time()
        tenant = ask.tenant
        try:
            return await self.limiter.acquire(
                ask.model, tenant, ask.slots, level=ask.level, wait_s=grant.wait_left_s
            )
        except Rejected as exc:
            if exc.reason not in ("queue_full", "queue_timeout"):
                raise
            # The shared line knows no service times; this replica's gate knows the tenant's recent ones.
            # A client told "1 s" while a lease is held for minutes comes back (through a retrying
            # balancer, to every replica) dozens of times for nothing.
            wait_s = max(exc.retry_after_s, self._estimate_wait(ask.model, tenant.name))
            raise Rejected(exc.reason, wait_s, exc.message) from None
        finally:
            grant.waited(loop.time() - started)


def rate_limit_headers(checked: Checked) -> RateHeaders:
    """OpenAI's ``x-ratelimit-*`` headers from the cluster's figures, as ``proxy.accounts.budgets`` makes a
    replica's: per kind limit, remaining and reset, the kind of the first budget first."""
    kinds = (("tokens", checked.tokens), ("requests", checked.requests))
    if not checked.tokens_first:
        kinds = kinds[::-1]
    return [
        header
        for kind, figure in kinds
        if figure is not None
        for header in budget_headers(kind, figure.limit, figure.remaining, figure.reset_s)
    ]
