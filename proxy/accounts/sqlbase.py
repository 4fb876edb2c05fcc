"""What the two store engines share: every statement of the ``Store`` interface, written once, and the
mapping of rows to records. ``sqlite.SqliteStore`` and ``postgres.PostgresStore`` subclass ``SqlStore``
and supply a transaction (``_tx``), a read (``_read``), the key poll and the schema's life.

Dialect: the statements are the subset SQLite (3.35+) and PostgreSQL (12+) both accept, the same as the
migration files: ``INSERT ... ON CONFLICT ... DO UPDATE`` with ``excluded``, ``COALESCE``, integer
arithmetic, no ``AUTOINCREMENT``, no ``RETURNING``. They use ``?`` placeholders (the sqlite3 module's
style); the PostgreSQL engine turns each ``?`` into ``%s`` (psycopg's) before it sends a statement,
which is safe because no statement here holds a ``?`` in a string literal or any ``%`` (checked by
``pg_placeholders``; the day of an hour is ``(hour / 86400) * 86400``, integer division in both).
What differs stays in the engine: SQLite's multi-row ``INSERT ... VALUES`` batches and its ``PRAGMA``s,
PostgreSQL's advisory lock around migrations. ``SUM`` of a BIGINT is ``numeric`` (a ``Decimal``) in
PostgreSQL, so every number read here goes through ``int`` or ``float``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from proxy.accounts.migrations import SCHEMA_VERSION_TABLE, Migration, statements
from proxy.accounts.records import Batch, GroupBy, KeyRecord, LedgerRow, UsageRecord, UsageRow, WindowEntry
from proxy.accounts.store import StoreError
from proxy.settings import BudgetSettings, Scope

HOUR = 3600
DAY = 86400

SELECT_KEYS = (
    "SELECT key_id, digest, tenant, scopes, name, models, tokens_per_minute, tokens_per_day, "
    "requests_per_minute, created, expires, revoked, last_used FROM api_keys"
)
KEY_BY_ID = SELECT_KEYS + " WHERE key_id = ?"
INSERT_KEY = (
    "INSERT INTO api_keys (key_id, digest, tenant, scopes, name, models, tokens_per_minute, tokens_per_day, "
    "requests_per_minute, created, expires, revoked, last_used) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
KEYS_VERSION = "SELECT value FROM store_meta WHERE name = 'keys_version'"
_BUMP = "UPDATE store_meta SET value = value + 1 WHERE name = 'keys_version'"
GROUPS: dict[str, tuple[str, str]] = {
    # by: (the selected group columns, in the order of UsageRow's fields key_id, model, period)
    "tenant": ("tenant, NULL, NULL, NULL", "tenant"),
    "key": ("tenant, key_id, NULL, NULL", "tenant, key_id"),
    "model": ("tenant, NULL, model, NULL", "tenant, model"),
    "hour": ("tenant, NULL, NULL, hour", "tenant, hour"),
    # Integer division in both dialects (no '%', which psycopg would read as a placeholder).
    "day": (f"tenant, NULL, NULL, (hour / {DAY}) * {DAY}", f"tenant, (hour / {DAY}) * {DAY}"),
}

# The order of UsageRecord's fields.
USAGE_COLUMNS = (
    "tenant, key_id, model, kind, prompt_tokens, cached_tokens, completion_tokens, status, duration_s, at, "
    "request_id, usage_source"
)
INSERT_USAGE = f"INSERT INTO usage_events ({USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
HOURLY_COLUMNS = (
    "hour, tenant, key_id, model, kind, requests, errors, prompt_tokens, cached_tokens, completion_tokens, "
    "duration_s"
)
UPSERT_HOURLY = (
    "ON CONFLICT (hour, tenant, key_id, model, kind) DO UPDATE SET "
    "requests = usage_hourly.requests + excluded.requests, "
    "errors = usage_hourly.errors + excluded.errors, "
    "prompt_tokens = usage_hourly.prompt_tokens + excluded.prompt_tokens, "
    "cached_tokens = usage_hourly.cached_tokens + excluded.cached_tokens, "
    "completion_tokens = usage_hourly.completion_tokens + excluded.completion_tokens, "
    "duration_s = usage_hourly.duration_s + excluded.duration_s"
)
INSERT_HOURLY = f"INSERT INTO usage_hourly ({HOURLY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "  # noqa: S608
UPSERT_WINDOW = (
    "INSERT INTO budget_windows (subject, name, budget, at, amount, expires) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (subject, name, budget, at) DO UPDATE SET "
    "amount = excluded.amount, expires = excluded.expires"
)
TOUCH_KEY = "UPDATE api_keys SET last_used = ? WHERE key_id = ? AND (last_used IS NULL OR last_used < ?)"


def pg_placeholders(sql: str) -> str:
    """A statement of this module (``?`` placeholders) in psycopg's style (``%s``)."""
    if "%" in sql or "'?'" in sql:
        raise ValueError(f"a '%' or a quoted '?' would be misread as a placeholder: {sql[:60]!r}")
    return sql.replace("?", "%s")


