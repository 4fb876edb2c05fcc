"""``ClusterLimiter``: a tenant's concurrency across replicas, taken at admission as leases in Redis.

Where it sits: ``proxy.routes.inference`` asks it for a lease (one call) *before* the lane's own slot gate
(``proxy.admission.gate``), which stays local and authoritative for its child. Before, because a lease
is the tenant's own and a slot is everybody's: a request that waits for its tenant's lease holding no
slot keeps no other tenant's request on this replica waiting; one that holds a lease and waits for a
slot only delays its own tenant. Without ``cluster.redis_url`` there is no limiter at all (``None``):
the request path pays one attribute test.

How queued requests wait fairly across replicas: the first refused ask puts the request in its tenant's
line in Redis (``proxy.cluster.scripts``: arrival order by Redis's clock, one line per model and tenant
shared by every replica), and a lease goes to the first in line whatever replica it waits on. A waiting
replica asks again with a capped, jittered backoff (``_FIRST_RETRY_S`` doubling to ``_MAX_RETRY_S``; at
once when a lease of this replica is released), never past the wait's deadline (the tenant's
``queue_timeout_s``: then 429 like a local queue timeout); each ask renews its place in line, so a line
holds no dead replica's waiter for longer than the TTL. The line is capped at the tenant's ``max_queue``
across the replicas (429 ``queue_full`` beyond).

Leases live ``lease_ttl_s`` and one task per replica renews all it holds every third of that, in one
script call; a released lease is removed at once (off the request's path). A replica that dies stops
renewing, so its leases expire within the TTL.

Redis unreachable (refused, reset, or no answer within ``socket_timeout_s``): the mode becomes
``cluster.on_redis_error``, said once in the log and by ``llamagate_cluster_mode``. ``local``: each
replica allows a tenant ``max(1, limit // replicas)`` by itself until Redis is back (the local gate
still applies); ``refuse``: 503 with ``Retry-After``. A probe pings Redis every ``_PROBE_S`` and
switches back to ``cluster`` once it answers (logged once): no restart. Requests already running keep
running through every switch; their leases are renewed (re-added if Redis lost them) once it is back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
from collections import Counter
from collections.abc import Coroutine
from typing import Any, Literal, Protocol

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.asgi.context import RequestContext
from proxy.cluster.leases import TOTAL, Ask, Group, RedisLeases
from proxy.errors import Rejected, SharedLimitsUnavailable
from proxy.settings import ClusterSettings, TenantSettings

_log = logging.getLogger("llamagate.cluster")

Mode = Literal["cluster", "local", "refuse"]
MODES: tuple[Mode, ...] = ("cluster", "local", "refuse")
# The waiting replica's backoff: short first (a lease freed by a request that just ended is taken in a
# few tens of ms), capped so a tenant with many waiters on many replicas asks Redis a few times a second
# per waiter, not in a loop.
_FIRST_RETRY_S = 0.02
_MAX_RETRY_S = 0.2
# How often a degraded replica asks whether Redis is back; also the Retry-After of a refusal.
_PROBE_S = 1.0
_REDIS_ERRORS = (RedisError, OSError, TimeoutError)


class SharedBudgetCheck(Protocol):
    """The request's budgets as the replicas count them in Redis (``proxy.routes.charge``)."""

    async def admit_shared(self) -> None: ...


class ClusterLease:
    """A request's leases; ``release`` any number of times, only the first counts."""

    __slots__ = ("_limiter", "ask", "local", "released")

    def __init__(self, limiter: ClusterLimiter, ask: Ask, local: bool) -> None:
        self._limiter = limiter
        self.ask = ask
        self.local = local  # taken from the local fallback, not from Redis
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._limiter._release(self)


