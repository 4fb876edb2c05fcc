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
from collections import deque


class Window:
    __slots__ = ("_entries", "_groups", "_horizon", "_total", "marked", "span", "width")

    def __init__(self, span: float, width: float = 0.0) -> None:
        self.span = span
        self.width = width
        # (time or bucket start, amount), oldest first. Tuples, not lists: a width-0 window holds one per
        # request for a whole span, and the garbage collector stops tracking a tuple of numbers, where it
        # would walk every list of them at each full collection.
        self._entries: deque[tuple[float, float]] = deque()
        self._groups: dict[float, list[float]] = {}  # group -> [newest entry's key, amount], oldest first
        self._total = 0
        # Nothing expires before this: most calls (several per request) return at this one comparison.
        self._horizon = math.inf
        # The group last marked changed for the store (``budgets``): marked once, not at each charge.
        self.marked: float | None = None

    def __len__(self) -> int:
        return len(self._entries)

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
        entries = self._entries
        while entries and self.expiry(entries[0][0]) <= now:
            self._total -= int(entries.popleft()[1])
        groups = self._groups
        while groups:
            first = next(iter(groups))
            if self.expiry(groups[first][0]) > now:
                break
            del groups[first]
        # A group's newest entry expires no earlier than the oldest entry: the entries bound it.
        self._horizon = self.expiry(entries[0][0]) if entries else math.inf

    def _appended(self, key: float) -> None:
        if len(self._entries) == 1:
            self._horizon = self.expiry(key)

    def used(self, now: float) -> int:
        if now >= self._horizon:
            self._expire(now)
        return self._total

    def add(self, now: float, amount: int) -> float:
        """Charge ``amount`` at ``now``; the group it went into (to persist it by). Called several
        times per request: ``key``, ``group`` and ``_appended`` are written out here."""
        if now >= self._horizon:
            self._expire(now)
        width = self.width
        key = now if width == 0 else (now // width) * width
        entries = self._entries
        if entries and entries[-1][0] >= key:
            # Same key, or the wall clock stepped back: add to the newest entry, which then counts at
            # least as long as a new one would (never shorter: the bound holds).
            key, held = entries[-1]
            entries[-1] = (key, held + amount)
        else:
            entries.append((key, amount))
            if len(entries) == 1:
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
        entries = self._entries
        if entries and entries[-1][0] >= key:
            return  # not after the last one: a duplicate (the store returns groups in order); ignore
        entries.append((key, amount))
        self._appended(key)
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
        for key, amount in self._entries:
            remaining -= int(amount)
            if remaining < target:
                return self.expiry(key) - now
        return None  # unreachable: an empty window holds 0 < target

    def reset_in(self, now: float) -> float:
        """Seconds until the window is empty again."""
        self._expire(now)
        return self.expiry(self._entries[-1][0]) - now if self._entries else 0.0
