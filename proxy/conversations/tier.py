"""The disk tier under the slots: a conversation's state leaves a slot for disk, and comes back from it.

The slots hold the live states, llama-server's RAM prompt cache the recent ones (``--cache-ram``), and
the disk (``proxy.conversations.disk``) every conversation's last state, within a budget, across cache
overflow, reloads, unloads and restarts. The slot map (``proxy.conversations.slots``) says which
conversation each slot holds; this module acts on its choices, with the pinned server's own slot save
and restore (``POST /slots/ID?action=save|restore``, tools/server/server-context.cpp
``SERVER_TASK_TYPE_SLOT_SAVE``: ``llama_state_seq_save_file``, the slot's KV cells and tokens).

The policy, for a turn of conversation C placed on slot S (``before_turn``):
1. S held another conversation D whose state there is newer than its file (D ran a turn since it was
   last saved: ``_dirty``): D is saved first when it is likely to be read again and the write rate
   allows it (``proxy.conversations.writes``: the client named D, D has had a second turn, or D's
   tenant's conversations come back); else it is counted as not written (``skipped``). Saving on
   replacement writes a state once per time it leaves a slot, never per turn; a conversation that keeps
   its slot is never written. The save runs in the child's loop, so the child's other slots wait while
   it writes (docs/benchmarks.md measures it); a write-behind on idle slots would move that wait but
   write every turn.
2. S did not hold C and C has a state on disk that may be restored (``StateDir.check``: ours, its
   tenant's, unchanged): it is restored into S. The turn then finds its whole history in S: llama-server
   copies S to its RAM cache on the way in (``--slot-prompt-similarity 1.0``: every pinned request
   goes through it) and keeps S's state, which matches the prompt best (server-task.cpp
   ``server_prompt_cache::load``). Without a file the turn goes as before: the RAM cache may hold C.
3. After the turn (``after_turn``): C's state in S is newer than its file. Checked reuse: a turn whose
   state was restored must show it in the child's own cached count (``cached_tokens``/``cache_n``): at
   least ``REUSED_SHARE`` of what was restored (or of the prompt, when shorter). A miss is counted
   (the turn was still computed correctly: llama-server evaluates whatever it did not reuse); after
   ``MISSES_TO_STOP`` misses in a row, of more than one tenant, the tier stops restoring for the model
   and says so in the log (llama.cpp issue 26676 reports restores that are silently not reused). A
   tenant's own misses in a row stop restores for that tenant only: a client that rewrites its history
   misses by its own doing, and must not turn the tier off for everyone.

Before a child stops on purpose (SIGHUP reload, idle unload, drain, stop) ``save_slots`` saves every slot
whose state is newer than its file and likely to be read again (the rate bound aside: at most a state
per slot); the next child of the same identity restores them on demand. A crash
keeps what was already on disk. A child of another identity gets another folder (``SlotStates``).

Prompt tokens by source, per tenant (``stats``): ``cache`` (served from the slot or the RAM cache),
``disk`` (the part of the cached tokens a restore brought), ``computed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from proxy.conversations.disk import StateDir, StateDirError
from proxy.conversations.slots import Pin
from proxy.conversations.writes import SEEN, WritePolicy
from proxy.source import SlotStates

_log = logging.getLogger("llamagate.proxy")

# A restored turn "reused" its state when the child's cached count is at least this share of the restored
# tokens (or of the prompt, when shorter). Not all of it: the slot's last tokens are the previous
# answer as generated, and the client's re-rendered history may tokenize its end differently.
REUSED_SHARE = 0.9
# Misses in a row after which the tier stops restoring for the model.
MISSES_TO_STOP = 3
# Longest wait for one save or restore: the child defers it while the slot is still busy (a request
# the proxy abandoned, until the child notices), and runs it in its loop.
ACTION_TIMEOUT_S = 30.0


class SlotActionFailed(Exception):
    """The child refused or failed a save or restore (its message says why)."""


@dataclass(frozen=True, slots=True)
class SlotResult:
    """What the child reports of a save (``n_saved``, ``n_written``) or a restore (``n_restored``,
    ``n_read``): tokens, bytes, and its own milliseconds."""

    tokens: int
    bytes: int
    ms: float


class SlotActions(Protocol):
    """The child's slot save and restore (``proxy.upstream.slot_actions``)."""

    async def save(self, slot: int, filename: str) -> SlotResult: ...

    async def restore(self, slot: int, filename: str) -> SlotResult: ...


@dataclass(slots=True)
class Turn:
    """A turn the tier placed: its conversation, tenant, and the tokens restored for it (0: none)."""

    key: str
    tenant: str
    restored: int = 0


