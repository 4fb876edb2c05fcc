"""``SharedBudgets``: the accounts' budget windows counted in Redis (``proxy.cluster.budget_scripts``), so a
tenant's and a key's budgets hold across the replicas. One script call per check and one per charge.

``proxy.routes.charge`` asks it beside the replica's own ``Budgets`` (which still keeps the windows the
store persists and the rate-limit headers say: figures of this replica). Only windows with a limit are
kept in Redis. While Redis is unreachable (the limiter's mode, ``proxy.cluster.limiter``): ``local``
leaves the replica's own budgets to decide alone (a tenant may then use up to its budget on each
replica); ``refuse`` answers 503 like the leases do.
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
from proxy.cluster.limiter import _PROBE_S, _REDIS_ERRORS, ClusterLimiter
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
    ) -> SharedTicket | Refusal | None:
        """Admitted (a ticket to charge), refused (the budget's ``Refusal``, as the replica's own budgets
        would give it), or None: nothing to ask Redis (no budget), or Redis unreachable under ``local``."""
        windows = self.windows(tenant, tenant_budgets, key_id, key_budgets)
        limiter = self._limiter
        if not windows or limiter.mode == "local":
            return None
        if limiter.mode == "refuse":
            raise SharedLimitsUnavailable(
                "the shared budgets (Redis) are unreachable and cluster.on_redis_error is refuse; "
                "retry later",
                _PROBE_S,
            )
        ticket = secrets.token_hex(8)
        args: list[Any] = [ticket, reserve or 0, self._hold_ms, len(windows)]
        for w in windows:
            args += w.args
        try:
            async with asyncio.timeout(limiter._call_s):
                answer = await self._check(keys=[w.key for w in windows], args=args)
        except _REDIS_ERRORS as exc:
            limiter._lost(exc)
            return await self.check(tenant, tenant_budgets, key_id, key_budgets, reserve)
        if int(answer[0]) == 1:
            tokens = tuple(w for w in windows if w.budget != "requests_per_minute")
            return SharedTicket(ticket, tokens)
        _, index, retry_ms, used, in_flight = (int(v) for v in answer)
        w = windows[index - 1]
        return Refusal(w.subject, w.name, w.budget, w.limit, used, retry_ms / 1000, in_flight=bool(in_flight))

    def charge(self, ticket: SharedTicket, tokens: int) -> None:
        """The request's real usage (0: none), off the request's path; frees its holds."""
        if ticket.tokens:
            self._limiter._spawn(self._send_charge(ticket, tokens))

    async def _send_charge(self, ticket: SharedTicket, tokens: int) -> None:
        args: list[Any] = [ticket.ticket, tokens]
        for w in ticket.tokens:
            _, span, width, _ = w.args
            args += [span, width]
        try:
            async with asyncio.timeout(self._limiter._call_s):
                await self._charge(keys=[w.key for w in ticket.tokens], args=args)
        except _REDIS_ERRORS as exc:
            self._limiter._lost(exc)  # its holds expire by themselves; the tokens go uncounted here
