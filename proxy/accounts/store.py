"""The interface every store engine offers (``sqlite``: one file; ``postgres``: one database shared by
replicas; both on ``sqlbase``'s shared statements, chosen by ``engines``), and its error.

The request path never calls a store directly: ``keyview``, ``writer`` and the commands do. Calls may
come from several threads; an engine serialises them itself. ``key_marker`` and ``load_keys`` are the
key view's poll, made at a few hertz, so they must be cheap when nothing changed.
"""

from __future__ import annotations

from typing import Protocol

from proxy.accounts.records import Batch, GroupBy, KeyRecord, UsageRecord, UsageRow, WindowEntry
from proxy.settings import BudgetSettings


class StoreError(Exception):
    """The store cannot be used: the message names the file (or URL) and what is wrong with it.

    Raised at open for a file that is unreadable, corrupt, not SQLite, another application's, made by a
    newer llamagate, or held by another daemon, or for a database that cannot be reached; later for a
    write that failed (a full disk, a lost connection). A command
    or ``serve`` reports it and exits 2; the writer thread keeps what it could not write and retries."""


class Store(Protocol):
    @property
    def where(self) -> str:
        """The file or URL, for messages."""
        ...

    # Keys. Every change bumps the marker that ``key_marker`` returns, in the same transaction.
    def add_key(self, key: KeyRecord) -> None: ...
    def get_key(self, key_id: str) -> KeyRecord | None: ...
    def list_keys(self) -> list[KeyRecord]: ...
    def revoke_key(self, key_id: str, now: float) -> KeyRecord | None: ...
    def replace_key(self, old_id: str, new: KeyRecord, now: float, grace_s: float = 0.0) -> KeyRecord: ...
    def set_key_budgets(self, key_id: str, budgets: BudgetSettings) -> KeyRecord | None: ...
    def key_marker(self) -> int: ...
    def load_keys(self) -> list[KeyRecord]: ...

    # The writer's one transaction: usage rows and their hourly rollup, budget windows, last use of keys.
    def write(self, batch: Batch) -> None: ...
    def load_windows(self, now: float) -> list[WindowEntry]: ...
    def prune(self, now: float, usage_before: float, rollup_before: float) -> int: ...

    # Reports.
    def usage(
        self,
        *,
        by: GroupBy = "tenant",
        tenant: str | None = None,
        key_id: str | None = None,
        since: float | None = None,
    ) -> list[UsageRow]: ...
    def usage_records(
        self, *, tenant: str | None = None, since: float | None = None
    ) -> list[UsageRecord]: ...

    def close(self) -> None: ...