@dataclass
class TierStats:
    """Counters by tenant (Prometheus reads them at scrape time: ``proxy.metrics.tier``)."""

    prompt_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, source)
    saves: Counter[str] = field(default_factory=Counter)
    save_bytes: Counter[str] = field(default_factory=Counter)
    save_seconds: dict[str, float] = field(default_factory=dict)  # ours: the wait for the child's loop too
    # The child's own time on the file (its ``save_ms``/``restore_ms``): its loop, so its other slots, wait.
    save_child_seconds: dict[str, float] = field(default_factory=dict)
    restores: Counter[str] = field(default_factory=Counter)
    restore_bytes: Counter[str] = field(default_factory=Counter)
    restore_seconds: dict[str, float] = field(default_factory=dict)
    restore_child_seconds: dict[str, float] = field(default_factory=dict)
    # Restores whose state the turn did not reuse; states not restored, by why (``StateDir.check``,
    # "failed": the child refused it); states evicted for the budget; saves that failed.
    misses: Counter[str] = field(default_factory=Counter)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)
    evicted: Counter[str] = field(default_factory=Counter)
    save_failures: Counter[str] = field(default_factory=Counter)
    # States that left a slot unwritten, by why (``proxy.conversations.writes``): one_shot, rate.
    skipped: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, reason)


