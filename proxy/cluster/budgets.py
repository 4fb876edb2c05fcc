"""``SharedBudgets``: the accounts' budget windows counted in Redis (``proxy.cluster.budget_scripts``), so a
tenant's and a key's budgets hold across the replicas. One script call per check and one per charge.

A step of the admission pipeline (``proxy.cluster.steps``), after the replica's own ``Budgets`` (which
still keep the windows the store persists, and decide alone while Redis is unreachable). Only windows
with a limit are kept in Redis. The rate-limit headers of an answer are the cluster-wide figures the
check returns (every replica's requests counted), not this replica's. While Redis is unreachable (the
limiter's mode, ``proxy.cluster.limiter``): ``local`` leaves the replica's own budgets to decide alone
(a tenant may then use up to its budget on each replica; the headers show the replica's figures);
``refuse`` answers 503 like the leases do.

What a restart loses: nothing of the windows when replicas restart (they live in Redis; a dead
replica's holds expire after a request's longest life, ``timeouts.total_s``). When Redis itself
restarts, the windows are Redis's data: kept when Redis persists (``appendonly yes``, docs/deploy.md),
else they start empty, which can let a tenant spend up to one window's budget again (at most a minute's,
or a day's for ``tokens_per_day``); the store's ledger keeps every charge either way.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any

from proxy.accounts.budgets import Refusal
from proxy.accounts.records import BUDGET_NAMES, BudgetName, Subject
from proxy.cluster.budget_scripts import CHARGE, CHECK
from proxy.cluster.leases import PREFIX
from proxy.cluster.limiter import REDIS_ERRORS, ClusterLimiter
from proxy.errors import SharedLimitsUnavailable
from proxy.settings import BudgetSettings

# (span, bucket width) in ms, per budget, as ``proxy.accounts.budgets.SPANS``: a minute exact (each charge
# its own entry, so Retry-After is never more than 60 s), a day in one-minute buckets.
SPANS_MS: dict[BudgetName, tuple[int, int]] = {
    "tokens_per_minute": (60_000, 0),
    "tokens_per_day": (86_400_000, 60_000),
    "requests_per_minute": (60_000, 0),
}


@dataclass(frozen=True, slots=True)
class SharedWindow:
    subject: Subject
    name: str
    budget: BudgetName
    limit: int
    key: str

    @property
    def args(self) -> tuple[int, int, int, str]:
        span, width = SPANS_MS[self.budget]
        return self.limit, span, width, "r" if self.budget == "requests_per_minute" else "t"


@dataclass(frozen=True, slots=True)
class SharedTicket:
    ticket: str
    tokens: tuple[SharedWindow, ...]  # the token windows it is charged into


@dataclass(frozen=True, slots=True)
class Figure:
    """One kind's rate-limit header figures: what is left, of what limit, and when the window resets."""

    remaining: int
    limit: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Checked:
    """The answer of a check: admitted (``ticket``) or refused (``refusal``), with the cluster-wide
    header figures (None: no such budget); the first of the request's budgets is a token one or not."""

    ticket: SharedTicket | None
    refusal: Refusal | None
    tokens: Figure | None
    requests: Figure | None
    tokens_first: bool


class SharedBudgets:
    def __init__(self, limiter: ClusterLimiter, hold_s: float) -> None:
        self._limiter = limiter
        client = limiter.leases.client
        self._check = client.register_script(CHECK)
        self._charge = client.register_script(CHARGE)
        self._hold_ms = max(1000, round(hold_s * 1000))

    @staticmethod
    def windows(
        tenant: str, tenant_budgets: BudgetSettings | None, key_id: str, key_budgets: BudgetSettings | None
    ) -> tuple[SharedWindow, ...]:
        out: list[SharedWindow] = []
        subjects: tuple[tuple[Subject, str, BudgetSettings | None], ...] = (
            ("tenant", tenant, tenant_budgets),
            ("key", key_id, key_budgets),
        )
        for subject, name, budgets in subjects:
            if budgets is None:
                continue
            for budget in BUDGET_NAMES:
                limit: int | None = getattr(budgets, budget)
                if limit is not None:
                    key = f"{PREFIX}:{{{tenant}}}:budget:{subject}:{name}:{budget}"
                    out.append(SharedWindow(subject, name, budget, limit, key))
        return tuple(out)

    async def check(
        self,
        tenant: str,
        tenant_budgets: BudgetSettings | None,
        key_id: str,
        key_budgets: BudgetSettings | None,
        reserve: int | None,
    ) -> Checked | None:
        """Admitted or refused as every replica's requests count together; None: nothing to ask Redis
        (no budget), or Redis unreachable under ``local``."""
        windows = self.windows(tenant, tenant_budgets, key_id, key_budgets)
        limiter = self._limiter
        if not windows or limiter.mode == "local":
            return None
        if limiter.mode == "refuse":
            raise SharedLimitsUnavailable(
                "the shared budgets (Redis) are unreachable and cluster.on_redis_error is refuse; "
                "retry later",
                limiter.probe_s,
            )
        ticket = secrets.token_hex(8)
        args: list[Any] = [ticket, reserve or 0, self._hold_ms, len(windows)]
        for w in windows:
            args += w.args
        try:
            async with asyncio.timeout(limiter.call_s):
                answer = await self._check(keys=[w.key for w in windows], args=args)
        except REDIS_ERRORS as exc:
            limiter.lost(exc)
            return await self.check(tenant, tenant_budgets, key_id, key_budgets, reserve)
        ok, index, retry_ms, used, in_flight, *figures = (int(v) for v in answer)
        tokens, requests = _figure(*figures[:3]), _figure(*figures[3:])
        first = windows[0].budget != "requests_per_minute"
        if ok == 1:
            charged = tuple(w for w in windows if w.budget != "requests_per_minute")
            return Checked(SharedTicket(ticket, charged), None, tokens, requests, first)
        w = windows[index - 1]
        refusal = Refusal(w.subject, w.name, w.budget, w.limit, used, retry_ms / 1000, bool(in_flight))
        return Checked(None, refusal, tokens, requests, first)

    def charge(self, ticket: SharedTicket, tokens: int) -> None:
        """The request's real usage (0: none), off the request's path; frees its holds."""
        if ticket.tokens:
            self._limiter.spawn(self.send_charge(ticket, tokens))

    async def send_charge(self, ticket: SharedTicket, tokens: int) -> None:
        """``charge``, awaited: the script call itself."""
        args: list[Any] = [ticket.ticket, tokens]
        for w in ticket.tokens:
            _, span, width, _ = w.args
            args += [span, width]
        try:
            async with asyncio.timeout(self._limiter.call_s):
                await self._charge(keys=[w.key for w in ticket.tokens], args=args)
        except REDIS_ERRORS as exc:
            self._limiter.lost(exc)  # its holds expire by themselves; the tokens go uncounted here


def _figure(remaining: int, limit: int, reset_ms: int) -> Figure | None:
    return Figure(remaining, limit, reset_ms / 1000) if limit >= 0 else None
