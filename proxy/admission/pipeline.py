"""One admission pipeline: every limit a generation request passes, behind one interface.

A request is described once (``Ask``: tenant, key, model, slots, reserve, priority, max wait, and its own
prompt check) and handed to each step in turn, with what the pipeline has given it so far (``Grant``: its
holds, its slot, what it has waited). Each step is a ``Step``: ``take(ask, grant)`` returns a ``Hold`` or
raises the refusal (400, 429 or 503) that names the limit; a step that waits (a queue, a lease) waits at
most what the request has left of its wait (``Grant.wait_left_s``). Every hold is closed exactly once:
``close(spent)`` charges what the request used (``Spent``: its tokens), ``close(None)`` gives the hold
back. A hold that does not count tokens (a slot, a lease, a tenant's total) treats both the same.

The steps, one ordered list built by the door's state (``proxy.state``; again on reload), in the order a
request meets them (cheapest refusal first, and nothing that holds a slot while it waits for something
else):

1. the budgets kept by this replica (``proxy.admission.budgets``: a store's, or in memory without one);
2. with ``cluster.redis_url``, the same budgets as every replica counts them together in Redis
   (``proxy.cluster.steps``);
3. the request's own check against its child, when its tenant asks for one (``PromptCheck``: the
   prompt's size, a 400 before any wait);
4. the tenant's total across models (``proxy.admission.totals``);
5. the tenant's concurrency as leases in Redis, with ``cluster.redis_url`` (``proxy.cluster.steps``);
6. the slots of the model's child (``Slots``): its lane's gate (``proxy.admission.gate.SlotGate``), given
   by the endpoint with the request (the only step that depends on the model the body names). The gate
   gives the permit its slot (``proxy.conversations.slots``): the one that holds the request's
   conversation when that one is free, chosen among the slots free when the gate granted.

The Redis steps are present only when configured; the request path never asks "cluster or not". The
endpoint enters the pipeline once (``async with pipeline.admit(ask, ctx, gate) as grant``); a request
run again on the next child (a replay) gives its slot back and takes one again (``Pipeline.retake_slot``):
it keeps every other hold, so it is neither charged nor counted twice.

What the steps tell the answer goes through the grant: the rate-limit headers of the budgets (the
cluster-wide figures where there are any, since the Redis step comes after this replica's) and the time
spent waiting, which are put on the request's record (``RequestContext``) as each step returns or
refuses, so a 429 carries them too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from proxy.admission.gate import Permit, SlotGate
from proxy.asgi.context import RequestContext
from proxy.settings import BudgetSettings, TenantSettings

_log = logging.getLogger("llamagate.proxy")


@dataclass(frozen=True, slots=True)
class Spent:
    """What a finished request is charged: prompt plus completion tokens, at a wall-clock time."""

    tokens: int
    at: float


class Hold(Protocol):
    """What one step holds for a request until it ends."""

    def close(self, spent: Spent | None) -> None:
        """Charge ``spent`` (None: the request used nothing) and give the hold back. Called once."""
        ...


class Step(Protocol):
    """One limit. ``take`` returns the request's hold or raises its refusal (``proxy.errors``)."""

    async def take(self, ask: Ask, grant: Grant) -> Hold: ...


class Check(Protocol):
    """The request's own check against its child (``PromptCheck``; the endpoint's is
    ``proxy.routes.prompt_tokens.PromptTokens``)."""

    async def check(self) -> None:
        """Return when the request may go on; else raise its refusal (``proxy.errors``)."""
        ...


@dataclass(frozen=True, slots=True)
class Ask:
    """A request as every step sees it, described once. ``priority`` is the request's own level (its
    tenant's, or a lower one it asked for); ``max_wait_s`` the wait it asked for (None: its tenant's
    ``queue_timeout_s``), which caps every wait of the pipeline together (``Grant.waited_s`` is what
    the steps have used of it so far)."""

    tenant: TenantSettings
    key_id: str
    model: str
    slots: int = 1
    reserve: int | None = None  # the most tokens it can use; None: unknown (``proxy.accounts.budgets``)
    priority: int | None = None
    max_wait_s: float | None = None
    key_budgets: BudgetSettings | None = None
    # Its conversation's key (``proxy.conversations.key``), and whether its task can be placed on a slot
    # (a generation the child runs with ``id_slot``; ``proxy.conversations.slots``).
    conversation: str | None = None
    placeable: bool = False
    # The request's own check against its child (``PromptCheck``); None: none asked for.
    check: Check | None = None

    @property
    def level(self) -> int:
        """The priority it is queued at: its own, never above its tenant's."""
        own = self.tenant.priority
        return own if self.priority is None else min(self.priority, own)

    @property
    def wait_limit_s(self) -> float:
        """Its whole wait, over every step: what it asked for, capped by its tenant's queue timeout."""
        limit = self.tenant.queue_timeout_s
        return limit if self.max_wait_s is None else min(self.max_wait_s, limit)


