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
entry counted until then: never shorter than any of its charges, so a restart keeps the bound too. The
groups are read off the entries by the writer (``changed_groups``), so a charge does no bookkeeping for
the store beyond one flag.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right

# The dead entries at the front are dropped once they are this many and at least half of the arrays.
_COMPACT_AT = 1024


class Window:
    __slots__ = (
        "_amounts",
        "_head",
        "_keys",
        "changed",
        "horizon",
        "span",
        "taken",
        "total",
        "width",
    )

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
        # What the entries sum to, and the first instant at which one of them expires: ``total`` is what
        # the window counts while ``now < horizon`` (``budgets`` reads it as it stands); written only here.
        self.total = 0
        self.horizon = math.inf
        # Charged since the writer last read the groups (``changed_groups``), and the newest entry's key
        # then: the groups from that entry's on are the ones to write again.
        self.changed = False
        self.taken = -math.inf

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
        if now < self.horizon:
            return
        keys, amounts = self._keys, self._amounts
        head, end = self._head, len(keys)
        after = self.width + self.span  # an entry stops counting at key + after <= now (``expiry``)
        # Keys never decrease (``add``), so the expired entries are a prefix: found by bisection, then
        # set right at its edge with the exact test (``now - after`` may round the other way), and
        # summed in C: a quiet window's first charge may drop thousands at once.
        cut = bisect_right(keys, now - after, head, end)
        while cut > head and keys[cut - 1] + after > now:
            cut -= 1
        while cut < end and keys[cut] + after <= now:
            cut += 1
        self.total -= int(sum(amounts[head:cut]))
        head = cut
        if head == end:
            del keys[:], amounts[:]
            head = 0
        elif head >= _COMPACT_AT and head * 2 >= end:
            del keys[:head], amounts[:head]
            head = 0
        self._head = head
        self.horizon = self.expiry(keys[head]) if head < len(keys) else math.inf

    def used(self, now: float) -> int:
        if now >= self.horizon:
            self._expire(now)
        return self.total

    def add(self, now: float, amount: int) -> float:
        """Charge ``amount`` at ``now``; the key of the entry it went into."""
        if now >= self.horizon:
            self._expire(now)
        key = self.key(now)
        keys = self._keys
        # Entries before ``_head`` have expired, so their keys are below ``key``: only a live newest
        # entry can match.
        if keys and keys[-1] >= key:
            # Same key, or the wall clock stepped back: add to the newest entry, which then counts at
            # least as long as a new one would (never shorter: the bound holds).
            key = keys[-1]
            self._amounts[-1] += amount
        else:
            keys.append(key)
            self._amounts.append(amount)
            if self.horizon == math.inf:  # it was empty
                self.horizon = self.expiry(key)
        self.total += amount
        self.changed = True
        return key

    def changed_groups(self) -> list[tuple[float, int, float]]:
        """The groups charged since the last call, as the store keeps them: (group, amount, when it stops
        counting), oldest first; the writer's, under the budgets' lock. A group is read off the live
        entries: ``bisect`` finds where each second (or bucket) ends, the amounts are summed in C."""
        if not self.changed:
            return []
        self.changed = False
        keys, amounts = self._keys, self._amounts
        end = len(keys)
        if self._head >= end:
            return []
        taken = self.taken
        start = self._head if taken == -math.inf else bisect_left(keys, self.group(taken), self._head)
        self.taken = keys[-1]
        out: list[tuple[float, int, float]] = []
        while start < end:
            group, stop = self.group(keys[start]), self._group_end(start)
            out.append((group, int(sum(amounts[start:stop])), self.expiry(keys[stop - 1])))
            start = stop
        return out

    def _group_end(self, start: int) -> int:
        """The index after the last entry of the group that the entry at ``start`` is in."""
        return (
            bisect_left(self._keys, self.group(self._keys[start]) + 1.0, start)
            if self.width == 0
            else start + 1
        )

    def persisted(self, group: float) -> tuple[int, float] | None:
        """A group as the store keeps it: (amount, when it stops counting); None once it has expired."""
        keys = self._keys
        start = bisect_left(keys, group, self._head)
        if start >= len(keys) or self.group(keys[start]) != group:
            return None
        stop = self._group_end(start)
        return int(sum(self._amounts[start:stop])), self.expiry(keys[stop - 1])

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
            self.horizon = self.expiry(key)
        self.total += amount
        self.taken = key  # read from the store: not a change to write back

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
        return None  # not reached: the entries sum to what the window counts, and target > 0

    def reset_in(self, now: float) -> float:
        """Seconds until the window is empty again (its newest charge expires; 0 if it has)."""
        if len(self._keys) == self._head:
            return 0.0
        return max(0.0, self.expiry(self._keys[-1]) - now)