class Conn(Protocol):
    """What the shared code needs of a connection inside a transaction: sqlite3's and the PostgreSQL
    engine's wrapper both offer it."""

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any: ...
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any: ...


def csv(values: Iterable[str]) -> str:
    return ",".join(sorted(values))


def split(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


def scopes(text: str) -> frozenset[Scope]:
    out: set[Scope] = set()
    for scope in split(text):
        if scope == "inference":
            out.add("inference")
        elif scope == "admin":
            out.add("admin")
    return frozenset(out)


def key_of(row: Sequence[Any]) -> KeyRecord:
    return KeyRecord(
        key_id=row[0],
        digest=row[1],
        tenant=row[2],
        scopes=scopes(row[3]),
        name=row[4],
        models=split(row[5]),
        budgets=BudgetSettings(
            None if row[6] is None else int(row[6]),
            None if row[7] is None else int(row[7]),
            None if row[8] is None else int(row[8]),
        ),
        created=float(row[9]),
        expires=None if row[10] is None else float(row[10]),
        revoked=None if row[11] is None else float(row[11]),
        last_used=None if row[12] is None else float(row[12]),
    )


def key_row(key: KeyRecord) -> tuple[Any, ...]:
    b = key.budgets
    return (
        key.key_id,
        key.digest,
        key.tenant,
        csv(key.scopes),
        key.name,
        ",".join(key.models),
        b.tokens_per_minute,
        b.tokens_per_day,
        b.requests_per_minute,
        key.created,
        key.expires,
        key.revoked,
        key.last_used,
    )


def hourly_sums(usage: Sequence[LedgerRow]) -> list[tuple[Any, ...]]:
    """A batch's usage rows summed by (hour, tenant, key, model, kind): the rollup's increments."""
    hourly: dict[tuple[int, str, str, str, str], list[float]] = {}
    for row in usage:
        group = (int(row.at // HOUR) * HOUR, row.tenant, row.key_id, row.model, row.kind)
        sums = hourly.get(group)
        if sums is None:
            sums = hourly[group] = [0, 0, 0, 0, 0, 0.0]
        sums[0] += 1
        if row.status >= 400:
            sums[1] += 1
        sums[2] += row.prompt_tokens
        sums[3] += row.cached_tokens
        sums[4] += row.completion_tokens
        sums[5] += row.duration_s
    return [(*group, *(int(v) for v in sums[:5]), sums[5]) for group, sums in hourly.items()]


def _where(*conditions: tuple[str, object | None]) -> tuple[str, tuple[object, ...]]:
    """A WHERE clause and its arguments from (column and operator, value) pairs, each kept when its value
    is given: ``("tenant", "a")`` is ``tenant = ?``, ``("at >=", t)`` is ``at >= ?``. The columns and
    operators are this module's own text; only the values are the caller's, and they go as arguments."""
    where, args = ["1 = 1"], []
    for test, value in conditions:
        if value is not None:
            where.append(f"{test} ?" if " " in test else f"{test} = ?")
            args.append(value)
    return " AND ".join(where), tuple(args)


class SqlStore:
    """The ``Store`` methods both engines run the same way. A subclass sets ``where`` and implements
    ``_tx``, ``_read``, ``_is_duplicate``, ``_write_usage``, ``key_marker``, ``load_keys`` and ``close``."""

    @property
    def where(self) -> str:
        raise NotImplementedError

    def _tx(self, doing: str) -> contextlib.AbstractContextManager[Conn]:
        raise NotImplementedError

    def _read(self, doing: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _apply(self, conn: Conn, known: Sequence[Migration]) -> int:
        """In the caller's migration transaction: the ``schema_version`` table, then the migrations the
        store lacks, each recorded; a store written by a newer llamagate is refused untouched. The
        version the store is at after."""
        conn.execute(SCHEMA_VERSION_TABLE)
        found = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
        have = int(found[0]) if found is not None else 0
        if have > len(known):
            raise StoreError(
                f"{self.where}: schema version {have} was written by a newer llamagate (this one knows "
                f"up to {len(known)}): upgrade llamagate, or restore a backup made by this version"
            )
        for m in known[have:]:
            for statement in statements(m.sql):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_version (version, name, applied) VALUES (?, ?, ?)",
                (m.version, m.name, time.time()),
            )
        return max(have, len(known))

    def _is_duplicate(self, exc: StoreError) -> bool:
        """Whether a failed insert failed on a primary key taken already."""
        raise NotImplementedError

    def _write_usage(self, conn: Conn, rows: Sequence[LedgerRow], sums: list[tuple[Any, ...]]) -> None:
        conn.executemany(INSERT_USAGE, rows)
        conn.executemany(INSERT_HOURLY + UPSERT_HOURLY, sums)

    @staticmethod
    def _bump(conn: Conn) -> None:
        conn.execute(_BUMP)

    # -- keys ---------------------------------------------------------------------------------------

    def add_key(self, key: KeyRecord) -> None:
        try:
            with self._tx("add a key") as conn:
                conn.execute(INSERT_KEY, key_row(key))
                self._bump(conn)
        except StoreError as exc:
            if self._is_duplicate(exc):
                raise StoreError(f"{self.where}: a key with id {key.key_id} exists already") from exc
            raise

    def get_key(self, key_id: str) -> KeyRecord | None:
        rows = self._read("read a key", KEY_BY_ID, (key_id,))
        return key_of(rows[0]) if rows else None

    def list_keys(self) -> list[KeyRecord]:
        rows = self._read("list keys", SELECT_KEYS + " ORDER BY tenant, created")
        return [key_of(r) for r in rows]

    def revoke_key(self, key_id: str, now: float) -> KeyRecord | None:
        """Revoke a key (again: a no-op); None when there is no such key."""
        with self._tx("revoke a key") as conn:
            cur = conn.execute(
                "UPDATE api_keys SET revoked = ? WHERE key_id = ? AND revoked IS NULL", (now, key_id)
            )
            if cur.rowcount:
                self._bump(conn)
            row = conn.execute(KEY_BY_ID, (key_id,)).fetchone()
        return key_of(row) if row else None

    def replace_key(self, old_id: str, new: KeyRecord, now: float, grace_s: float = 0.0) -> KeyRecord:
        """Rotation in one transaction: ``new`` is added, and the old key is revoked now (``grace_s`` 0)
        or expires ``grace_s`` from now (so clients can move to the new key without an outage)."""
        with self._tx("rotate a key") as conn:
            row = conn.execute(KEY_BY_ID, (old_id,)).fetchone()
            if row is None:
                raise StoreError(f"{self.where}: no key with id {old_id}")
            old = key_of(row)
            if old.status(now) != "active":
                status = old.status(now)
                raise StoreError(f"{self.where}: key {old_id} is {status}: only an active key rotates")
            conn.execute(INSERT_KEY, (*key_row(new)[:11], None, None))
            if grace_s > 0:
                ends = now + grace_s if old.expires is None else min(old.expires, now + grace_s)
                conn.execute("UPDATE api_keys SET expires = ? WHERE key_id = ?", (ends, old_id))
            else:
                conn.execute("UPDATE api_keys SET revoked = ? WHERE key_id = ?", (now, old_id))
            self._bump(conn)
        return new

    def set_key_budgets(self, key_id: str, budgets: BudgetSettings) -> KeyRecord | None:
        with self._tx("change a key's budgets") as conn:
            cur = conn.execute(
                "UPDATE api_keys SET tokens_per_minute = ?, tokens_per_day = ?, requests_per_minute = ? "
                "WHERE key_id = ?",
                (budgets.tokens_per_minute, budgets.tokens_per_day, budgets.requests_per_minute, key_id),
            )
            if cur.rowcount:
                self._bump(conn)
            row = conn.execute(KEY_BY_ID, (key_id,)).fetchone()
        return key_of(row) if row else None

    # -- the writer's batch -------------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        if not batch:
            return
        rows = batch.usage  # a LedgerRow is a tuple of the columns of USAGE_COLUMNS, in order
        sums = hourly_sums(rows)
        with self._tx("write the usage ledger") as conn:
            if rows:
                self._write_usage(conn, rows, sums)
            # Windows carry absolute amounts, so writing one again (a retried batch) changes nothing.
            conn.executemany(
                UPSERT_WINDOW,
                [(w.subject, w.name, w.budget, w.at, w.amount, w.expires) for w in batch.windows],
            )
            conn.executemany(TOUCH_KEY, [(at, key_id, at) for key_id, at in batch.last_used])

    def load_windows(self, now: float) -> list[WindowEntry]:
        rows = self._read(
            "load budget windows",
            "SELECT subject, name, budget, at, amount, expires FROM budget_windows WHERE expires > ? "
            "ORDER BY at",
            (now,),
        )
        return [WindowEntry(r[0], r[1], r[2], float(r[3]), int(r[4]), float(r[5])) for r in rows]

    def prune(self, now: float, usage_before: float, rollup_before: float) -> int:
        """Delete usage rows, rollups and window entries past their retention; how many rows went."""
        with self._tx("prune old usage") as conn:
            gone = conn.execute("DELETE FROM usage_events WHERE at < ?", (usage_before,)).rowcount
            gone += conn.execute("DELETE FROM usage_hourly WHERE hour < ?", (rollup_before,)).rowcount
            gone += conn.execute("DELETE FROM budget_windows WHERE expires <= ?", (now,)).rowcount
        return int(gone)

    # -- reports ------------------------------------------------------------------------------------

    def usage(
        self,
        *,
        by: GroupBy = "tenant",
        tenant: str | None = None,
        key_id: str | None = None,
        since: float | None = None,
    ) -> list[UsageRow]:
        """Sums over the hourly rollup; ``since`` counts from the start of its hour (the rollup's grain)."""
        selected, grouped = GROUPS[by]
        hour = None if since is None else int(since // HOUR) * HOUR
        where, args = _where(("tenant", tenant), ("key_id", key_id), ("hour >=", hour))
        rows = self._read(
            "report usage",
            f"SELECT {selected}, SUM(requests), SUM(errors), SUM(prompt_tokens), SUM(cached_tokens), "  # noqa: S608 - fixed column lists
            f"SUM(completion_tokens) FROM usage_hourly WHERE {where} "
            f"GROUP BY {grouped} ORDER BY {grouped}",
            args,
        )
        return [
            UsageRow(r[0], r[1], r[2], None if r[3] is None else int(r[3]), *(int(v) for v in r[4:]))
            for r in rows
        ]

    def usage_records(self, *, tenant: str | None = None, since: float | None = None) -> list[UsageRecord]:
        where, args = _where(("tenant", tenant), ("at >=", since))
        rows = self._read(
            "read usage rows",
            f"SELECT {USAGE_COLUMNS} FROM usage_events WHERE {where} ORDER BY at",  # noqa: S608
            args,
        )
        return [
            UsageRecord(
                r[0],
                r[1],
                r[2],
                r[3],
                int(r[4]),
                int(r[5]),
                int(r[6]),
                int(r[7]),
                float(r[8]),
                float(r[9]),
                r[10],
                r[11],
            )
            for r in rows
        ]