@dataclass(eq=False)
class Grant:
    """What the pipeline gave one request: its holds (closed at the end, last first), its slot, what
    the answer says of them, and how far the request has come: the wait it has used and whether it is a
    replay (``Pipeline.retake_slot``)."""

    ask: Ask
    ctx: RequestContext
    gate: SlotGate
    holds: list[Hold] = field(default_factory=list)
    permit: Permit | None = None
    waited_s: float = 0.0  # what the steps have used of the request's wait (``Ask.wait_limit_s``)
    front: bool = False  # a replay: at the head of its tenant's queue (``proxy.admission.gate``)
    # Rate-limit headers for every answer to the request (``RequestContext.extra_headers``).
    rate_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    spent: Spent | None = None

    @property
    def wait_left_s(self) -> float:
        """What is left of the request's wait, for the next step that waits."""
        return max(0.0, self.ask.wait_limit_s - self.waited_s)

    def waited(self, seconds: float) -> None:
        """A step waited ``seconds``: it counts against the request's wait and as its queue time."""
        self.waited_s += seconds
        self.ctx.queue_wait_s = (self.ctx.queue_wait_s or 0.0) + seconds

    def show(self, rate_headers: list[tuple[bytes, bytes]]) -> None:
        """A budget step's rate-limit headers; a later step's (the cluster-wide figures) replace them.
        The request's other headers (its conversation's key) stay."""
        others = [h for h in self.ctx.extra_headers if h not in self.rate_headers]
        self.rate_headers = rate_headers
        self.ctx.extra_headers = others + rate_headers

    def charge(self, tokens: int) -> None:
        """What the request used, charged to every hold when the grant ends."""
        self.spent = Spent(tokens, time.time())


class PromptCheck:
    """The request's own check against its child (``Ask.check``: the prompt's size, when its tenant asks
    for one), a 400 before any wait; it holds nothing."""

    async def take(self, ask: Ask, grant: Grant) -> Hold:
        check = ask.check
        if check is not None:
            await check.check()
        return _NOTHING


class Slots:
    """The last step: slots of the model's child, from the lane's gate the request came with
    (``Grant.gate``, the only step that depends on the model the body names), with its slot placed by the
    gate (``proxy.conversations.slots``). Its hold is the permit."""

    async def take(self, ask: Ask, grant: Grant) -> Hold:
        # Nothing waited yet: the gate applies the request's own wait and names it in a refusal; after a
        # lease's wait, what is left of it.
        max_wait_s = ask.max_wait_s if grant.waited_s == 0 else grant.wait_left_s
        permit = await grant.gate.acquire(
            ask.tenant.name,
            ask.slots,
            priority=ask.priority,
            max_wait_s=max_wait_s,
            front=grant.front,
            conversation=ask.conversation,
            placeable=ask.placeable,
        )
        grant.permit = permit
        grant.waited(permit.queue_wait_s)
        return _PermitHold(grant)


class _PermitHold:
    """The permit the grant holds now (a replay takes another one): released at once when the request
    ends, unless the request released it itself (with its linger)."""

    __slots__ = ("_grant",)

    def __init__(self, grant: Grant) -> None:
        self._grant = grant

    def close(self, spent: Spent | None) -> None:
        if self._grant.permit is not None:
            self._grant.permit.release()


class _Nothing:
    def close(self, spent: Spent | None) -> None:
        return None


_NOTHING = _Nothing()


class Pipeline:
    """The steps in the order a request meets them (``proxy.state`` builds the list): the budgets (no
    wait: a spent budget is a 429 before anything else), the request's prompt check, the limits that
    count the request while it runs (and may wait), and last the model's slots (``Slots``)."""

    def __init__(self, steps: Sequence[Step]) -> None:
        if not steps or not isinstance(steps[-1], Slots):
            raise ValueError("the pipeline's last step is the model's slots")
        self.steps = tuple(steps)
        self._slots = steps[-1]

    @asynccontextmanager
    async def admit(self, ask: Ask, ctx: RequestContext, gate: SlotGate) -> AsyncIterator[Grant]:
        """Take every step's hold, the slots of ``gate`` (the model's) last; give them all back (charged
        with ``Grant.charge``) when the block ends, however it ends. A refusal gives back what the
        earlier steps took."""
        grant = Grant(ask, ctx, gate)
        try:
            for step in self.steps:
                grant.holds.append(await step.take(ask, grant))
            yield grant
        finally:
            _close(grant)

    async def retake_slot(self, grant: Grant) -> Permit:
        """A replay: slots again, at the head of the tenant's queue, within a wait of its own (the
        request waited for the next child, not for a slot). Every other hold is kept."""
        grant.front, grant.waited_s = True, 0.0
        await self._slots.take(grant.ask, grant)  # the grant's permit hold closes whichever permit it has
        assert grant.permit is not None
        return grant.permit


def _close(grant: Grant) -> None:
    spent = grant.spent
    for hold in reversed(grant.holds):
        # Each hold is closed whatever another one does: a total or a lease left held would refuse the
        # tenant's later requests for good (or for a lease's TTL).
        try:
            hold.close(spent)
        except Exception:
            _log.exception("admission: closing a hold failed; the request's other holds are closed")
    # A permit's hold points back at its grant: without this the pair, and all the request's objects it
    # reaches, waits for the garbage collector instead of going when the request does.
    grant.holds.clear()
