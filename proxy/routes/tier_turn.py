"""One attempt's turn through its model's disk tier (``proxy.conversations.tier``), as one ``async with``.

The tier's policy is its own module's; this is the part of it that needs the request's way to the child
and back, which the tier cannot import (``conversations`` sits below ``upstream`` and ``streams``,
tests/unit/test_layout.py): the child's slot actions for the attempt (``ChildSlots``, over the snapshot's
address and secret), the usage tap the relay fills when no account does (the tier reads the turn's cached
count from it), and, whatever the attempt's end, the child's reported prompt and cached tokens handed
back (``DiskTier.after_turn``: checked reuse, the counts).
"""

from __future__ import annotations

from types import TracebackType

from proxy.conversations.slots import Pin
from proxy.conversations.tier import DiskTier, Turn
from proxy.source import UpstreamSnapshot
from proxy.streams.formats import StreamFormat
from proxy.streams.relay import Relay
from proxy.streams.usage import UsageTap
from proxy.upstream.pool import Upstream
from proxy.upstream.slot_actions import ChildSlots


class TierTurn:
    """``async with TierTurn(...) as tier``: before the block, what the slot replaces is saved and the
    conversation's own state restored; inside it, ``tier.tap`` is the usage tap to give the relay, and
    the caller sets ``tier.relay``; after it, the tier hears what the child reported."""

    __slots__ = (
        "_child",
        "_fmt_usage",
        "_key",
        "_pin",
        "_placed",
        "_snap",
        "_tenant",
        "_tier",
        "relay",
        "tap",
    )

    def __init__(
        self,
        tier: DiskTier,
        upstream: Upstream,
        snap: UpstreamSnapshot,
        pin: Pin | None,
        *,
        key: str | None,
        tenant: str,
        request_id: str,
        tap: UsageTap | None,
        fmt: StreamFormat,
    ) -> None:
        """``key``: the conversation whose state the turn may reuse (None: it may not, or has none);
        ``tap``: the account's usage tap, if any."""
        self._tier = tier
        self._child = ChildSlots(upstream, snap, request_id)
        self._snap = snap
        self._pin = pin
        self._key = key
        self._tenant = tenant
        self._placed: Turn | None = None
        self.tap = tap
        self._fmt_usage = fmt.usage
        self.relay: Relay | None = None

    async def __aenter__(self) -> TierTurn:
        snap = self._snap
        self._placed = await self._tier.before_turn(
            snap.slot_states, snap.generation, self._child, self._pin, self._key, self._tenant
        )
        if self.tap is None and self._placed is not None:  # the tier reads the turn's cached count
            self.tap = UsageTap(self._fmt_usage)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._tier.after_turn(self._placed, *reported(self.relay))


def reported(relay: Relay | None) -> tuple[int | None, int]:
    """(prompt, cached) tokens as the child reported them for the disk tier; (None, 0) when it did not."""
    if relay is None or relay.usage is None:
        return None, 0
    meter = relay.meter
    usage = relay.usage.result(meter.reports if meter is not None else ())
    return (usage.prompt, usage.cached) if usage.reported else (None, 0)
