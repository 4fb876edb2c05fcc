"""Poison requests: a request that kills its child is never sent a third time, and its key cools down.

A generation whose child died before any byte of its answer reached the client runs once more on the
next child (``proxy.routes.replay``). That recovery must not turn one bad request into an outage (issue
48: a body that aborts the pinned llama-server, replayed, killed the next child too). So:

- **Quarantine** (per model, ``Quarantine``). After a death, the requests that were in flight on the dead
  child are replayed *one at a time*, each alone with the new child until its attempt ends, and requests
  that were not in flight wait meanwhile (they give their slot back and queue at the head again,
  ``Pipeline.retake_slot``). A death during a quarantined replay therefore has one suspect, that
  replay: innocent requests in flight at the first death are replayed on a child no suspect shares, and
  no request that arrived later is ever in flight beside a suspect. The price: after a crash, the model
  serves the replays one by one before anything else (seconds for ordinary requests; replays are rare).
- **Verdict**: a request whose replay's child died is poison: it is not sent again (``PoisonRequest``,
  502), counted by model, tenant and key (``llamagate_poison_requests_total``, the access log's outcome).
  A hang counts as a death: the supervisor kills a child whose loop stops answering, so its requests see
  their connection close as at a crash. One request's way through all this is
  ``proxy.routes.replay.Recovery`` (its steps, and the verdict with its metric and log).
- **Cool-down** (``Poison``, one per door): a key with ``proxy.poison.strikes`` poison requests within
  ``window_s`` is refused for ``cooldown_s`` (429 ``key_cooling_down`` with ``Retry-After``), and the
  body of a poison request is refused from every key for ``cooldown_s`` (``poison_body``): one key
  cannot crash-loop a child, nor many keys sending the same body. Alone, both are this replica's memory
  (a restart forgets them); the supervisor's restarts never give up on a child that was READY
  (docs/operations.md), so at worst a key costs ``2 x strikes`` deaths per cool-down.
- **Shared** (``Poison.share``, with ``cluster.redis_url``: ``proxy.cluster.poison``): each strike is sent
  to the replicas' Redis before its 502 leaves, and every replica learns it (``learn_*``) into this same
  memory, so a poison body costs two deaths in all, not two on each replica, and a key's strikes count
  across the replicas. ``check`` stays a lookup in this memory: no Redis round trip on the request path.
  While Redis is unreachable the memory is this replica's alone again; what it judged meanwhile goes to
  Redis once it answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict, deque
from typing import Protocol

from proxy.errors import Rejected, UpstreamGone
from proxy.settings import PoisonSettings

# Most poison bodies remembered at once (their sha256 and until when): a flood of distinct poisons
# forgets the oldest first, and costs its keys their cool-down all the same.
MAX_BODIES = 1024


class PoisonRequest(UpstreamGone):
    """This request was in flight at two deaths of its model's child: it is not sent again."""

    code = "poison_request"
    outcome = "rejected:poison"

    def __init__(self) -> None:
        super().__init__(
            "this request was in flight when its model's llama-server died, twice (the second time alone with"
            " a new child): it is not sent again; the service goes on for everyone else"
        )


class PoisonRefusal(Rejected):
    """429 for a key that cools down (``key_cooling_down``) or a body that killed two children
    (``poison_body``): the reason is the error's code, so a client can tell it from a full queue."""

    def __init__(self, reason: str, retry_after_s: float, message: str) -> None:
        super().__init__(reason, retry_after_s, message)
        self.code = reason


class PoisonShare(Protocol):
    """Where a strike judged here goes for the other replicas (``proxy.cluster.poison.SharedPoison``)."""

    def strike(self, key_id: str, digest: bytes, settings: PoisonSettings) -> bool | None:
        """Count the strike where every replica sees it; True: the key now cools down by the shared
        count, False: not yet, None: not shared (the other replicas are out of reach)."""
        ...


