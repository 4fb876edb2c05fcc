"""One served model: what the daemon said about it (``ModelEntry``), its own admission gate (sized to its
child's slots at every read of the child's snapshot) and the bookkeeping an idle unload and a drain read.

A lane never points back at the door (``proxy.state``): it knows its model, its gate and its requests.
Tenants' limits (``max_concurrency``, ``max_queue``, ...) apply per lane, so a tenant may hold
``max_concurrency`` slots of every model it uses at once; ``max_concurrency_total`` bounds the sum over
every lane at the door (``proxy.admission.totals``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from proxy.admission.gate import SlotGate
from proxy.admission.idle import IdleWaiters
from proxy.admission.poison import Quarantine
from proxy.conversations.tier import DiskTier, SlotActions
from proxy.errors import NotReady
from proxy.settings import TenantSettings
from proxy.source import AnnouncesChanges, UpstreamSnapshot, UpstreamSource

# Longest wait between two reads of the snapshot while waiting for a change: how late a change the source
# does not announce (the daemon draining, a source that announces nothing) is seen.
_REREAD_S = 0.25


@runtime_checkable
class LoadsOnDemand(Protocol):
    async def ensure_loaded(self) -> None:
        """Return once the model's child is READY; raise ``NotReady`` (with why) when it cannot be."""
        ...


@runtime_checkable
class OperatorControl(Protocol):
    """What an operator may do to one model (``/admin/models``), implemented by the daemon's model host:
    the proxy drains the model's lane before ``unload`` and refuses to unload an ``always`` model itself."""

    def control_report(self) -> Mapping[str, object]:
        """Non-secret figures the proxy cannot know: ``budget_bytes``, ``budget_share``, ``loads``."""
        ...

    async def load(self) -> None:
        """Load the model and return once it is READY; raise ``NotReady`` saying why it cannot be (its
        budget does not fit: which models hold the memory)."""
        ...

    async def unload(self, reason: str) -> None:
        """Stop the model's child; ``Conflict`` for a model that must stay loaded."""
        ...


@dataclass(frozen=True)
class ModelEntry:
    """What the daemon tells the proxy about one served model."""

    name: str
    aliases: tuple[str, ...]
    source: UpstreamSource
    residency: str = "always"  # "always" | "on_demand"


class Lane:
    def __init__(self, entry: ModelEntry, tenants: Iterable[TenantSettings]) -> None:
        self.entry = entry
        self.gate = SlotGate(tenants, capacity=0)
        self._boot: str | None = None  # the per-boot secret of the child the gate's slot map is for
        # Its conversations' states on disk, under the slots (``proxy.conversations.tier``).
        self.tier = DiskTier(entry.name)
        # After a death of its child, the replays go one at a time (``proxy.admission.poison``).
        self.quarantine = Quarantine()
        self.last_used = time.monotonic()
        self._active = 0
        self._idle = IdleWaiters()

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def on_demand(self) -> bool:
        return self.entry.residency == "on_demand"

    @property
    def busy(self) -> bool:
        """Holds, awaits or is about to ask for a slot: an idle unload must not pick it."""
        adm = self.gate
        return adm.in_flight > 0 or adm.queued > 0 or adm.lingering > 0 or self._active > 0

    @property
    def active(self) -> int:
        """Requests that chose this model and are being handled."""
        return self._active

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def track_active(self, delta: int) -> None:
        self._active += delta
        if self._active == 0:
            self._idle.wake()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request of this model is being handled; True if that happened in time. New
        requests are kept away by whoever calls (``ModelRouter.remove``), not here."""
        if self._active == 0:
            return True
        return await self._idle.wait(timeout_s)

    def snapshot(self) -> UpstreamSnapshot:
        """One consistent view of the child for this request; keeps the gate equal to its slots."""
        snap = self.entry.source.snapshot()
        gate = self.gate
        # A new child is a new generation, or a new per-boot secret: an on_demand model loaded again
        # after an unload starts a fresh supervisor, whose first child is generation 1 again.
        reborn = snap.secret is not None and snap.secret != self._boot
        if reborn or snap.slots != gate.capacity or snap.generation != gate.generation:
            gate.set_capacity(snap.slots, snap.generation)
            self._boot = snap.secret or self._boot
        return snap

    async def save_states(self, snap: UpstreamSnapshot, child: SlotActions) -> int:
        """Save the states of the slots of ``snap``'s child (``child`` reaches it) that are idle and newer
        than their files: the child is about to stop on purpose. How many were saved; none when the
        gate's slot map is of another child."""
        if snap.base_url is None or snap.slot_states is None or self.gate.generation != snap.generation:
            return 0
        held, busy = self.gate.placed()
        return await self.tier.save_slots(snap.slot_states, snap.generation, child, held, busy)

    def states_lost(self) -> int:
        """The states folder was removed under the tier (the daemon made it again): its index forgets
        the states that went with it; how many."""
        folder = self.tier.folder
        if folder is None:
            return 0
        before = folder.files
        folder.rescan()
        return before - folder.files

    async def watch(self, until: Callable[[UpstreamSnapshot], bool], deadline: float) -> UpstreamSnapshot:
        """The child's snapshot as soon as ``until(snapshot)`` holds, else the last one read at ``deadline``
        (the loop's clock). Waits on the source's announced changes when it makes them, never in a busy
        loop: between two reads it sleeps until the next change or at most ``_REREAD_S``."""
        loop = asyncio.get_running_loop()
        while True:
            snap = self.snapshot()
            left = deadline - loop.time()
            if until(snap) or left <= 0:
                return snap
            source = self.entry.source  # read each time: a SIGHUP may give the lane a new entry
            if isinstance(source, AnnouncesChanges):
                await source.changed(min(left, _REREAD_S))
            else:
                await asyncio.sleep(min(left, _REREAD_S))

    def ready_snapshot(self) -> UpstreamSnapshot:
        snap = self.snapshot()
        if not snap.ready or snap.base_url is None:
            raise NotReady(f"llama-server is not ready ({snap.reason or snap.state})", snap.retry_after_s)
        return snap