class DiskTier:
    """One model's disk tier (its lane's): the folder of its current child's identity and the policy."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats = TierStats()
        self.writes = WritePolicy()
        self.restoring = True  # false after ``MISSES_TO_STOP`` misses in a row (until the identity changes)
        self._states: SlotStates | None = None
        self._dir: StateDir | None = None
        self._broken: str | None = None  # why the folder cannot be used (said once in the log)
        self._generation: int | None = None
        self._dirty: dict[
            str, str
        ] = {}  # conversation key -> tenant: its slot's state is newer than its file
        self._misses: list[str] = []  # the tenants of the misses in a row (any tenant's hit ends it)
        self._tenant_misses: Counter[str] = Counter()  # each tenant's own misses in a row
        self._lock = asyncio.Lock()  # one index change at a time (the file work runs in threads)

    @property
    def folder(self) -> StateDir | None:
        return self._dir

    # --- the request path -------------------------------------------------------------------------------
    def named(self, key: str) -> None:
        """The client named conversation ``key`` (at the door: ``proxy.conversations.key.named``): its
        state is written whenever it leaves a slot."""
        self.writes.named(key)

    async def before_turn(
        self,
        states: SlotStates | None,
        generation: int,
        child: SlotActions,
        pin: Pin | None,
        key: str | None,
        tenant: str,
    ) -> Turn | None:
        """Save what the turn's slot replaces, restore the turn's own state; the turn to report back
        (``after_turn``), or None when the tier has nothing to do with it."""
        if pin is None or pin.slot is None:
            return None
        folder = self.configure(states, generation)
        if folder is None:
            return None
        replaced = pin.replaced
        if key is not None:
            # Counted before the state it displaces is decided (``proxy.conversations.writes``).
            self.writes.turn(key, tenant)
        if replaced != key and replaced in self._dirty:
            await self._leave(folder, child, pin.slot, replaced, bounded=True)
        if key is None:
            return None
        turn = Turn(key, tenant)
        if replaced != key and self.restores_for(tenant):
            turn.restored = await self._restore(folder, child, pin.slot, key, tenant)
        return turn

    def after_turn(self, turn: Turn | None, prompt: int | None, cached: int) -> None:
        """The turn ended: ``prompt`` and ``cached`` tokens as the child reported them (``prompt`` None:
        it reported nothing, so what its slot holds now is not known: never saved as the conversation's)."""
        if turn is None:
            return
        if prompt is None:
            self._dirty.pop(turn.key, None)
            return
        self._dirty.pop(turn.key, None)  # the most recent last: the oldest go first past the bound
        self._dirty[turn.key] = turn.tenant
        if len(self._dirty) > SEEN:
            # Keys whose slot the child placed another request on (``slots.UNKNOWN``) are never replaced
            # by us: without a bound they would stay here.
            del self._dirty[next(iter(self._dirty))]
        from_disk = min(cached, turn.restored)
        tokens = self.stats.prompt_tokens
        tokens[turn.tenant, "cache"] += cached - from_disk
        tokens[turn.tenant, "disk"] += from_disk
        tokens[turn.tenant, "computed"] += max(0, prompt - cached)
        if not turn.restored:
            return
        if cached >= REUSED_SHARE * min(turn.restored, prompt):
            self._misses.clear()
            self._tenant_misses[turn.tenant] = 0
            return
        self.stats.misses[turn.tenant] += 1
        self._misses.append(turn.tenant)
        self._tenant_misses[turn.tenant] += 1
        if self._tenant_misses[turn.tenant] == MISSES_TO_STOP:
            _log.warning(
                "conversation states restored from disk were not reused: restores stopped for the tenant",
                extra={
                    "fields": {"model": self.model, "tenant": turn.tenant, "misses_in_a_row": MISSES_TO_STOP}
                },
            )
        if len(self._misses) >= MISSES_TO_STOP and len(set(self._misses)) > 1 and self.restoring:
            self.restoring = False
            _log.warning(
                "conversation states restored from disk were not reused: restores stopped for the model",
                extra={"fields": {"model": self.model, "misses_in_a_row": len(self._misses)}},
            )

    def restores_for(self, tenant: str) -> bool:
        """Restores are on for the model and ``tenant``."""
        return self.restoring and self._tenant_misses[tenant] < MISSES_TO_STOP

    # --- a planned stop ---------------------------------------------------------------------------------
    async def save_slots(
        self,
        states: SlotStates | None,
        generation: int,
        child: SlotActions,
        held: list[str],
        busy: list[bool],
    ) -> int:
        """Save every idle slot's state that is newer than its file (the child is about to stop); how
        many were saved."""
        folder = self.configure(states, generation)
        if folder is None:
            return 0
        saved = 0
        for slot, key in enumerate(held):
            if key in self._dirty and not busy[slot] and await self._leave(folder, child, slot, key, False):
                saved += 1
        return saved

    # --- internals --------------------------------------------------------------------------------------
    def configure(self, states: SlotStates | None, generation: int) -> StateDir | None:
        """The folder of the child of ``generation`` (opened again when its identity or budget changed)."""
        if generation != self._generation:
            # A new child: its slots hold nothing of the old one's, and nothing of theirs is newer.
            self._generation = generation
            self._dirty.clear()
        if states != self._states:
            self._open(states)
        self.writes.limit(None if states is None else states.write_bytes_s)
        return self._dir

    def _open(self, states: SlotStates | None) -> None:
        old = self._states
        self._states, self._dir, self._broken = states, None, None
        if states is None:
            return
        if old is None or old.identity != states.identity:
            self.restoring = True
            self._misses.clear()
            self._tenant_misses.clear()
        try:
            self._dir = StateDir(states)
        except (OSError, StateDirError) as exc:
            self._broken = str(exc)
            _log.error(
                "the conversation states folder cannot be used: the disk tier is off for the model",
                extra={"fields": {"model": self.model, "error": self._broken}},
            )

    async def _leave(self, folder: StateDir, child: SlotActions, slot: int, key: str, bounded: bool) -> bool:
        """``key``'s state leaves slot ``slot``: saved when it is likely to be read again (and, when
        ``bounded``, the write rate allows it); whether it was."""
        # Taken off first: a turn of the same conversation on another slot that ends meanwhile makes its
        # newer state dirty again, and that mark must stay.
        tenant = self._dirty.pop(key)
        write, why = self.writes.reason(key, tenant)
        if write and bounded and not self.writes.may_write():
            write, why = False, "rate"
        if not write:
            self.stats.skipped[tenant, why] += 1
            return False
        return await self._save(folder, child, slot, key, tenant)

    async def _save(self, folder: StateDir, child: SlotActions, slot: int, key: str, tenant: str) -> bool:
        temp = folder.temp_name()
        started = time.monotonic()
        try:
            result = await child.save(slot, temp)
            async with self._lock:
                _, evicted = await asyncio.to_thread(folder.commit, temp, key, tenant, result.tokens)
        except (SlotActionFailed, OSError, TimeoutError) as exc:
            # Its state leaves the slot all the same: the file keeps the one saved before.
            await asyncio.to_thread(folder.discard_temp, temp)
            self.stats.save_failures[tenant] += 1
            _log.warning(
                "a conversation state could not be saved",
                extra={
                    "fields": {"model": self.model, "slot": slot, "error": str(exc) or type(exc).__name__}
                },
            )
            return False
        self.writes.wrote(result.bytes)
        self.stats.saves[tenant] += 1
        self.stats.save_bytes[tenant] += result.bytes
        _add(self.stats.save_seconds, tenant, time.monotonic() - started)
        _add(self.stats.save_child_seconds, tenant, result.ms / 1000)
        for gone in evicted:
            self.stats.evicted[gone.tenant] += 1
        return True

    async def _restore(self, folder: StateDir, child: SlotActions, slot: int, key: str, tenant: str) -> int:
        started = time.monotonic()
        async with self._lock:
            entry, why = await asyncio.to_thread(folder.check, key, tenant)
        if entry is None:
            if why != "none":
                self.stats.refused[tenant, why] += 1
            return 0
        try:
            result = await child.restore(slot, entry.file)
        except (SlotActionFailed, TimeoutError) as exc:
            # The child cleared the slot: the turn is computed. A file it refuses is never offered again.
            self.stats.refused[tenant, "failed"] += 1
            async with self._lock:
                await asyncio.to_thread(folder.forget, key, entry.file)
            _log.warning(
                "a conversation state could not be restored: removed",
                extra={
                    "fields": {"model": self.model, "slot": slot, "error": str(exc) or type(exc).__name__}
                },
            )
            return 0
        folder.touch(key)
        self.stats.restores[tenant] += 1
        self.stats.restore_bytes[tenant] += result.bytes
        _add(self.stats.restore_seconds, tenant, time.monotonic() - started)
        _add(self.stats.restore_child_seconds, tenant, result.ms / 1000)
        return result.tokens


def _add(sums: dict[str, float], tenant: str, seconds: float) -> None:
    sums[tenant] = sums.get(tenant, 0.0) + seconds
