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

Counted where it happens: ``llamagate_replays_total{model,reason}`` and ``RequestContext.next_attempt``
(``replayed=1`` in the access log; the record, and the usage charged from it, is the final attempt's).
"""

from __future__ import annotations

import asyncio

from proxy.asgi.context import RequestContext
from proxy.errors import UpstreamFailure, UpstreamGone, UpstreamUnreachable
from proxy.models.lane import Lane
from proxy.source import UpstreamSnapshot
from proxy.state import ProxyState

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
