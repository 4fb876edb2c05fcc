"""``ClusterLimiter``: a tenant's concurrency across replicas, taken at admission as leases in Redis.

Where it sits: a step of the admission pipeline (``proxy.cluster.steps.LeaseStep``), *before* the lane's
own slot gate (``proxy.admission.gate``), which stays local and authoritative for its child. Before,
because a lease is the tenant's own and a slot is everybody's: a request that waits for its tenant's lease
holding no slot keeps no other tenant's request on this replica waiting; one that holds a lease and waits
for a slot only delays its own tenant. Without ``cluster.redis_url`` there is no limiter at all, and no
step.

How queued requests wait fairly across replicas: the first refused ask puts the request in its tenant's
line in Redis (``proxy.cluster.scripts``: one line per model and tenant shared by every replica, in the
gate's order: arrival by Redis's clock less the request's priority head start, so priorities and aging
hold across replicas), and a lease goes to the first in line whatever replica it waits on. A waiting
replica asks again with a capped, jittered backoff (``_FIRST_RETRY_S`` doubling to ``_MAX_RETRY_S``; at
once when a lease of this replica is released), never past the wait's deadline (what the request has left
of its wait: ``X-LlamaGate-Max-Wait``, capped by the tenant's ``queue_timeout_s``; then 429 like a local
queue timeout; a request that may not wait takes no place in line); each ask renews its place in line, so
a line holds no dead replica's waiter for longer than the TTL. The line is capped at the tenant's
``max_queue`` across the replicas (429 ``queue_full`` beyond).

Leases live ``lease_ttl_s`` and one task per replica renews all it holds every third of that, in one
script call; a released lease is removed at once (off the request's path). A replica that dies stops
renewing, so its leases expire within the TTL.

Redis unreachable (refused, reset, or no answer within ``socket_timeout_s``): the mode becomes
``cluster.on_redis_error``, said once in the log and by ``llamagate_cluster_mode``. ``local``: each
replica allows a tenant ``max(1, limit // replicas)`` by itself until Redis is back, counting every
request it holds (those still running on leases Redis granted before, too; the local gate still applies);
``refuse``: 503 with ``Retry-After``. A probe pings Redis every ``cluster.probe_interval_s`` and switches
back to ``cluster`` once it answers (logged once): no restart. Requests already running keep running through
every switch; their leases are renewed (re-added if Redis lost them) once it is back.

A replica that gets no traffic notices an outage too: from ``start`` (the app's startup), a watch pings
Redis every ``cluster.probe_interval_s`` while the mode is ``cluster``; a failed ping switches the mode as
a failed call of a request does. So every replica's ``llamagate_cluster_mode`` says the truth within one
interval of a Redis that refuses (a hung one: plus one call's timeout, ``socket_timeout_s``), whether
or not it had requests, and within one interval of its return (the probe above). Whoever else keeps state
in the same Redis (``proxy.cluster.poison``) is told when Redis is back (``on_resume``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as BrokenConnection
from redis.exceptions import RedisError

from proxy.admission.gate import AGING_S_PER_LEVEL
from proxy.cluster.leases import TOTAL, Group, LeaseAsk, RedisLeases
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
# The default of ``cluster.probe_interval_s``: how often a replica asks whether Redis answers (whether it is
# still there, or back). Also the Retry-After of a full line or a wait's end; ``refuse``'s 503 says the
# interval in force (when the replica asks Redis again).
PROBE_S = 1.0
REDIS_ERRORS = (RedisError, OSError, TimeoutError)


class ClusterLease:
    """A request's leases; ``release`` any number of times, only the first counts."""

    __slots__ = ("_limiter", "ask", "local", "released")

    def __init__(self, limiter: ClusterLimiter, ask: LeaseAsk, local: bool) -> None:
        self._limiter = limiter
        self.ask = ask
        self.local = local  # taken from the local fallback, not from Redis
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._limiter._release(self)

    def close(self, spent: object) -> None:
        """The admission pipeline's end of the hold (``proxy.cluster.steps``): a lease counts no tokens."""
        self.release()


