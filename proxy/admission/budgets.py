"""This replica's budgets as a step of the admission pipeline (``proxy.admission.pipeline``): the first
step a request meets, so a spent budget is a 429 before any queue, lease or slot.

A request's ``Ticket`` is admitted by ``Budgets.admit`` (its reserve held, its request counted) or
refused with the 429 of the spent budget; either way the answer carries the budgets' rate-limit headers
(``Grant.show``). The hold charges the request's tokens when it ends (``Budgets.charge``), or gives
the reserve back when it used none.
"""

from __future__ import annotations

import time

from proxy.accounts.budgets import Budgets, Refusal, Ticket
from proxy.admission.pipeline import Ask, Grant, Spent


class BudgetStep:
    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets

    async def take(self, ask: Ask, grant: Grant) -> BudgetHold:
        ticket = Ticket(ask.tenant.name, ask.key_id, ask.reserve, ask.key_budgets)
        now = time.time()
        got = self.budgets.admit(ticket, now)
        if isinstance(got, Refusal):
            grant.show(self.budgets.header_lines(ticket.tenant, ticket.key_id, now, ticket.key_budgets))
            raise got.error()
        grant.show(ticket.headers)
        return BudgetHold(self.budgets, ticket)


class BudgetHold:
    __slots__ = ("budgets", "ticket")

    def __init__(self, budgets: Budgets, ticket: Ticket) -> None:
        self.budgets, self.ticket = budgets, ticket

    def close(self, spent: Spent | None) -> None:
        # ``Budgets.charge`` settles a ticket once: a second close does nothing.
        if spent is None:
            self.budgets.release(self.ticket, time.time())
        else:
            self.budgets.charge(self.ticket, spent.tokens, spent.at)
