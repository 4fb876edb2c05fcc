"""Every generation request the proxy holds right now, queued or running, for every model: what
``GET /admin/requests`` lists and ``DELETE /admin/requests/{id}`` cancels.

Cheap on the request path on purpose (it is taken by every generation): a request is added to a set
when it starts waiting for its slot and removed at its end; admission flips two attributes; nothing
happens per token. What a listing shows beyond that is read when an operator asks: the tokens so far
from the stream's meter (the counter the relay keeps anyway), the times from the clock.

An entry holds ids, names and numbers only (never a prompt or a completion). It is keyed by nothing:
an ``X-Request-ID`` comes from the client when it sends a valid one, so two requests may share one, and
cancelling that id cancels both (an operator's look-up scans the set; it is short: the slots plus the
queues).

Cancelling goes through the request's ``Cancellable`` (``proxy.asgi.disconnect.ClientWatch``), the same
door as a client that leaves: the request task is cancelled wherever it waits (its queue, the child's
first byte, the next chunk of its stream), the cancellation unwinds through admission (a queued request
leaves its queue at once) and the upstream response (the child's connection is closed, so llama-server
stops the slot at its next token), and the request ends with the error it was given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal, Protocol

from proxy.errors import ProxyError

State = Literal["queued", "running"]


class Cancellable(Protocol):
    def cancel(self, error: ProxyError) -> bool:
        """Stop the request with ``error``; False when it is already ending (too late to cancel)."""
        ...


class Counted(Protocol):
    @property
    def tokens(self) -> int: ...


class Metered(Protocol):
    """The answer's relay: its meter counts the tokens of the attempt under way (None before it starts)."""

    @property
    def meter(self) -> Counted | None: ...


class Tracked:
    """One request in the registry. ``queued_at`` and ``running_at`` are ``time.monotonic`` readings."""

    __slots__ = (
        "handle",
        "key_id",
        "left",
        "model",
        "queued_at",
        "relay",
        "request_id",
        "route",
        "running_at",
        "tenant",
    )

    def __init__(
        self,
        request_id: str,
        tenant: str,
        key_id: str | None,
        model: str | None,
        route: str,
        handle: Cancellable,
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.key_id = key_id
        self.model = model
        self.route = route
        self.handle = handle
        self.queued_at = time.monotonic()
        self.running_at: float | None = None
        self.relay: Metered | None = None
        # Set only when an operator cancelled it and waits for it to leave (``InFlight.left``).
        self.left: asyncio.Future[None] | None = None

    def queued(self) -> None:
        """Waiting for a slot (again, after a replay: ``proxy.routes.replay``)."""
        self.running_at = None
        self.relay = None

    def running(self, relay: Metered) -> None:
        self.running_at = time.monotonic()
        self.relay = relay

    @property
    def state(self) -> State:
        return "queued" if self.running_at is None else "running"

    def row(self, now: float) -> dict[str, object]:
        """The entry as ``GET /admin/requests`` shows it."""
        running_at = self.running_at
        meter = self.relay.meter if self.relay is not None else None
        return {
            "id": self.request_id,
            "tenant": self.tenant,
            "key_id": self.key_id,
            "model": self.model,
            "route": self.route,
            "state": self.state,
            # Waited for a slot: until now while queued, until admission once running.
            "waited_s": round((running_at if running_at is not None else now) - self.queued_at, 3),
            "running_s": None if running_at is None else round(now - running_at, 3),
            "tokens": meter.tokens if meter is not None else 0,
        }


class InFlight:
    """The registry: one per proxy (every model's requests)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: set[Tracked] = set()

    def add(self, entry: Tracked) -> None:
        self._entries.add(entry)

    def remove(self, entry: Tracked) -> None:
        self._entries.discard(entry)
        if entry.left is not None and not entry.left.done():  # an operator waits for it to go
            entry.left.set_result(None)

    def __len__(self) -> int:
        return len(self._entries)

    def rows(self) -> list[dict[str, object]]:
        """Every entry, queued ones first, each group oldest first."""
        now = time.monotonic()
        order = sorted(self._entries, key=lambda e: (e.running_at is not None, e.queued_at))
        return [e.row(now) for e in order]

    def find(self, request_id: str) -> list[Tracked]:
        return [e for e in self._entries if e.request_id == request_id]

    def cancel(self, request_id: str, error: Callable[[], ProxyError]) -> dict[Tracked, dict[str, object]]:
        """Cancel every request with this id that is not already ending, each with an ``error()`` of its
        own: the ones cancelled, with their rows as they were (they unwind at the loop's next turn)."""
        now = time.monotonic()
        rows = {e: e.row(now) for e in self.find(request_id)}
        return {e: row for e, row in rows.items() if e.handle.cancel(error())}

    def left(self, entry: Tracked) -> asyncio.Future[None]:
        """Done once ``entry`` has left the registry (its request ended)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if entry in self._entries:
            entry.left = future
        else:
            future.set_result(None)
        return future
