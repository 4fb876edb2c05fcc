"""Which slot of one child a request runs on, so that conversations keep their state.

llama-server keeps each slot's last prompt state (the KV cells) and a RAM cache of earlier states
(``--cache-ram``, ``llama.prompt_cache_mib``). Read from the pinned source (tools/server/server-context.cpp
``get_available_slot``, server-task.cpp ``server_prompt_cache``):
- a request with ``id_slot`` runs on that slot; without it, the child picks an idle slot by prompt
  similarity or, failing that, the least recently used idle one;
- on the way in, the slot's current state is saved to the RAM cache and the cached state that best matches
  the new prompt is loaded ("update_cache") only when the similarity test fails or keeps less than half of
  the slot. With a shared system prompt the test passes for any slot, so another conversation's history
  was overwritten without being saved. llamagate starts the child with ``--slot-prompt-similarity 1.0``
  (no prompt can be more than 100 % similar: every request pinned to a used slot, or sent unpinned, goes
  through the RAM cache) and ``--no-cache-idle-slots`` (idle slots are not copied to the cache on every new
  task: the copy the RAM-cache restore bug of llama.cpp issue 27148 works from; the save on replacement
  above keeps every state that is replaced);
- a request pinned to a slot that was never used skips the cache (``f_keep`` is 0/0 there). The map
  fills empty slots first, so every slot has been used before any state is replaced and saved: while an
  empty slot is left, the cache holds nothing of ours such a pin could skip.

So the map keeps, per slot, the conversation key of the last request it ran (``proxy.conversations.key``)
and whether one of our requests holds it. A turn goes to the free slot that holds its conversation (its
state is there, nothing is copied); else to an empty slot (the highest-numbered, as the child's own
choice would be); else to the slot free for longest (its state is saved to the RAM cache on the way,
and the turn's own state, if cached, is loaded). Each choice is a lookup, not a scan: a gateway with
many slots pays no more per request than one with two. A turn never waits for its slot (the linger is
zero): admission order and fairness are the gate's (``proxy.admission.gate``), and the map only chooses
among the slots free when the gate grants. A slot busy with the same conversation (two requests of one
conversation at once) is simply not free.

Requests the map cannot place (several slots at once, an admin's own ``id_slot``, a route whose task
takes no ``id_slot``) are *anonymous*: the child places them. While one runs, the map does not know which
slots are free, so every request goes unpinned, and afterwards the slots not held are marked *unknown*
(used, holder not known). The gate and the map count the same slots: the gate grants a permit only when
a slot is free, and a permit frees its slot when the gate counts it free again (after a linger,
``Permit.release``). A new child (another generation or slot count) gets a new map.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# What a slot holds: a conversation key, or one of these.
EMPTY = "<empty>"  # never used since the child started
UNKNOWN = "<unknown>"  # used, by a request without a key or placed by the child


@dataclass(slots=True)
class Pin:
    """Where one request runs: ``slot`` is the ``id_slot`` to send (None: the child chooses)."""

    slot: int | None
    _map: SlotMap | None = field(default=None, repr=False)
    _width: int = 0  # anonymous: how many slots
    # What the slot held before this request (a conversation key, ``EMPTY`` or ``UNKNOWN``): when it is
    # another conversation's, the disk tier saves that one's state first (``proxy.conversations.tier``).
    replaced: str = EMPTY

    def free(self) -> None:
        """The request's slot is free again. Idempotent."""
        owner, self._map = self._map, None
        if owner is not None:
            owner._free(self)


class SlotMap:
    """The slots of one child (one generation): what each holds, which are ours now."""

    def __init__(self, slots: int, generation: int = 0) -> None:
        self.generation = generation
        self.held: list[str] = [EMPTY] * slots
        self.busy: list[bool] = [False] * slots
        self.anonymous = 0  # slots taken by requests the child places
        self._where: dict[str, int] = {}  # conversation key -> the slot that last ran it
        self._empty = list(range(slots))  # free and never used; the highest-numbered last
        self._idle: OrderedDict[int, None] = OrderedDict()  # free and used, freed longest ago first

    @property
    def slots(self) -> int:
        return len(self.held)

    def take(self, key: str | None, width: int = 1, placeable: bool = True) -> Pin:
        """A slot for a request of conversation ``key`` (None: no conversation) that the gate just
        admitted for ``width`` slots. ``placeable``: the request's task takes an ``id_slot``."""
        if width != 1 or not placeable or self.anonymous or not (self._empty or self._idle):
            self.anonymous += width
            return Pin(None, self, width)
        i = self._where.get(key) if key is not None else None
        if i is not None and i in self._idle:
            del self._idle[i]  # its own slot, free: its state is there
        elif self._empty:
            i = self._empty.pop()
        else:
            i, _ = self._idle.popitem(last=False)
        replaced = self.held[i]
        if self._where.get(replaced) == i:
            del self._where[replaced]
        self.held[i] = UNKNOWN if key is None else key
        if key is not None:
            self._where[key] = i
        self.busy[i] = True
        return Pin(i, self, replaced=replaced)

    def holding(self, key: str) -> int | None:
        """The slot whose last request was of conversation ``key``, if any."""
        return self._where.get(key)

    def _free(self, pin: Pin) -> None:
        if pin.slot is not None:
            self.busy[pin.slot] = False
            self._idle[pin.slot] = None
            return
        self.anonymous -= pin._width
        if self.anonymous == 0:
            # The child placed them: any slot not ours may hold anything now.
            for i in self._empty:
                self._idle[i] = None
            self._empty.clear()
            for i in self._idle:
                if self._where.get(self.held[i]) == i:
                    del self._where[self.held[i]]
                self.held[i] = UNKNOWN
