"""A generation whose child died before any byte of its answer reached the client runs once more, on the
next READY child of the same model, instead of failing.

What the client already has decides (``RequestContext.response_started``): nothing of a non-streamed
answer until it is whole (the proxy assembles it, ``proxy.streams.assemble``), nothing of a stream until
the child's first event (the relay holds the ``200`` back until then, ``proxy.streams.relay``). A
failure that is the child going away with nothing out is a candidate: ``UpstreamGone`` (it hung up:
killed, crashed, restarted; reason ``closed``) or ``UpstreamUnreachable`` (it refused the connection: it
was already gone; reason ``refused``). Then:

1. **Is the child gone?** Within ``DEATH_GRACE_S`` the model's snapshot must say so: not READY, or
   another child (generation, address). The supervisor turns an exit into a transition within
   milliseconds of the hang-up, and it leaves READY before it kills a hung child or restarts one for a
   reload. A child that stays READY as it was hung up on its own: no replay, the request ends as it
   would have (``502``).
2. **The wait.** The request holds no slot meanwhile (the dead child's permit was given back without a
   linger: that child has no slot left to notice with). It waits for the model's next READY snapshot, on
   the source's announced changes (``Lane.watch``), within the request's own deadlines: a stream's first
   token within ``first_token_s`` of its first admission, any request's end within ``total_s`` of its
   arrival. It stops waiting at once when no child will come: the supervisor gave up (FAILED) or the
   daemon drains; then, or when no child came in time, the request gets what one arriving then gets:
   ``503`` with the supervisor's ``Retry-After`` (none when FAILED). A model no longer served (a reload
   removed it) ends the wait with the request's own failure (``502``).
3. **Once more, once, alone.** It takes its place back at the head of its tenant's queue
   (``SlotGate.acquire(front=True)``, the tenant's ``queue_timeout_s`` as for any wait there) and runs on
   the new child, alone with it until the child answered its head (``proxy.admission.poison``: the
   replays after a death go one at a time, and nothing else is sent meanwhile). There is no second
   replay: a replay whose child dies makes the request poison (502 ``poison_request``, its key strikes
   toward a cool-down), so a prompt that kills its child cannot take down every child in turn.

A hang ends here as a death does: the supervisor kills a child whose server loop stopped answering its
probe (docs/operations.md), so the requests in flight on it see their connection close and follow the
same steps, and a request in flight at two deaths or hangs is poison.

One request's part in all this (``Recovery``) is a state with named steps (FIRST, waiting, announced, in
turn, passed, poison) and the transitions between them; the endpoint's loop only asks it what to do
before an attempt and after a failure.

Counted where it happens: ``llamagate_replays_total{model,reason}`` and ``RequestContext.next_attempt``
(``replayed=1`` in the access log; the record, and the usage charged from it, is the final attempt's);
the poison verdict by ``Recovery``: ``llamagate_poison_requests_total{model,tenant,key}`` and a warning
in the log.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from proxy.admission.gate import Permit
from proxy.admission.inflight import Tracked
from proxy.admission.pipeline import Grant
from proxy.admission.poison import PoisonRequest, ReplayTurn
from proxy.asgi.context import RequestContext
from proxy.errors import NotReady, UpstreamFailure, UpstreamGone, UpstreamUnreachable
from proxy.models.lane import Lane
from proxy.source import UpstreamSnapshot
from proxy.state import ProxyState

_log = logging.getLogger("llamagate.proxy")
_T = TypeVar("_T")

# How long a hang-up may go unexplained by the model's snapshot before it is taken for a live child's.
DEATH_GRACE_S = 2.0
# At most this many attempts per request: the first and one replay.
ATTEMPTS = 2


def replay_reason(exc: UpstreamFailure, ctx: RequestContext) -> str | None:
    """The metric's reason when ``exc`` may be replayed (the child went away, nothing reached the client,
    no replay yet), else None."""
    if ctx.response_started or ctx.attempt >= ATTEMPTS:
        return None
    if isinstance(exc, UpstreamGone):
        return "closed"
    if isinstance(exc, UpstreamUnreachable):
        return "refused"
    return None


def _serving(snap: UpstreamSnapshot) -> bool:
    # READY with an address: between noticing an exit and stepping out of READY, the supervisor's
    # snapshot still says READY but has no address any more (what ``Lane.ready_snapshot`` refuses too).
    return snap.ready and snap.base_url is not None


class Replay:
    """The way back to a new child for one request whose child died (``replay_reason`` said so)."""

    __slots__ = ("_ctx", "_lane", "_state")

    def __init__(self, state: ProxyState, lane: Lane, ctx: RequestContext) -> None:
        self._state = state
        self._lane = lane
        self._ctx = ctx

    async def next_child(
        self, failed: UpstreamSnapshot, error: UpstreamFailure, reason: str, deadline: float
    ) -> None:
        """Return once a READY child serves the model again (the request is then counted as replayed and
        may be admitted again, at the head of its tenant's queue). Raises ``error`` when the child that
        failed is alive or the model is no longer served (no replay), ``NotReady`` (503, from the
        snapshot as a request arriving then gets it) when no child came before ``deadline`` (the loop's
        clock) or none will."""
        if not await self.died(failed, deadline) or not self._served():
            raise error
        self._state.metrics.observe_replay(self._lane.name, reason)
        self._ctx.next_attempt()
        await self.serving(deadline, error)

    async def died(self, failed: UpstreamSnapshot, deadline: float | None = None) -> bool:
        """The child that served ``failed`` is gone (within ``DEATH_GRACE_S``): not READY any more, or
        another child. False for a live child that hung up on its own."""
        loop = asyncio.get_running_loop()
        grace = loop.time() + DEATH_GRACE_S

        def gone(s: UpstreamSnapshot) -> bool:
            return (
                not s.ready
                or s.generation != failed.generation
                or (s.base_url, s.secret) != (failed.base_url, failed.secret)
            )

        seen = await self._lane.watch(gone, grace if deadline is None else min(deadline, grace))
        return gone(seen)

    async def serving(self, deadline: float, error: UpstreamFailure | None = None) -> None:
        """Return once a READY child serves the model; ``NotReady`` (503) when none came before
        ``deadline`` or none will; ``error`` (or 502) when the model is no longer served."""
        await self._lane.watch(lambda s: _serving(s) or self._hopeless(s), deadline)
        if not self._served():
            raise error or UpstreamFailure(f"the model '{self._lane.name}' is no longer served")
        self._lane.ready_snapshot()  # the 503 of a request arriving now when the model is still not READY

    def _served(self) -> bool:
        return self._state.router.lanes.get(self._lane.name) is self._lane

    def _hopeless(self, snap: UpstreamSnapshot) -> bool:
        """No child is coming for this request: the supervisor gave up, the daemon stops, or the model
        is not served any more."""
        return snap.state == "FAILED" or self._state.draining or not self._served()


class Step(enum.Enum):
    """Where one request stands in the replay protocol (``Recovery``)."""

    FIRST = "first"  # its first attempt, or before it: nothing happened to it yet
    WAITING = "waiting"  # another crash's replays are being tried alone: it gave its slot back and waits
    ANNOUNCED = "announced"  # its child died (or hung and was killed) under it: it will be replayed
    IN_TURN = "in turn"  # its replay, alone with the new child
    PASSED = "passed"  # it left the quarantine: its replay ended (or it was never sent again)
    POISON = "poison"  # its replay's child died too: it is not sent again


# Every step ``Recovery`` may take from each step (Supervisor's transition table, ``states.py``): any
# other is a bug in its caller, refused before it changes anything.
TRANSITIONS: dict[Step, frozenset[Step]] = {
    Step.FIRST: frozenset({Step.WAITING, Step.ANNOUNCED}),
    Step.WAITING: frozenset({Step.FIRST}),
    Step.ANNOUNCED: frozenset({Step.IN_TURN, Step.PASSED}),
    Step.IN_TURN: frozenset({Step.PASSED, Step.POISON}),
    Step.PASSED: frozenset(),
    Step.POISON: frozenset(),
}


class Recovery:
    """One request's way through the protocol after deaths of its model's child, as a state (``step``)
    and its transitions; the endpoint's loop calls ``before_attempt``, ``failed`` and ``close``.

    ::

        FIRST --quarantine active--> WAITING --cleared, slot retaken--> FIRST
        FIRST --failed: child gone, nothing out--> ANNOUNCED --next child READY, slot, turn--> IN_TURN
        IN_TURN --failed: its child died--> POISON        (PoisonRequest: strike, metric, log)
        ANNOUNCED, IN_TURN --close--> PASSED              (the quarantine is left, the turn passed)

    A hang is a death here: the supervisor kills a child whose loop stopped answering its probe, so the
    requests in flight see their connection close (reason ``closed``) exactly as at a crash, and a request
    in flight at two deaths or hangs is poison. The proxy cannot tell the two apart from the hang-up, and
    need not: the supervisor counts hangs (by model and reason), the proxy counts replays and verdicts.
    """

    __slots__ = (
        "_ctx",
        "_deadline",
        "_entry",
        "_failure",
        "_grant",
        "_lane",
        "_quarantine",
        "_received",
        "_replayable",
        "_since",
        "_state",
        "_turn",
        "step",
    )

    def __init__(
        self,
        state: ProxyState,
        lane: Lane,
        ctx: RequestContext,
        grant: Grant,
        received: bytes,
        deadline: float,
        *,
        replayable: bool,
        entry: Tracked | None = None,
    ) -> None:
        """``received``: the body as the client sent it (a poison body is remembered by its digest);
        ``deadline``: the loop-clock end of any wait before an attempt (the request's own deadlines);
        ``replayable``: the route may be replayed at all; ``entry``: the request's line in the registry."""
        self._state = state
        self._lane = lane
        self._ctx = ctx
        self._grant = grant
        self._received = received
        self._deadline = deadline
        self._replayable = replayable
        self._entry = entry
        self._quarantine = lane.quarantine
        self._failure: tuple[UpstreamSnapshot, UpstreamFailure, str] | None = None
        self._turn: ReplayTurn | None = None
        self._since = 0.0
        self.step = Step.FIRST

    async def before_attempt(self, permit: Permit) -> Permit:
        """The permit to attempt with. FIRST: wait out another crash's replays (slot given back, then
        taken again at the head of the queue). ANNOUNCED: wait for the next READY child, the slot, then
        the turn alone with that child (IN_TURN). ``NotReady`` (503) when the wait ran out of time."""
        if self.step is Step.ANNOUNCED:
            return await self._take_turn()
        if self.step is not Step.FIRST:
            raise RuntimeError(f"replay protocol: no attempt after '{self.step.value}'")
        while self._quarantine.active:
            self._go(Step.WAITING)
            permit.release()  # replays are being tried alone with the child: give the slot back meanwhile
            await self._until(self._quarantine.cleared(), "a crash's replays")
            permit = await self._state.pipeline.retake_slot(self._grant)
            self._go(Step.FIRST)
        return permit

    async def failed(self, exc: UpstreamFailure, snap: UpstreamSnapshot | None) -> None:
        """The attempt failed with ``exc`` on the child ``snap`` named. Returns when the request is to be
        replayed (FIRST -> ANNOUNCED); raises otherwise: ``exc`` itself, or, in its turn when its child
        died with nothing of the answer out, ``PoisonRequest`` (-> POISON)."""
        if self.step is Step.IN_TURN:
            await self._judge(exc, snap)
            raise exc
        reason = replay_reason(exc, self._ctx) if self._replayable else None
        if self.step is not Step.FIRST or reason is None or snap is None:
            raise exc
        self._since = time.monotonic()
        if self._entry is not None:
            self._entry.queued()
        self._ctx.replays.append((reason, self._since))
        # Announced at once, before the next child is READY: nothing that was not in flight at the death
        # is sent to that child until the replays are done.
        self._go(Step.ANNOUNCED)
        self._quarantine.enter()
        self._failure = (snap, exc, reason)

    def close(self) -> None:
        """The request is done with the protocol, however it ended: an announced replay never sent
        leaves the quarantine (the requests behind it must not wait for it); a turn is passed."""
        if self.step is Step.ANNOUNCED:
            self._go(Step.PASSED)
            self._quarantine.leave()
        elif self._turn is not None:
            self._turn.passed()  # idempotent: leaves the quarantine once
            if self.step is Step.IN_TURN:
                self._go(Step.PASSED)

    async def _take_turn(self) -> Permit:
        assert self._failure is not None
        failed, error, reason = self._failure
        replay = Replay(self._state, self._lane, self._ctx)
        await replay.next_child(failed, error, reason, self._deadline)
        permit = await self._state.pipeline.retake_slot(self._grant)
        self._turn = await self._until(self._quarantine.take_turn(), "its turn after a crash")
        self._go(Step.IN_TURN)
        await replay.serving(self._deadline)  # it may have died meanwhile (``close`` passes the turn)
        self._ctx.queue_wait_s = (self._ctx.queue_wait_s or 0.0) + time.monotonic() - self._since
        return permit

    async def _judge(self, exc: UpstreamFailure, snap: UpstreamSnapshot | None) -> None:
        """A replay failed. If its child died, with nothing of the answer out, the request is poison: it
        was in flight at two deaths, the second time alone with the child (``proxy.admission.poison``)."""
        ctx = self._ctx
        if not isinstance(exc, UpstreamGone) or ctx.response_started or snap is None:
            return
        if not await Replay(self._state, self._lane, ctx).died(snap):
            return
        self._go(Step.POISON)
        ask = self._grant.ask
        cooling = self._state.poison.strike(ask.key_id, self._received)
        self._state.metrics.observe_poison(self._lane.name, ask.tenant.name, ask.key_id)
        _log.warning(
            "a request was in flight at two deaths of its model's llama-server: not sent again",
            extra={
                "fields": {
                    "request_id": ctx.request_id,
                    "model": self._lane.name,
                    "tenant": ask.tenant.name,
                    "key_id": ask.key_id,
                    "key_cools_down": cooling,
                }
            },
        )
        raise PoisonRequest() from exc

    def _go(self, to: Step) -> None:
        if to not in TRANSITIONS[self.step]:
            raise RuntimeError(f"replay protocol: no step from '{self.step.value}' to '{to.value}'")
        self.step = to

    async def _until(self, waiting: Awaitable[_T], what: str) -> _T:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await waiting
        except TimeoutError:
            raise NotReady(
                f"the model '{self._lane.name}' is being checked after its llama-server died; waiting for "
                f"{what} ran out of the request's time",
                1.0,
            ) from None