class ClusterLimiter:
    def __init__(self, settings: ClusterSettings, client: Redis | None = None) -> None:
        self.settings = settings
        if client is None:
            client = Redis.from_url(
                settings.redis_url,
                socket_timeout=settings.socket_timeout_s,
                socket_connect_timeout=settings.socket_timeout_s,
                # One retry, on a broken connection only (not on a timeout): a pooled connection that a
                # restarted Redis closed fails once and is made again. A dead Redis refuses at once, and
                # a hung one costs a request one timeout: the mode switch is the real retry.
                retry=Retry(NoBackoff(), 1),
                retry_on_timeout=False,
                health_check_interval=0,
            )
        self.leases = RedisLeases(client)
        self.mode: Mode = "cluster"
        self.redis_errors = 0
        self._ttl_ms = max(1, round(settings.lease_ttl_s * 1000))
        # A whole call (connect and answer): bounded even if a socket timeout does not fire.
        self._call_s = 2 * settings.socket_timeout_s
        self._held: dict[str, Ask] = {}  # member -> its ask: the leases this replica holds in Redis
        self._local: Counter[Group] = Counter()  # slots held under the local fallback, per group
        self._local_held = 0
        self._local_leases: dict[str, ClusterLease] = {}  # member -> lease taken under the fallback
        self._released = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # --- what metrics and tests read -------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Slots this replica's requests hold as leases (in Redis, or under the local fallback)."""
        return sum(a.slots for a in self._held.values()) + self._local_held

    # --- the request path ------------------------------------------------------------------------------
    async def acquire(
        self,
        ctx: RequestContext,
        model: str,
        tenant: TenantSettings,
        slots: int,
        budgets: SharedBudgetCheck | None = None,
    ) -> ClusterLease:
        """The tenant's leases for ``slots`` slots of ``model`` (and of its total), at once or after a fair
        wait; ``Rejected`` (429) for a full line or the wait's deadline, ``SharedLimitsUnavailable`` (503)
        when Redis is unreachable and the fallback is ``refuse``. The wait counts as queue time. First,
        ``budgets``: the request's budgets shared in Redis (their 429 before any wait)."""
        if budgets is not None:
            await budgets.admit_shared()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await self._acquire(model, tenant, slots, started + tenant.queue_timeout_s)
        finally:
            ctx.queue_wait_s = (ctx.queue_wait_s or 0.0) + loop.time() - started

    async def _acquire(self, model: str, tenant: TenantSettings, slots: int, deadline: float) -> ClusterLease:
        groups = [Group(tenant.name, model, tenant.max_concurrency)]
        if tenant.max_concurrency_total is not None:
            groups.append(Group(tenant.name, TOTAL, tenant.max_concurrency_total))
        ask = Ask(secrets.token_hex(8), slots, tuple(groups), tenant.max_queue)
        loop = asyncio.get_running_loop()
        delay = _FIRST_RETRY_S
        # This request may hold something in Redis (a place in line, or leases granted by a call it was
        # cancelled in): given back if it stops waiting.
        in_line = False
        soonest = math.inf
        try:
            while True:
                if self.mode == "cluster":
                    in_line = True  # a cancel during the call may leave a grant behind
                    try:
                        async with asyncio.timeout(self._call_s):
                            outcome, soonest = await self.leases.acquire(ask, self._ttl_ms)
                    except _REDIS_ERRORS as exc:
                        self._lost(exc)
                        continue  # the fallback answers this request at once
                    in_line = outcome == "wait"
                    if outcome == "granted":
                        self._held[ask.member] = ask
                        self._start_renewer()
                        return ClusterLease(self, ask, local=False)
                    if outcome == "full":
                        raise Rejected(
                            "queue_full",
                            _PROBE_S,
                            f"tenant '{tenant.name}' is at its limit of {tenant.max_concurrency} concurrent "
                            f"requests and {tenant.max_queue} queued across the replicas; retry later",
                        )
                elif self.mode == "refuse":
                    raise SharedLimitsUnavailable(
                        "the shared limits (Redis) are unreachable and cluster.on_redis_error is refuse; "
                        "retry later",
                        _PROBE_S,
                    )
                elif self._take_local(ask):
                    lease = self._local_leases[ask.member] = ClusterLease(self, ask, local=True)
                    return lease
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise Rejected(
                        "queue_timeout",
                        _PROBE_S,
                        f"tenant '{tenant.name}' waited {tenant.queue_timeout_s:g} s for a free slot "
                        "across the replicas; retry later",
                    )
                pause = min(delay * random.uniform(0.5, 1.0), remaining, max(soonest, _FIRST_RETRY_S))  # noqa: S311
                if await self._wait_release(pause):
                    continue  # a lease of ours was freed: ask now, same backoff
                delay = min(delay * 2, _MAX_RETRY_S)
        finally:
            if in_line:
                self._spawn(self._give_back(ask))

    def _take_local(self, ask: Ask) -> bool:
        replicas = self.settings.replicas
        if any(self._local[g] + ask.slots > max(1, g.limit // replicas) for g in ask.groups):
            return False
        for g in ask.groups:
            self._local[g] += ask.slots
        self._local_held += ask.slots
        return True

    async def _wait_release(self, timeout_s: float) -> bool:
        """True when a lease of this replica was released within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._released.wait()
            return True
        except TimeoutError:
            return False

    def _wake(self) -> None:
        # Every waiter now waiting wakes (their futures are set); later ones wait for the next release.
        self._released.set()
        self._released.clear()

    def _release(self, lease: ClusterLease) -> None:
        ask = lease.ask
        if lease.local:
            del self._local_leases[ask.member]
            for g in ask.groups:
                self._local[g] -= ask.slots
                if self._local[g] <= 0:
                    del self._local[g]
            self._local_held -= ask.slots
            self._wake()
            return
        self._held.pop(ask.member, None)
        self._spawn(self._give_back(ask, wake=True))

    async def _give_back(self, ask: Ask, wake: bool = False) -> None:
        """Remove the leases (or the place in line) from Redis; a failure leaves them to expire."""
        try:
            if self.mode == "cluster":
                async with asyncio.timeout(self._call_s):
                    await self.leases.release(ask)
        except _REDIS_ERRORS as exc:
            self._lost(exc)
        finally:
            if wake:
                self._wake()

    # --- modes -----------------------------------------------------------------------------------------
    def _lost(self, exc: BaseException) -> None:
        self.redis_errors += 1
        if self.mode != "cluster":
            return
        self.mode = self.settings.on_redis_error
        what = (
            f"local limits (each tenant's limit // {self.settings.replicas} replicas) in force"
            if self.mode == "local"
            else "requests refused with 503"
        )
        _log.warning(
            "Redis unreachable: shared limits off, %s until it answers again",
            what,
            extra={"fields": {"mode": self.mode, "error": f"{type(exc).__name__}: {exc}"}},
        )
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe(), name="cluster-probe")

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(_PROBE_S)
            # Every request running here counts in Redis before anyone is admitted by it again: those
            # that held leases through the outage and those admitted under the local fallback.
            running = [*self._held.values(), *(lease.ask for lease in self._local_leases.values())]
            try:
                async with asyncio.timeout(self._call_s):
                    await self.leases.ping()
                    await self.leases.renew(running, self._ttl_ms)
            except _REDIS_ERRORS:
                self.redis_errors += 1
                continue
            self._resume(running)
            return

    def _resume(self, renewed: list[Ask]) -> None:
        """Back to shared limits: the fallback's leases become Redis leases (renewed and released there)."""
        sent = {ask.member for ask in renewed}
        late = [lease.ask for lease in self._local_leases.values() if lease.ask.member not in sent]
        for lease in self._local_leases.values():
            lease.local = False
            self._held[lease.ask.member] = lease.ask
        self._local_leases.clear()
        self._local.clear()
        self._local_held = 0
        self.mode = "cluster"
        self._settle(renewed)
        if late:  # admitted under the fallback while the renewal was on its way: counted now
            self._spawn(self._renew_now(late))
        if self._held:
            self._start_renewer()
        _log.info("Redis answers again: shared limits resumed", extra={"fields": {"mode": "cluster"}})

    def _start_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew(), name="cluster-renew")

    async def _renew(self) -> None:
        """Every third of the TTL, push every lease held here to a full TTL again; ends when none is held."""
        while self._held:
            await asyncio.sleep(self.settings.lease_ttl_s / 3)
            if self.mode != "cluster" or not self._held:
                continue
            await self._renew_now(list(self._held.values()))

    async def _renew_now(self, asks: list[Ask]) -> None:
        try:
            async with asyncio.timeout(self._call_s):
                await self.leases.renew(asks, self._ttl_ms)
        except _REDIS_ERRORS as exc:
            self._lost(exc)
            return
        self._settle(asks)

    def _settle(self, renewed: list[Ask]) -> None:
        """A lease released while its renewal was on its way may have been put back in Redis after its
        release (two connections, no order between them): release it again, or it would count a TTL."""
        for ask in renewed:
            if ask.member not in self._held:
                self._spawn(self._give_back(ask))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Let pending releases finish (bounded by their own timeouts), stop the tasks, close the client."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._call_s + 0.5)
        for task in (self._renewer, self._prober, *self._tasks):
            if task is not None:
                task.cancel()
        await self.leases.client.aclose()