class Poison:
    """The door's memory of poison requests: strikes and cool-downs per key, refused bodies."""

    def __init__(self, settings: PoisonSettings) -> None:
        self.settings = settings
        self._strikes: dict[str, deque[float]] = {}
        self._cooling: dict[str, float] = {}  # key id -> until (monotonic)
        self._bodies: OrderedDict[bytes, float] = OrderedDict()  # sha256 -> until
        # The other replicas' memory (``proxy.cluster.poison``); None: this replica alone.
        self.share: PoisonShare | None = None

    def configure(self, settings: PoisonSettings) -> None:
        self.settings = settings

    def check(self, key_id: str, raw: bytes) -> None:
        """Refuse a key that cools down, or a body that killed two children (``Rejected``, 429)."""
        now = time.monotonic()
        until = self._cooling.get(key_id)
        if until is not None:
            if now < until:
                raise PoisonRefusal(
                    "key_cooling_down",
                    until - now,
                    f"this key's requests were in flight at two deaths of a model's llama-server "
                    f"{self.settings.strikes} time(s) within {self.settings.window_s:g} s: it is refused "
                    f"for {self.settings.cooldown_s:g} s (proxy.poison)",
                )
            del self._cooling[key_id]
        if self._bodies and raw:
            digest = hashlib.sha256(raw).digest()
            until = self._bodies.get(digest)
            if until is not None and now < until:
                raise PoisonRefusal(
                    "poison_body",
                    until - now,
                    "this request body was in flight at two deaths of a model's llama-server: it is refused "
                    f"from every key for {self.settings.cooldown_s:g} s (proxy.poison)",
                )

    def strike(self, key_id: str, raw: bytes) -> bool:
        """A request of ``key_id`` with body ``raw`` was judged poison. True when the key now cools down
        (by this replica's count, or by the replicas' shared one)."""
        digest = hashlib.sha256(raw).digest()
        self.learn_body(digest, self.settings.cooldown_s)
        cooling = self.learn_strike(key_id)
        shared = self.share.strike(key_id, digest, self.settings) if self.share is not None else None
        if shared and not cooling:
            self.learn_cooling(key_id, self.settings.cooldown_s)
            cooling = True
        return cooling

    # --- what this replica judged, or learned from the others (``proxy.cluster.poison``) ---------------
    def learn_body(self, digest: bytes, remaining_s: float) -> None:
        """Refuse the body of sha256 ``digest`` for ``remaining_s`` more (or longer, if already so)."""
        until = time.monotonic() + remaining_s
        if until > self._bodies.get(digest, 0.0):
            self._bodies[digest] = until
            self._bodies.move_to_end(digest)
        while len(self._bodies) > MAX_BODIES:
            self._bodies.popitem(last=False)

    def learn_strike(self, key_id: str) -> bool:
        """One more strike of ``key_id``, now. True when the key now cools down (``strikes`` within
        ``window_s``)."""
        now = time.monotonic()
        s = self.settings
        times = self._strikes.setdefault(key_id, deque())
        times.append(now)
        while times and now - times[0] > s.window_s:
            times.popleft()
        if len(times) >= s.strikes:
            del self._strikes[key_id]
            self.learn_cooling(key_id, s.cooldown_s)
            return True
        return False

    def learn_cooling(self, key_id: str, remaining_s: float) -> None:
        """Refuse ``key_id`` for ``remaining_s`` more (or longer, if already so)."""
        until = time.monotonic() + remaining_s
        if until > self._cooling.get(key_id, 0.0):
            self._cooling[key_id] = until

    def verdicts(self) -> tuple[list[tuple[bytes, float]], list[tuple[str, float]]]:
        """What is refused now, with the seconds left: the bodies (by sha256) and the keys."""
        now = time.monotonic()
        bodies = [(d, until - now) for d, until in self._bodies.items() if until > now]
        keys = [(k, until - now) for k, until in self._cooling.items() if until > now]
        return bodies, keys


class ReplayTurn:
    """A replay's turn alone with the model's child; ``passed`` (idempotent) ends it."""

    __slots__ = ("_done", "_quarantine")

    def __init__(self, quarantine: Quarantine) -> None:
        self._quarantine = quarantine
        self._done = False

    def passed(self) -> None:
        if not self._done:
            self._done = True
            self._quarantine.release_turn()
            self._quarantine.leave()


class Quarantine:
    """One model's replays after a death: one at a time, nothing else sent meanwhile."""

    def __init__(self) -> None:
        self._pending = 0  # replays announced and not yet passed
        self._turn = asyncio.Lock()
        self._clear = asyncio.Event()
        self._clear.set()

    @property
    def active(self) -> bool:
        return self._pending > 0

    def enter(self) -> None:
        """A request in flight at a death will be replayed: from now on, nothing else is sent."""
        self._pending += 1
        self._clear.clear()

    def leave(self) -> None:
        """A replay announced with ``enter`` passed, or will not be sent after all."""
        self._pending -= 1
        if self._pending <= 0:
            self._pending = 0
            self._clear.set()

    async def take_turn(self) -> ReplayTurn:
        """Wait for the turn alone with the child (the caller bounds the wait with its deadline)."""
        await self._turn.acquire()
        return ReplayTurn(self)

    def release_turn(self) -> None:
        """The replay whose turn it was is done with the child: the next one may take it
        (``ReplayTurn.passed`` calls it, once)."""
        self._turn.release()

    async def cleared(self) -> None:
        """Return once no replay is pending (the caller bounds the wait)."""
        await self._clear.wait()