class ClusterLimiter:
    def __init__(self, settings: ClusterSettings, client: Redis | None = None) -> None:
        self.settings = settings
        if client is None:
            client = Redis.from_url(
                settings.redis_url,
                socket_timeout=settings.socket_timeout_s,
                socket_connect_timeout=settings.socket_timeout_s,
                # One retry, on a broken connection only (not on a timeout, which redis-py's Retry retries
                # by default: measured 2 x socket_timeout_s for one call on a hung Redis): a pooled
                # connection that a restarted Redis closed fails once and is made again. A dead Redis
                # refuses at once, and a hung one costs a request one timeout: the mode switch is the
                # real retry.
                retry=Retry(NoBackoff(), 1, supported_errors=(BrokenConnection,)),
                retry_on_timeout=False,
                health_check_interval=0,
            )
        self.leases = RedisLeases(client)
        self.mode: Mode = "cluster"
        self.redis_errors = 0
        self._ttl_ms = max(1, round(settings.lease_ttl_s * 1000))
        # A whole call (connect and answer): bounded even if a socket timeout does not fire.
        self.call_s = 2 * settings.socket_timeout_s
        self._held: dict[str, LeaseAsk] = {}  # member -> its ask: the leases this replica holds in Redis
        self._local: Counter[str] = Counter()  # slots held under the local fallback, per group key
        self._local_held = 0
        self._local_leases: dict[str, ClusterLease] = {}  # member -> lease taken under the fallback
        self._released = asyncio.Event()
        self.probe_s = settings.probe_interval_s
        self._renewer: asyncio.Task[None] | None = None
        self._prober: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Called (off the path) each time Redis answers again after an outage.
        self.on_resume: list[Callable[[], None]] = []

    def start(self) -> None:
        """Watch Redis from now on, with or without traffic (in the app's running loop; idempotent)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="cluster-watch")

    # --- what metrics and tests read -------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Slots this replica's requests hold as leases (in Redis, or under the local fallback)."""
        return sum(a.slots for a in self._held.values()) + self._local_held

    # --- the request path ------------------------------------------------------------------------------
    async def acquire(
        self,
        model: str,
        tenant: TenantSettings,
        slots: int,
        *,
        level: int | None = None,
        wait_s: float | None = None,
    ) -> ClusterLease:
        """The tenant's leases for ``slots`` slots of ``model`` (and of its total), at once or after a fair
        wait of at most ``wait_s`` (None: the tenant's ``queue_timeout_s``; 0: now or never) in the line
        shared by the replicas, at priority ``level`` (None: the tenant's); ``Rejected`` (429) for a
        full line or the wait's end, ``SharedLimitsUnavailable`` (503) when Redis is unreachable and
        the fallback is ``refuse``."""
        level = tenant.priority if level is None else min(level, tenant.priority)
        wait_s = tenant.queue_timeout_s if wait_s is None else min(wait_s, tenant.queue_timeout_s)
        groups = [Group(tenant.name, model, tenant.max_concurrency)]
        if tenant.max_concurrency_total is not None:
            groups.append(Group(tenant.name, TOTAL, tenant.max_concurrency_total))
        # The gate's order (``proxy.admission.gate``): a priority is a head start in the line.
        head_start_ms = round(level * AGING_S_PER_LEVEL * 1000)
        ask = LeaseAsk(secrets.token_hex(8), slots, tuple(groups), tenant.max_queue, head_start_ms)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
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
                        async with asyncio.timeout(self.call_s):
                            outcome, soonest = await self.leases.acquire(ask, self._ttl_ms, join=wait_s > 0)
                    except REDIS_ERRORS as exc:
                        self.lost(exc)
                        continue  # the fallback answers this request at once
                    in_line = outcome == "wait" and wait_s > 0
                    if outcome == "granted":
                        self._held[ask.member] = ask
                        self._start_renewer()
                        return ClusterLease(self, ask, local=False)
                    if outcome == "full":
                        raise Rejected(
                            "queue_full",
                            PROBE_S,
                            f"tenant '{tenant.name}' is at its limit of {tenant.max_concurrency} concurrent "
                            f"requests and {tenant.max_queue} queued across the replicas; retry later",
                        )
                elif self.mode == "refuse":
                    raise SharedLimitsUnavailable(
                        "the shared limits (Redis) are unreachable and cluster.on_redis_error is refuse; "
                        "retry later",
                        self.probe_s,
                    )
                elif self._take_local(ask):
                    lease = self._local_leases[ask.member] = ClusterLease(self, ask, local=True)
                    return lease
                remaining = deadline - loop.time()
                if remaining <= 0:
                    own = " (the request's own maximum wait)" if wait_s < tenant.queue_timeout_s else ""
                    raise Rejected(
                        "queue_timeout",
                        PROBE_S,
                        f"tenant '{tenant.name}' waited {wait_s:g} s for a free slot across the "
                        f"replicas{own}; retry later",
                    )
                pause = min(delay * random.uniform(0.5, 1.0), remaining, max(soonest, _FIRST_RETRY_S))  # noqa: S311
                if await self._wait_release(pause):
                    continue  # a lease of ours was freed: ask now, same backoff
                delay = min(delay * 2, _MAX_RETRY_S)
        finally:
            if in_line:
                self.spawn(self._give_back(ask))

    def _take_local(self, ask: LeaseAsk) -> bool:
        """Under the fallback: each replica allows a tenant its share of each limit, counting every
        request it holds, those admitted under the fallback and those still running on leases that
        Redis granted before it became unreachable."""
        replicas = self.settings.replicas
        if any(self._holding(g.key) + ask.slots > max(1, g.limit // replicas) for g in ask.groups):
            return False
        for g in ask.groups:
            self._local[g.key] += ask.slots
        self._local_held += ask.slots
        return True

    def _holding(self, group: str) -> int:
        """Slots this replica's requests hold in one lease group (by its key), however they got them."""
        leased = sum(a.slots for a in self._held.values() for g in a.groups if g.key == group)
        return self._local[group] + leased

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
                self._local[g.key] -= ask.slots
                if self._local[g.key] <= 0:
                    del self._local[g.key]
            self._local_held -= ask.slots
            self._wake()
            return
        self._held.pop(ask.member, None)
        self.spawn(self._give_back(ask, wake=True))

    async def _give_back(self, ask: LeaseAsk, wake: bool = False) -> None:
        """Remove the leases (or the place in line) from Redis; a failure leaves them to expire."""
        try:
            if self.mode == "cluster":
                async with asyncio.timeout(self.call_s):
                    await self.leases.release(ask)
        except REDIS_ERRORS as exc:
            self.lost(exc)
        finally:
            if wake:
                self._wake()

    # --- modes -----------------------------------------------------------------------------------------
    def lost(self, exc: BaseException) -> None:
        """Redis failed a call: switch to ``cluster.on_redis_error`` (once) and probe until it is back."""
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

    async def _watch(self) -> None:
        """While the mode is ``cluster``, ping Redis every interval: a replica with no request to fail
        still notices an outage (``lost``: the mode switches, one log line; ``_probe`` takes over)."""
        while True:
            await asyncio.sleep(self.probe_s)
            if self.mode != "cluster":
                continue
            try:
                async with asyncio.timeout(self.call_s):
                    await self.leases.ping()
            except REDIS_ERRORS as exc:
                self.lost(exc)

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            # Every request running here counts in Redis before anyone is admitted by it again: those
            # that held leases through the outage and those admitted under the local fallback.
            running = [*self._held.values(), *(lease.ask for lease in self._local_leases.values())]
            try:
                async with asyncio.timeout(self.call_s):
                    await self.leases.ping()
                    await self.leases.renew(running, self._ttl_ms)
            except REDIS_ERRORS:
                self.redis_errors += 1
                continue
            self._resume(running)
            return

    def _resume(self, renewed: list[LeaseAsk]) -> None:
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
            self.spawn(self._renew_now(late))
        if self._held:
            self._start_renewer()
        _log.info("Redis answers again: shared limits resumed", extra={"fields": {"mode": "cluster"}})
        for resumed in self.on_resume:
            resumed()

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

    async def _renew_now(self, asks: list[LeaseAsk]) -> None:
        try:
            async with asyncio.timeout(self.call_s):
                await self.leases.renew(asks, self._ttl_ms)
        except REDIS_ERRORS as exc:
            self.lost(exc)
            return
        self._settle(asks)

    def _settle(self, renewed: list[LeaseAsk]) -> None:
        """A lease released while its renewal was on its way may have been put back in Redis after its
        release (two connections, no order between them): release it again, or it would count a TTL."""
        for ask in renewed:
            if ask.member not in self._held:
                self.spawn(self._give_back(ask))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` off the request's path; ``aclose`` lets it finish."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Let pending releases finish (bounded by their own timeouts), stop the tasks, close the client."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.call_s + 0.5)
        for task in (self._renewer, self._prober, self._watcher, *self._tasks):
            if task is not None:
                task.cancel()
        await self.leases.client.aclose()
