"""Keeping an abandoned request's slots counted until llama-server has really let them go.

When the proxy abandons a request the child is still working on (client gone, deadline), the child frees
the slot only once it notices the closed connection: usually at its next token, but a loaded host has
been seen to take a second. ``SlotGate`` keeps the slots counted for a short timed linger, then until
``SlotsSettled.wait`` returns: the child's ``/slots`` shows no more busy slots than the other permits
account for.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from proxy.admission.gate import SlotGate
from proxy.errors import UpstreamFailure
from proxy.source import UpstreamSnapshot
from proxy.upstream.connection import UpstreamClosed
from proxy.upstream.pool import Upstream


class SlotsSettled:
    """After an abandoned request: wait until the child's ``/slots`` shows no more busy slots than the
    other permits account for (``held`` minus ours), polling every ``_SETTLE_POLL_S`` for at most
    ``_SETTLE_MAX_S``. llama-server usually notices within a token, but a loaded host has been seen to
    take a second; the timed linger alone was a guess. Polls run on the child's HTTP threads, not a slot.
    Any failure ends the wait (a dead or hung child is the supervisor's business, not a reason to keep
    slots forever)."""

    __slots__ = ("_gate", "_pool", "_request_id", "_slots", "_snap", "_snapshot")

    def __init__(
        self,
        snapshot: Callable[[], UpstreamSnapshot],
        gate: SlotGate,
        pool: Upstream,
        snap: UpstreamSnapshot,
        slots: int,
        request_id: str,
    ) -> None:
        self._snapshot = snapshot  # the child's state now (it may have been replaced meanwhile)
        self._gate = gate
        self._pool = pool
        self._snap = snap
        self._slots = slots
        self._request_id = request_id

    async def wait(self) -> None:
        try:
            async with asyncio.timeout(_SETTLE_MAX_S):
                while True:
                    busy = await self._busy()
                    if busy is None or busy <= self._gate.held - self._slots:
                        return
                    await asyncio.sleep(_SETTLE_POLL_S)
        except (TimeoutError, UpstreamFailure):
            return

    async def _busy(self) -> int | None:
        snap = self._snapshot()
        if not snap.ready or snap.generation != self._snap.generation:
            return None  # another child now: the old one's slots are gone
        response = await self._pool.open(snap, "GET", "/slots", None, self._request_id)
        try:
            content = await response.read()
        except UpstreamClosed:
            return None
        finally:
            response.release()
        if response.status != 200:
            return None
        try:
            slots = json.loads(content)
        except ValueError:
            return None
        if not isinstance(slots, list):
            return None
        return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))


_SETTLE_POLL_S = 0.05
_SETTLE_MAX_S = 10.0
