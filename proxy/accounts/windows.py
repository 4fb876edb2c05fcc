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
the store beyond one flag: ``add`` runs several times per request, on the event loop.
"""

from __future__ import annotations

import math
import operator
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import islice, repeat

# The dead entries at the front are dropped once they are this many and at least half of the arrays.
_COMPACT_AT = 1024
_NEVER = -math.inf
# Queued charges of one source (``extend``): their times, oldest first, and their amounts (None: 1 each).
Charges = tuple["array[float]", "array[float] | None"]


class Window:
    __slots__ = (
        "_amounts",
        "_head",
        "_keys",
        "changed",
        "horizon",
        "latest",
        "pending",
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
        # What the live entries sum to, and the first instant at which one of them expires: most calls
        # (several per request) need no more than these two. Read by ``budgets`` on the request path
        # (``total`` is current while ``now < horizon``); written only here.
        self.total = 0
        self.horizon = math.inf
        # Charged but not entered yet (``budgets`` queues the request path's charges and enters them in
        # batches): counted by ``used`` all the same. Recent by construction (entered within a second or
        # so), so none of it expires before it is entered. ``latest``: the newest charge, entered or not
        # (what ``reset_in`` reads).
        self.pending = 0
        self.latest = _NEVER
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
        # summed in C. The writer's batches and a quiet window's first request drop thousands at once.
        cut = bisect_right(keys, now - after, head, end)
        while cut > head and keys[cut - 1] + after > now:
            cut -= 1
        while cut < end and keys[cut] + after <= now:
            cut += 1
        self.total -= int(amounts[head] if cut == head + 1 else sum(amounts[head:cut]))
        head = cut
        if head == end:
            del keys[:], amounts[:]
            head = 0
        elif head >= _COMPACT_AT and head * 2 >= end:
            del keys[:head], amounts[:head]
            head = 0
        self._head = head
        self.horizon = keys[head] + after if head < len(keys) else math.inf  # ``expiry``, written out

    def used(self, now: float) -> int:
        if now >= self.horizon:
            self._expire(now)
        return self.total + self.pending

    def add(self, now: float, amount: int) -> float:
        """Charge ``amount`` at ``now``; the key of the entry it went into. Called several times per
        request, on the event loop: ``key`` is written out here, and nothing else is kept per charge."""
        horizon = self.horizon
        if now >= horizon:
            self._expire(now)
            horizon = self.horizon
        width = self.width
        key = now if width == 0 else (now // width) * width
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
            if horizon == math.inf:  # it was empty
                self.horizon = key + width + self.span
        self.total += amount
        self.changed = True
        if key > self.latest:
            self.latest = key
        return key

    def extend(self, sources: Sequence[Charges]) -> None:
        """Enter queued charges (``budgets`` settles its queues here, on the writer's thread): the same
        entries as ``add`` for each charge in time order. The common case, one source whose times rise
        and come after the newest entry, goes in with a few C calls instead of one ``add`` per charge
        (several per request); anything else (several sources, equal or stepped-back times, a bucket
        boundary crossed) is added one by one, in time order."""
        if len(sources) == 1:
            times, amounts = sources[0]
            if times and self._extend(times, amounts):
                return
        charges = sorted(
            charge
            for times, amounts in sources
            for charge in (
                zip(times, repeat(1), strict=False)  # repeat: as many as there are times
                if amounts is None
                else zip(times, map(int, amounts), strict=True)
            )
        )
        for at, amount in charges:
            self.add(at, amount)

    def _extend(self, times: array[float], amounts: array[float] | None) -> bool:
        """``extend`` of one source, if its charges can go in whole (else False, nothing changed)."""
        last = times[-1]
        if not all(map(operator.lt, times, islice(times, 1, None))):
            return False  # equal times (``add`` merges them) or a clock stepped back: one by one
        count = len(times)
        total = count if amounts is None else int(sum(amounts))
        width = self.width
        if width:
            # A bucketed window: whole when they all fall into one bucket (one ``add`` of their sum).
            if (times[0] // width) != (last // width):
                return False
            self.add(last, total)
            return True
        if last >= self.horizon:
            self._expire(last)
        keys = self._keys
        if len(keys) > self._head and keys[-1] >= times[0]:
            return False  # not after the newest entry
        if len(keys) == self._head:
            self.horizon = times[0] + self.span  # it was empty (``expiry``, written out)
        keys.extend(times)
        self._amounts.extend(repeat(1.0, count) if amounts is None else amounts)
        self.total += total
        self.changed = True
        if last > self.latest:
            self.latest = last
        return True

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
        if key > self.latest:
            self.latest = key

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
        # Only pending charges are left (``budgets`` enters them before it asks): gone by the newest's expiry.
        return self.reset_in(now) if self.pending else None

    def reset_in(self, now: float) -> float:
        """Seconds until the window is empty again (its newest charge expires; 0 if it has)."""
        latest = self.latest
        if latest == _NEVER:
            return 0.0
        width = self.width
        if width:
            latest = (latest // width) * width  # its bucket
        return max(0.0, latest + width + self.span - now)
