"""The usage ledger's queue: ``charge`` on the request path costs an append, never a disk write.

The writer thread (``writer``) takes batches from here and writes each in one transaction. A batch that
could not be written (a full disk) goes back to the front, in order, and is tried again, so nothing is
lost or written twice while memory lasts; past ``max_pending`` records a new one is dropped and counted
(``dropped``): memory stays bounded however long the disk stays full, and what was already written
stays written.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.accounts.records import LedgerRow

log = logging.getLogger("llamagate.accounts")

# About 200 bytes each in memory: 100k records are ~20 MB, an hour of a busy host's requests.
MAX_PENDING = 100_000


@dataclass(frozen=True, slots=True)
class LedgerStats:
    pending: int  # charged, not written yet (a gauge)
    written: int  # written since start (a counter)
    unwritten: int  # records whose first write failed (a counter; they are retried, and most get written)
    dropped: int  # records lost: charged while max_pending were already waiting (a counter)
    write_errors: int  # failed batch writes (a counter)


class Ledger:
    def __init__(self, max_pending: int = MAX_PENDING, batch_size: int = 500) -> None:
        self.max_pending = max_pending
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._retry: deque[LedgerRow] = deque()  # a failed batch, first in line
        self._fresh: deque[LedgerRow] = deque()
        self._written = 0
        self._unwritten = 0
        self._dropped = 0
        self._write_errors = 0
        self._dropping = False
        # Set when a batch is full, so the writer does not wait for its next tick.
        self.batch_ready = threading.Event()

    def charge(self, record: LedgerRow) -> None:
        """On the event loop, once per request: no lock on the way of a record that fits (a deque's
        ``append`` and the writer's ``popleft`` are atomic), the lock only to count one that does not."""
        fresh = self._fresh
        if len(fresh) + len(self._retry) < self.max_pending:
            fresh.append(record)
            if len(fresh) >= self.batch_size and not self.batch_ready.is_set():
                # Once: until the writer takes the batch, every charge would take the event's lock.
                self.batch_ready.set()
            return
        with self._lock:
            self._dropped += 1
            first = not self._dropping
            self._dropping = True
        if first:
            log.error(
                "usage ledger: %d records wait for the store, the most it holds in memory; new ones are "
                "dropped and counted until the store takes writes again",
                self.max_pending,
            )

    def take(self) -> tuple[list[LedgerRow], int]:
        """Up to one batch, oldest first, and how many of it are new (never tried before)."""
        with self._lock:
            out: list[LedgerRow] = []
            while self._retry and len(out) < self.batch_size:
                out.append(self._retry.popleft())
            fresh = 0
            while self._fresh and len(out) < self.batch_size:
                out.append(self._fresh.popleft())
                fresh += 1
            if len(self._fresh) < self.batch_size:
                self.batch_ready.clear()
            return out, fresh

    def written(self, count: int) -> None:
        with self._lock:
            self._written += count
            if self._dropping and len(self._retry) + len(self._fresh) < self.max_pending:
                self._dropping = False

    def failed(self, batch: Sequence[LedgerRow], fresh: int) -> None:
        """Put a batch that was not written back at the front, in its order."""
        with self._lock:
            self._retry.extendleft(reversed(batch))
            self._unwritten += fresh
            self._write_errors += 1

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._retry) + len(self._fresh)

    def stats(self) -> LedgerStats:
        with self._lock:
            return LedgerStats(
                pending=len(self._retry) + len(self._fresh),
                written=self._written,
                unwritten=self._unwritten,
                dropped=self._dropped,
                write_errors=self._write_errors,
            )
