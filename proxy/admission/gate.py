"""Admission control: the concurrency budget in front of llama-server's slots.

Two limits hold at every instant: at most ``capacity`` slots in total (the child's slot count, so the
child never queues behind our back) and at most ``max_concurrency`` slots per tenant. A request that
cannot start waits in its tenant's bounded queue (``max_queue``) for at most ``queue_timeout_s`` (or
less: ``acquire(max_wait_s=...)``, a request's own limit).

A permit is for ``slots`` slots at once (``n`` completions or an array of prompts occupy that many in
llama-server; ``proxy.admission.cost`` counts them). It is granted whole or not at all: a request never
holds part of what it needs while waiting for the rest, so two wide requests cannot deadlock each other.

When a permit frees, the next one goes to the backlogged tenant with the lowest *pass* (stride scheduling:
each grant advances a tenant's pass by ``1 / weight``), so over any busy period tenants share freed slots
in proportion to their weights and one tenant's burst cannot starve another. A tenant that becomes
backlogged starts at the current virtual time, so idling earns no credit to burst with later.

Priorities come before the fair share, with aging. A request has its tenant's ``priority`` (or a lower
one it asks for, never a higher one); waiting raises it by one level per ``AGING_S_PER_LEVEL`` seconds.
One rate for everyone means two waiting requests never swap places as they age, so the gate orders
them by *virtual arrival*, ``arrived - priority * AGING_S_PER_LEVEL`` (a priority is a head start of
that many seconds), without reading the clock; on a tie, the one that arrived first. The next request
is the ready head (its tenant is under its limit) that comes first in that order; the fair share then
picks, among the ready heads of its priority, the tenant with the lowest pass, leaving out any head
that a head of another priority comes before. With one priority this is exactly the stride scheduler
above. A tenant's own queue is in the same order, so its lowered requests let its other ones pass.

The bound that follows: a request of another priority is admitted before a waiting (ready) request only
if it comes before it in that order. So a request of priority ``p`` is overtaken by a request of a
higher priority ``q`` only if that one arrived less than ``(q - p) * AGING_S_PER_LEVEL`` seconds after
it: after that long (10 s for ``batch`` behind ``interactive``), higher-priority newcomers queue behind
it, and it waits only for what was already queued ahead of it and for its turn within its priority.

Invariant kept by ``_dispatch`` after every change: the next request (by the rules above) is never
eligible (its request fits under its tenant's limit) while the global capacity it needs is free. When it
needs more slots than are free, dispatch stops there (head-of-line) instead of letting narrower requests
pass it: otherwise a stream of one-slot requests would starve a two-slot one forever. The fast path
(grant at once when the tenant has no queue) therefore also requires that no eligible waiter exists:
it can never overtake one; a request that queues is offered to ``_dispatch`` at once (a higher priority
may take a slot a wide lower-priority request is waiting to fill).

A replay (a request whose child died before its answer began, ``proxy.routes.replay``) comes back with
``acquire(front=True)``: at the head of its own tenant's queue, not refused for a full queue, and then
served in the tenants' turns like any other waiter; it holds no permit while it waits for the next child.

Permits are released exactly once, on every path: ``Permit.release`` is idempotent, and a waiter that is
cancelled or times out in the same loop turn its permit was granted gives that permit back. Permits point
at their tenant's state object, so a reload that changes or removes the tenant cannot leak or double-count.

Lingering: when the proxy abandons a request the child is still working on (client gone, deadline), the
child's slot stays busy until it notices the closed connection (llama-server polls every second, or at
its next token). ``release(linger_s)`` frees the tenant's share at once but keeps the slot counted for
``linger_s``, so a new request is not sent into the child's own unbounded queue meanwhile. With a
``confirm`` coroutine, the slots stay counted after ``linger_s`` until it returns: the request path
passes one that watches the child's ``/slots`` (a loaded child may take longer than any guess).
Pure asyncio, no sockets, no I/O: unit-tested directly.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

from proxy.admission.idle import IdleWaiters
from proxy.conversations.slots import Pin, SlotMap
from proxy.errors import Forbidden, Rejected
from proxy.settings import DEFAULT_PRIORITY, TenantSettings

_log = logging.getLogger("llamagate.proxy")

# Weight of the newest sample in the service-time average behind Retry-After.
_EWMA_ALPHA = 0.2
# With no completed request yet, assume this much service time (s) per request for Retry-After.
_DEFAULT_SERVICE_S = 1.0
# Seconds of waiting that raise a queued request's priority by one level (the aging rate). The named
# levels are 10 apart (``proxy.settings.PRIORITY_LEVELS``), so a batch request is overtaken by
# interactive newcomers for at most 10 s and by default ones for 5 s: short of the default 30 s
# queue_timeout_s, so aging shows before the deadline does, and long enough that interactive requests
# arriving in a burst all go first.
AGING_S_PER_LEVEL = 1.0
_LAST = (math.inf, 0)  # after every waiter's order


class Permit:
    """The right to occupy ``slots`` slots. ``release`` may be called any number of times; only the first
    counts."""

    __slots__ = ("_ctl", "_tenant", "granted_at", "pin", "priority", "queue_wait_s", "released", "slots")

    def __init__(
        self,
        ctl: SlotGate,
        tenant: _Tenant,
        granted_at: float,
        queue_wait_s: float,
        slots: int = 1,
        priority: int = DEFAULT_PRIORITY,
    ) -> None:
        self._ctl = ctl
        self._tenant = tenant
        self.granted_at = granted_at
        self.queue_wait_s = queue_wait_s
        self.slots = slots
        # The request's own priority (its tenant's, or lower), not the aged one.
        self.priority = priority
        self.released = False
        # The slot of the child it runs on (``proxy.conversations.slots``), set by the gate itself when it
        # grants the permit (``SlotGate.acquire``); freed when the gate counts the slot free again.
        self.pin: Pin | None = None

    def release(self, linger_s: float = 0.0, confirm: Callable[[], Awaitable[object]] | None = None) -> None:
        """Give the permit back; with ``linger_s`` > 0 its global slots stay taken that much longer, and
        then until ``confirm()`` returns when given."""
        if not self.released:
            self.released = True
            self._ctl._release(
                self._tenant, self.granted_at, linger_s, self.slots, confirm, self.priority, self.pin
            )


@dataclass(eq=False, slots=True)
class _Waiter:
    future: asyncio.Future[Permit]
    enqueued_at: float
    slots: int = 1
    priority: int = DEFAULT_PRIORITY
    # Virtual arrival (see the module docstring) and arrival order: the queue order, across tenants too.
    key: float = 0.0
    seq: int = 0
    front: bool = False  # a replay: ahead of the tenant's other waiters (behind earlier replays)

    @property
    def order(self) -> tuple[float, int]:
        return self.key, self.seq


class _Tenant:
    __slots__ = ("backlog_seq", "in_flight", "name", "pass_", "retired", "service_s", "settings", "waiters")

    def __init__(self, settings: TenantSettings) -> None:
        self.name = settings.name
        self.settings = settings
        self.in_flight = 0
        self.waiters: list[_Waiter] = []  # kept sorted by ``_Waiter.order``; short (max_queue)
        self.pass_ = 0.0
        # Order of becoming backlogged: breaks ties between equal passes first-come first-served.
        self.backlog_seq = 0
        self.service_s: float | None = None
        self.retired = False

    @property
    def stride(self) -> float:
        return 1.0 / max(1, self.settings.weight)

    @property
    def eligible(self) -> bool:
        """Its next request fits under its own limit (the global gate is checked by the caller)."""
        return bool(self.waiters) and self.in_flight + self.waiters[0].slots <= self.settings.max_concurrency


@dataclass(frozen=True, slots=True)
class TenantLoad:
    name: str
    in_flight: int
    queued: int


@dataclass(frozen=True, slots=True)
class PriorityLoad:
    """Slots held by requests of one priority (the request's own, not aged) and requests waiting."""

    priority: int
    in_flight: int
    queued: int


class SlotGate:
    def __init__(
        self,
        tenants: Iterable[TenantSettings],
        capacity: int,
        clock: Callable[[], float] = time.monotonic,
        aging_s_per_level: float = AGING_S_PER_LEVEL,
    ) -> None:
        self._clock = clock
        self._aging_s = aging_s_per_level
        self._seq = 0
        self._held_by_priority: Counter[int] = Counter()
        self._capacity = capacity
        self._tenants: dict[str, _Tenant] = {}
        self._backlogged: set[_Tenant] = set()
        self._vtime = 0.0
        self._backlog_seq = 0
        self._in_flight = 0  # permits held plus slots lingering after an abandoned request
        self._lingering = 0
        self._queued = 0
        self._service_s: float | None = None
        self._idle = IdleWaiters()
        self._linger_tasks: set[asyncio.Task[None]] = set()
        # Which of the child's slots hold what (``proxy.conversations.slots``): one map per child.
        self._slot_map = SlotMap(capacity)
        self.reconfigure(tenants)

    # --- what the daemon, metrics and tests read ---------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def in_flight(self) -> int:
        """Permits held by requests (lingering slots not included)."""
        return self._in_flight - self._lingering

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def held(self) -> int:
        """Slots counted as taken: permits held plus lingering slots."""
        return self._in_flight

    @property
    def lingering(self) -> int:
        """Slots still counted as busy after an abandoned request, until the child has noticed."""
        return self._lingering

    @property
    def generation(self) -> int:
        """The child generation the slot map is for (``set_capacity``)."""
        return self._slot_map.generation

    def placed(self) -> tuple[list[str], list[bool]]:
        """Each slot's conversation (``proxy.conversations.slots``) and whether a request holds it now."""
        return list(self._slot_map.held), list(self._slot_map.busy)

    def holding(self, conversation: str) -> int | None:
        """The slot that holds ``conversation``, if any."""
        return self._slot_map.holding(conversation)

    def loads(self) -> Iterator[TenantLoad]:
        for t in self._tenants.values():
            yield TenantLoad(t.name, t.in_flight, len(t.waiters))

    def priority_loads(self) -> list[PriorityLoad]:
        """Per priority, highest first: every configured tenant's priority (zeros included, so a metric
        keeps its series) and any lower one that requests asked for. Lingering slots are not counted."""
        queued: Counter[int] = Counter()
        for t in self._tenants.values():
            queued.update(w.priority for w in t.waiters)
        levels = {t.settings.priority for t in self._tenants.values() if not t.retired}
        levels.update(p for p, n in self._held_by_priority.items() if n)
        levels.update(queued)
        return [PriorityLoad(p, self._held_by_priority[p], queued[p]) for p in sorted(levels, reverse=True)]

    # --- changes from outside ------------------------------------------------------------------------------
    def set_capacity(self, capacity: int, generation: int = 0) -> None:
        """Follow the child's slot count (it may change on restart) and its generation: a new child's
        slots hold nothing of the old one's. Shrinking never revokes a permit."""
        self._capacity = capacity
        self._slot_map = SlotMap(capacity, generation)
        self._dispatch()

    def reconfigure(self, tenants: Iterable[TenantSettings]) -> None:
        """Swap tenant limits in (SIGHUP). In-flight and queued requests of a removed tenant finish under
        its last limits; its state is dropped once it holds nothing. A changed priority applies to the
        requests that arrive after the reload (queued ones keep their place)."""
        new = {t.name: t for t in tenants}
        for name, state in list(self._tenants.items()):
            if name in new:
                state.settings = new[name]
                state.retired = False
            else:
                state.retired = True
                self._forget_if_empty(state)
        for name, settings in new.items():
            if name not in self._tenants:
                self._tenants[name] = _Tenant(settings)
        self._dispatch()

    # --- the request path --------------------------------------------------------------------------------
    async def acquire(
        self,
        tenant: str,
        slots: int = 1,
        *,
        priority: int | None = None,
        max_wait_s: float | None = None,
        front: bool = False,
        conversation: str | None = None,
        placeable: bool = False,
    ) -> Permit:
        """``_acquire``'s permit, given its slot (``proxy.conversations.slots``): the one that holds
        ``conversation`` when that one is free, chosen among the slots free when the gate granted (a
        ``placeable`` task only: one the child runs with ``id_slot``). The gate owns its slot map."""
        permit = await self._acquire(tenant, slots, priority=priority, max_wait_s=max_wait_s, front=front)
        permit.pin = self._slot_map.take(conversation, permit.slots, placeable)
        return permit

    async def _acquire(
        self,
        tenant: str,
        slots: int = 1,
        *,
        priority: int | None = None,
        max_wait_s: float | None = None,
        front: bool = False,
    ) -> Permit:
        """A permit for ``slots`` slots of ``tenant``, at once or after a fair wait; ``Rejected`` (429) when
        its queue is full or the wait reaches ``queue_timeout_s``. The caller refuses (400) a request wider
        than the tenant's limit or the child's slots first (``proxy.admission.cost``): such a request could
        only wait for its deadline here.

        ``priority``: the request's own, clamped to its tenant's (a request may lower its priority, never
        raise it); None: the tenant's. ``max_wait_s``: the request's own longest wait, capped by the
        tenant's ``queue_timeout_s``; 0 means "now or never".

        ``front``: a request admitted once already, whose child died before its answer began (a replay,
        ``proxy.routes.replay``), takes its place back at the head of its tenant's queue: ahead of the
        tenant's own waiters (never of another tenant's turn), and never refused for a full queue (the
        place it held counted against ``max_queue`` when it first came)."""
        t = self._tenants.get(tenant)
        if t is None or t.retired:
            raise Forbidden(f"tenant '{tenant}' is not configured")
        if max_wait_s is not None and not (max_wait_s >= 0 and math.isfinite(max_wait_s)):
            raise ValueError(f"max_wait_s must be a finite number >= 0, not {max_wait_s!r}")
        level = t.settings.priority if priority is None else min(priority, t.settings.priority)
        if (
            (front or not t.waiters)
            and t.in_flight + slots <= t.settings.max_concurrency
            and self._in_flight + slots <= self._capacity
            and not self._eligible_waiter()
        ):
            # With ``front`` the tenant may have waiters, but no waiter of any tenant is eligible: the
            # grant takes nobody's turn, and taking capacity cannot make a waiter eligible.
            return self._grant(t, 0.0, slots, level)
        if not front and len(t.waiters) >= t.settings.max_queue:
            raise Rejected(
                "queue_full",
                self._estimate_wait(t, len(t.waiters) - t.settings.max_queue),
                f"tenant '{tenant}' is at its limit of {t.settings.max_concurrency} concurrent requests "
                f"and {t.settings.max_queue} queued; retry later",
            )
        now = self._clock()
        self._seq += 1
        key, seq = now - level * self._aging_s, self._seq
        if front:
            # Ahead of the tenant's first waiter that is no replay (a tie on its key goes to the lower
            # seq), behind earlier replays (insort puts an equal order after them).
            first = next((w for w in t.waiters if not w.front), None)
            if first is not None and first.order <= (key, seq):
                key, seq = first.key, first.seq - 1
        waiter = _Waiter(
            asyncio.get_running_loop().create_future(), now, slots, level, key=key, seq=seq, front=front
        )
        if not t.waiters:
            self._backlogged.add(t)
            self._backlog_seq += 1
            t.backlog_seq = self._backlog_seq
            # Start at the current virtual time: no credit for idling, no penalty for past fast grants.
            t.pass_ = max(self._vtime, min(t.pass_, self._vtime + t.stride))
        bisect.insort(t.waiters, waiter, key=lambda w: w.order)
        self._queued += 1
        self._dispatch()  # a higher priority may be next at once (a slot left free for a wide request)
        timeout_s = (
            t.settings.queue_timeout_s if max_wait_s is None else min(max_wait_s, t.settings.queue_timeout_s)
        )
        try:
            if waiter.future.done():
                return waiter.future.result()
            if timeout_s <= 0:
                raise TimeoutError
            async with asyncio.timeout(timeout_s):
                return await waiter.future
        except BaseException as exc:
            self._abandon(t, waiter)
            if isinstance(exc, TimeoutError):
                own = timeout_s < t.settings.queue_timeout_s
                raise Rejected(
                    "queue_timeout",
                    self._estimate_wait(t, len(t.waiters)),
                    f"tenant '{tenant}' waited {timeout_s:g} s for a free slot"
                    + (" (the request's own maximum wait)" if own else "")
                    + "; retry later",
                ) from None
            raise

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight or queued; False if ``timeout_s`` passes first."""
        if self._in_flight == 0 and self._queued == 0:
            return True
        return await self._idle.wait(timeout_s)

    # --- internals ---------------------------------------------------------------------------------------
    def _grant(self, t: _Tenant, queue_wait_s: float, slots: int, priority: int) -> Permit:
        t.in_flight += slots
        self._in_flight += slots
        self._held_by_priority[priority] += slots
        t.pass_ += t.stride
        return Permit(self, t, self._clock(), queue_wait_s, slots, priority)

    def _ready(self, t: _Tenant) -> bool:
        """``t``'s next request fits under its limit and could fit the gate (a request wider than a shrunk
        gate must not block others: it waits for its deadline alone)."""
        return t.eligible and t.waiters[0].slots <= self._capacity

    def _eligible_waiter(self) -> bool:
        # Few tenants, and only while some are backlogged: the loop is short and usually empty.
        return any(self._ready(t) for t in self._backlogged)

    def _release(
        self,
        t: _Tenant,
        granted_at: float,
        linger_s: float = 0.0,
        slots: int = 1,
        confirm: Callable[[], Awaitable[object]] | None = None,
        priority: int = DEFAULT_PRIORITY,
        pin: Pin | None = None,
    ) -> None:
        t.in_flight -= slots
        self._held_by_priority[priority] -= slots
        if linger_s > 0:
            self._lingering += slots
            if confirm is None:
                asyncio.get_running_loop().call_later(linger_s, self._end_linger, slots, pin)
            else:
                task = asyncio.get_running_loop().create_task(
                    self._confirmed_linger(linger_s, slots, confirm, pin)
                )
                self._linger_tasks.add(task)
                task.add_done_callback(self._linger_tasks.discard)
        else:
            self._in_flight -= slots
            if pin is not None:
                pin.free()
        if linger_s <= 0:  # an abandoned request says nothing about how long requests take
            held = self._clock() - granted_at
            t.service_s = held if t.service_s is None else t.service_s + _EWMA_ALPHA * (held - t.service_s)
            g = self._service_s
            self._service_s = held if g is None else g + _EWMA_ALPHA * (held - g)
        self._forget_if_empty(t)
        self._dispatch()
        self._check_idle()

    async def _confirmed_linger(
        self, linger_s: float, slots: int, confirm: Callable[[], Awaitable[object]], pin: Pin | None
    ) -> None:
        try:
            await asyncio.sleep(linger_s)
            await confirm()
        except Exception as exc:  # a failed check ends the wait; it must not keep the slots forever
            _log.warning("lingering slots released after a failed check: %s", type(exc).__name__)
        finally:  # however it ends (cancelled too): never leak the slots
            self._end_linger(slots, pin)

    def _end_linger(self, slots: int = 1, pin: Pin | None = None) -> None:
        self._lingering -= slots
        self._in_flight -= slots
        if pin is not None:
            pin.free()
        self._dispatch()
        self._check_idle()

    def _abandon(self, t: _Tenant, waiter: _Waiter) -> None:
        fut = waiter.future
        if fut.done() and not fut.cancelled():
            # Granted in the same loop turn the wait was cancelled or timed out: give it back.
            fut.result().release()
            return
        fut.cancel()
        if waiter in t.waiters:
            t.waiters.remove(waiter)
            self._queued -= 1
        if not t.waiters:
            self._backlogged.discard(t)
        self._forget_if_empty(t)
        self._dispatch()  # it may have been the wide request the others were waiting behind
        self._check_idle()

    def _next(self) -> _Tenant | None:
        """The tenant whose head request goes next (see the module docstring), or None."""
        # Few tenants, and only while some are backlogged: the loops are short.
        ready = [t for t in self._backlogged if self._ready(t)]
        if not ready:
            return None
        # Earliest virtual arrival first; on a tie, the one that arrived first.
        first = min(ready, key=lambda t: t.waiters[0].order)
        level = first.waiters[0].priority
        ahead = min((t.waiters[0].order for t in ready if t.waiters[0].priority != level), default=_LAST)
        fair = [t for t in ready if t.waiters[0].priority == level and t.waiters[0].order < ahead]
        return min(fair, key=lambda t: (t.pass_, t.backlog_seq))

    def _dispatch(self) -> None:
        while self._in_flight < self._capacity and self._backlogged:
            best = self._next()
            if best is None:
                break
            if self._in_flight + best.waiters[0].slots > self._capacity:
                break  # head-of-line: the slots freed next are this request's (see the module docstring)
            waiter = best.waiters.pop(0)
            self._queued -= 1
            if not best.waiters:
                self._backlogged.discard(best)
            if waiter.future.done():
                # Its task was cancelled and has not run its cleanup yet; ``_abandon`` will find it gone.
                continue
            self._vtime = best.pass_
            now = self._clock()
            waiter.future.set_result(
                self._grant(best, now - waiter.enqueued_at, waiter.slots, waiter.priority)
            )
        self._check_idle()

    def estimate_wait(self, tenant: str) -> float:
        """Seconds until one of the tenant's slots is likely free (the Retry-After of a refusal made
        elsewhere, e.g. by the limits shared across replicas, which know no service times)."""
        t = self._tenants.get(tenant)
        if t is None:
            return self._service_s or _DEFAULT_SERVICE_S
        return self._estimate_wait(t, 0)

    def _estimate_wait(self, t: _Tenant, ahead: int) -> float:
        """Seconds until a request with ``ahead`` requests queued before it would likely start:
        each freed slot of the tenant's effective concurrency takes one recent service time."""
        service = t.service_s or self._service_s or _DEFAULT_SERVICE_S
        parallel = max(1, min(t.settings.max_concurrency, self._capacity))
        return service * (max(0, ahead) + 1) / parallel

    def _forget_if_empty(self, t: _Tenant) -> None:
        if t.retired and t.in_flight == 0 and not t.waiters and self._tenants.get(t.name) is t:
            del self._tenants[t.name]

    def _check_idle(self) -> None:
        if self._in_flight == 0 and self._queued == 0:
            self._idle.wake()
