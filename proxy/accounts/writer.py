"""The one thread that writes to the store while the daemon serves: usage batches, budget windows,
keys' last use, and the hourly prune of what is past its retention.

A cycle runs every ``interval_s`` (1 s), or at once when the ledger holds a full batch, and writes one
transaction (``Store.write``). When it fails (a full disk), what it held goes back (the ledger's
records to the front of the queue, window entries and last uses to be written again), one log line
says so, and the next cycles retry; one more line says when writes work again. Requests never wait for
any of this. ``flush`` runs cycles on the caller's thread until nothing is pending (the drain).

What a SIGKILL loses: what was charged since the last cycle, at most one interval's worth (or one batch,
if batches fill faster than the interval).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.accounts.budgets import Budgets
from proxy.accounts.keyview import KeyView
from proxy.accounts.ledger import Ledger
from proxy.accounts.records import Batch
from proxy.accounts.store import Store, StoreError

log = logging.getLogger("llamagate.accounts")

_DAY_S = 86400.0
PRUNE_EVERY_S = 3600.0


@dataclass(frozen=True, slots=True)
class Retention:
    usage_days: float = 31
    rollup_days: float = 400


class StoreWriter:
    def __init__(
        self,
        store: Store,
        ledger: Ledger,
        budgets: Budgets | None = None,
        view: KeyView | None = None,
        *,
        interval_s: float = 1.0,
        retention: Retention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._budgets = budgets
        self._view = view
        self.interval_s = interval_s
        self._retention = retention or Retention()
        self._clock = clock
        self._cycle_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._next_prune = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llamagate-store-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._ledger.batch_ready.wait(self.interval_s)
            if self._stop.is_set():
                break
            try:
                ok = self.cycle()
                while ok and self._ledger.pending >= self._ledger.batch_size:
                    ok = self.cycle()  # a backlog: write it batch after batch, not one per interval
            except Exception:  # a bug must not stop the ledger; the next cycle tries again
                log.exception("store writer: unexpected error")
                ok = False
            if not ok:
                self._stop.wait(self.interval_s)  # a failing store: retried once per interval

    def cycle(self) -> bool:
        """Write what is pending, in one transaction; True when it was written (or nothing was due)."""
        with self._cycle_lock:
            now = self._clock()
            usage, fresh = self._ledger.take()
            windows = tuple(self._budgets.take_dirty(now)) if self._budgets is not None else ()
            touches = self._view.take_touches() if self._view is not None else ()
            batch = Batch(tuple(usage), windows, touches)
            try:
                self._store.write(batch)
            except Exception as exc:  # StoreError (a full disk), or a bug: either way keep the batch
                self._ledger.failed(usage, fresh)
                if self._budgets is not None:
                    self._budgets.put_back(windows)
                if self._view is not None:
                    self._view.put_back_touches(touches)
                if not self._failing:
                    log.error(
                        "store writer: %s; %d usage records wait in memory and are retried every %g s",
                        exc if isinstance(exc, StoreError) else repr(exc),
                        self._ledger.pending,
                        self.interval_s,
                    )
                self._failing = True
                return False
            self._ledger.written(len(usage))
            if self._failing:
                pending = self._ledger.pending
                log.warning("store writer: writes work again; %d usage records still pending", pending)
                self._failing = False
            if now >= self._next_prune:
                self._prune(now)
            return True

    def _prune(self, now: float) -> None:
        r = self._retention
        try:
            self._store.prune(now, now - r.usage_days * _DAY_S, now - r.rollup_days * _DAY_S)
        except StoreError as exc:
            log.warning("store writer: could not prune old usage (tried again in an hour): %s", exc)
        self._next_prune = now + PRUNE_EVERY_S

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Write everything pending now, on this thread; False if it could not (the store refused, or the
        deadline passed), in which case what is left stays pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.cycle():
                return False
            if self._ledger.pending == 0:
                return True
            if time.monotonic() >= deadline:
                return False

    def close(self) -> None:
        self._stop.set()
        self._ledger.batch_ready.set()  # wake it
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
