"""A sliding window of amounts (tokens or requests) over the last ``span`` seconds. Pure: the caller
passes the time, so tests drive it with a fake clock.

``width`` 0 keeps each charge with its own time: it counts for exactly ``span`` seconds, so "the last
minute" is exact and the time until there is room (``Retry-After``) is never more than the span. A
width above 0 sums charges into buckets of that many seconds (the day window: 1440 one-minute buckets
instead of one entry per request) and counts a bucket until ``span`` seconds after its *end*, so a charge
is never forgotten early: the window may count a charge up to ``width`` seconds too long, never too short.
That one-sidedness is what the budgets' bound rests on (``budgets``).

For the store, entries are summed per *group*: a second (width 0) or the bucket. A group is written as
one row, however many requests it holds, with the expiry of its newest entry; read back, it becomes one
entry counted until then: never shorter than any of its charges, so a restart keeps the bound too.
"""

from __future__ import annotations

import math
from array import array

# The dead entries at the front are dropped once they are this many and at least half of the arrays.
_COMPACT_AT = 1024


class Window:
    __slots__ = ("_amounts", "_groups", "_head", "_horizon", "_keys", "_total", "marked", "span", "width")

    def __init__(self, span: float, width: float = 0.0) -> None:
        self.span = span
        self.width = width
        # The entries, oldest first, from ``_head`` on: (time or bucket start, amount) in two arrays of
        # C doubles, not a deque of tuples. A width-0 window holds one entry per request for a whole span
        # (about 10^5 at a busy host's rate, in each of four windows): as numbers in an array they cost
        # no object per charge, and the garbage collector has nothing in them to walk or promote.
        # (Amounts are whole numbers: a double holds them exactly up to 2^53.)
        self._keys = array("d")
        self._amounts = array("d")
        self._head = 0
        self._groups: dict[float, list[float]] = {}  # group -> [newest entry's key, amount], oldest first
        self._total = 0
        # Nothing expires before this: most calls (several per request) return at this one comparison.
        self._horizon = math.inf
        # The group last marked changed for the store (``budgets``): marked once, not at each charge.
        self.marked: float | None = None

    def __len__(self) -> int:
        return len(self._keys) - self._head

    def key(self, now: float) -> float:
        return now if self.width == 0 else (now // self.width) * self.width

    def expiry(self, key: float) -> float:
        """The first instant at which an entry is no longer counted."""
        return key + self.width + self.span

    def group(self, key: float) -> float:
        return key // 1.0 if self.width == 0 else key  # the second, a float

    def _expire(self, now: float) -> None:
        if now < self._horizon:
            return
        keys, amounts = self._keys, self._amounts
        head, end = self._head, len(keys)
        after = self.width + self.span  # an entry stops counting at key + after <= now (``expiry``)
        dropped = 0.0
        while head < end and keys[head] + after <= now:
            dropped += amounts[head]
            head += 1
        self._total -= int(dropped)
        if head == end:
            del keys[:], amounts[:]
            head = 0
        elif head >= _COMPACT_AT and head * 2 >= end:
            del keys[:head], amounts[:head]
            head = 0
        self._head = head
        groups = self._groups
        while groups:
            first = next(iter(groups))
            if self.expiry(groups[first][0]) > now:
                break
            del groups[first]
        # A group's newest entry expires no earlier than the oldest entry: the entries bound it.
        self._horizon = self.expiry(keys[head]) if head < len(keys) else math.inf

    def used(self, now: float) -> int:
        if now >= self._horizon:
            self._expire(now)
        return self._total

    def add(self, now: float, amount: int) -> float:
        """Charge ``amount`` at ``now``; the group it went into (to persist it by). Called several
        times per request: ``key`` and ``group`` are written out here."""
        if now >= self._horizon:
            self._expire(now)
        width = self.width
        key = now if width == 0 else (now // width) * width
        keys = self._keys
        if len(keys) > self._head and keys[-1] >= key:
            # Same key, or the wall clock stepped back: add to the newest entry, which then counts at
            # least as long as a new one would (never shorter: the bound holds).
            key = keys[-1]
            self._amounts[-1] += amount
        else:
            keys.append(key)
            self._amounts.append(amount)
            if len(keys) - self._head == 1:
                self._horizon = key + width + self.span
        self._total += amount
        group = key // 1.0 if width == 0 else key  # the second (a float, as math.floor's would be)
        summed = self._groups.get(group)
        if summed is None:
            self._groups[group] = [key, amount]
        else:
            if key > summed[0]:
                summed[0] = key
            summed[1] += amount
        return group

    def persisted(self, group: float) -> tuple[int, float] | None:
        """A group as the store keeps it: (amount, when it stops counting); None once it has expired."""
        summed = self._groups.get(group)
        return None if summed is None else (int(summed[1]), self.expiry(summed[0]))

    def restore(self, group: float, amount: int, expires: float) -> None:
        """Put back a group read from the store (oldest first, as ``load_windows`` returns them): one
        entry, counted until the group's newest charge would have stopped counting."""
        key = expires - self.width - self.span
        keys = self._keys
        if len(keys) > self._head and keys[-1] >= key:
            return  # not after the last one: a duplicate (the store returns groups in order); ignore
        keys.append(key)
        self._amounts.append(amount)
        if len(keys) - self._head == 1:
            self._horizon = self.expiry(key)
        self._groups[group] = [key, amount]
        self._total += amount

    def wait_below(self, now: float, target: int) -> float | None:
        """Seconds until the window holds less than ``target`` (0: it does now); None if it never will
        by expiry alone (``target`` <= 0)."""
        if target <= 0:
            return None
        remaining = self.used(now)
        if remaining < target:
            return 0.0
        keys, amounts = self._keys, self._amounts
        for i in range(self._head, len(keys)):
            remaining -= int(amounts[i])
            if remaining < target:
                return self.expiry(keys[i]) - now
        return None  # unreachable: an empty window holds 0 < target

    def reset_in(self, now: float) -> float:
        """Seconds until the window is empty again."""
        self._expire(now)
        return self.expiry(self._keys[-1]) - now if len(self._keys) > self._head else 0.0
