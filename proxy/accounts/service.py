"""``Accounts``: the store, its key view, the budgets, the ledger and the writer, started and stopped
together. This is what the daemon builds (one per process, from ``ProxySettings.store``) and what the
request path uses; each method says on which thread it may run.

Request path (event loop, never blocks on the disk):
    who = accounts.find_principal(key_id, token)   # a key made at run time (``proxy.auth.KeyTable``)
    accounts.budgets                               # the admission pipeline's budget step
                                                   # (``proxy.admission.budgets``: admit, charge, release)
    accounts.record(row)                           # after the answer: its LedgerRow (the child's usage)
Daemon life (any thread; ``flush`` blocks, so from the loop: ``await asyncio.to_thread(...)``):
    Accounts.open(settings.store, settings.tenants) -> start() -> ... flush(timeout) -> close()

Without a store, tenants' budgets are a ``Budgets`` of their own, in memory (``proxy.state``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from proxy.accounts.budgets import Budgets
from proxy.accounts.engines import open_configured_store
from proxy.accounts.keyview import POLL_S, KeyView
from proxy.accounts.ledger import Ledger, LedgerStats
from proxy.accounts.records import LedgerRow
from proxy.accounts.store import Store
from proxy.accounts.writer import Retention, StoreWriter
from proxy.auth import Principal, key_digest
from proxy.settings import BudgetSettings, StoreSettings, TenantSettings


def tenant_budgets(tenants: Iterable[TenantSettings]) -> dict[str, BudgetSettings]:
    return {t.name: t.budgets for t in tenants}


class Accounts:
    def __init__(
        self,
        store: Store,
        tenants: Iterable[TenantSettings] = (),
        *,
        retention: Retention | None = None,
        poll_s: float = POLL_S,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.budgets = Budgets(tenant_budgets(tenants))
        self.ledger = Ledger()
        self.view = KeyView(store, poll_s)
        self.writer = StoreWriter(
            store,
            self.ledger,
            self.budgets,
            self.view,
            interval_s=interval_s,
            retention=retention,
            clock=clock,
        )
        self._clock = clock
        self._closed = False

    @classmethod
    def open(cls, settings: StoreSettings, tenants: Iterable[TenantSettings] = ()) -> Accounts:
        """Open the store as the daemon (SQLite: taking its lock). Raises ``StoreError`` (exit 2 at start)."""
        store = open_configured_store(settings, daemon=True)
        retention = Retention(settings.usage_retention_days, settings.rollup_retention_days)
        return cls(store, tenants, retention=retention)

    def start(self) -> None:
        """Restore the windows, load the keys, start the poll and the writer. Raises ``StoreError``."""
        self.budgets.restore(self.store.load_windows(self._clock()))
        self.view.start()
        self.writer.start()

    # -- request path -------------------------------------------------------------------------------

    def find_principal(self, key_id: str, token: str) -> Principal | None:
        """Who a token is, its shape (and id) checked by the caller (``proxy.auth.KeyTable``'s lookup of a
        key the config does not hold); None when revoked, expired or unknown. Records the key's use."""
        now = time.time()
        key = self.view.find(key_id, key_digest(token), now)
        if key is None:
            return None
        self.view.touch(key_id, now)
        return key.principal

    def record(self, row: LedgerRow) -> None:
        """A finished request's row, queued for the ledger (an append: never a disk write)."""
        self.ledger.charge(row)

    def stats(self) -> LedgerStats:
        return self.ledger.stats()

    # -- drain --------------------------------------------------------------------------------------

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.writer.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the threads, write what is pending, close the store (and drop its lock). Whether
        everything pending was written."""
        if self._closed:
            return True
        self._closed = True
        self.view.close()
        self.writer.close()
        flushed = self.writer.flush(timeout_s)
        self.store.close()
        return flushed


def has_budgets(tenants: Iterable[TenantSettings]) -> bool:
    return any(b != BudgetSettings() for b in tenant_budgets(tenants).values())
