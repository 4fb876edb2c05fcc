"""The store on a PostgreSQL database (``store.url: postgresql://...``, psycopg 3), shared by every replica.

Same schema, same migration files, same statements as the SQLite engine (``sqlbase``: ``?`` turned into
``%s``). What is PostgreSQL's own:

- **Several daemons on one database.** That is the point of it, so there is no daemon lock. Migrations
  run under a transaction-scoped advisory lock (``pg_advisory_xact_lock``), so replicas starting at once
  apply each migration exactly once: the second waits, then finds it applied.
- **Whose database.** PostgreSQL has no ``application_id``; a database (its ``current_schema()``) with
  tables but no ``schema_version`` is another application's and is refused, untouched. Give llamagate its
  own database, or its own schema (``?options=-csearch_path%3Dllamagate`` in the URL).
- **Key changes on every replica within a second: a poll, not LISTEN/NOTIFY.** Each replica's key view
  reads ``store_meta.keys_version`` five times a second (one primary-key lookup on an autocommit
  connection, so each read sees the last commit) and reloads the keys when it moved: the same code path
  as SQLite, in force within one poll (0.2 s) plus one read. LISTEN would save those lookups but needs a
  connection held in session mode (a transaction-mode PgBouncer drops it), and a notification missed
  while that connection was down must be made up by a read anyway, which is the poll again.
- **The server may go away and come back.** Each call checks its connection and reconnects when it is
  closed or broken; a read that finds its connection dead is tried once more on a new one (a write is
  not: it may have been committed); a call that fails raises ``StoreError`` naming the URL (without
  its password), which the admin routes answer as 503 ``store_unavailable``, the writer retries, and
  the key view survives (it keeps the keys it has). ``connect_timeout`` (5 s) bounds how long an
  unreachable server holds a call: the start fails in seconds, never hangs.

Budget windows: each replica counts its own in memory and writes the amounts it counted; on a shared
database the rows are the last writer's. Limits shared across replicas are ``cluster.redis_url``'s job.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import conninfo, errors

from proxy.accounts.migrations import Migration, migrations
from proxy.accounts.records import KeyRecord
from proxy.accounts.sqlbase import KEYS_VERSION, SELECT_KEYS, SqlStore, key_of, pg_placeholders
from proxy.accounts.store import StoreError

CONNECT_TIMEOUT_S = 5
# pg_advisory_xact_lock's key for "llamagate migrates this database": any constant of our own ("llgt").
_MIGRATION_LOCK = 0x6C6C6774
_CREDENTIALS = re.compile(r"://[^@/\s\"]*@")


def display_url(url: str) -> str:
    """The URL for messages and logs: user, host, port and database, never the password. ``StoreError``
    for a URL libpq cannot parse."""
    try:
        parts = conninfo.conninfo_to_dict(url)
    except psycopg.Error as exc:
        # libpq may quote the URL back, password included: the credentials part is cut out.
        said = _CREDENTIALS.sub("://", _first_line(exc))
        raise StoreError(f"store.url: not a PostgreSQL URL libpq accepts: {said}") from None
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = str(parts.get("host") or "localhost")
    host = f"[{host}]" if ":" in host and not host.startswith("/") else host
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{host}{port}/{parts.get('dbname') or ''}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


@functools.lru_cache(maxsize=256)
def _sql(statement: str) -> str:
    return pg_placeholders(statement)


class _Conn:
    """A psycopg connection with the sqlite3-like ``execute``/``executemany`` the shared code calls."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self._conn.execute(_sql(sql), tuple(args))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> psycopg.Cursor[Any]:
        cur = self._conn.cursor()
        rows = list(rows)
        if rows:
            cur.executemany(_sql(sql), rows)
        return cur


class PostgresStore(SqlStore):
    """``store.Store`` on one PostgreSQL database. Build it with ``open_postgres``."""

    def __init__(self, url: str, *, connect_timeout_s: int = CONNECT_TIMEOUT_S) -> None:
        self.url = url
        self._where = display_url(url)
        self._timeout = connect_timeout_s
        self._lock = threading.Lock()  # the writer's connection: writes and reports
        self._read_lock = threading.Lock()  # the key view's poll, on a connection of its own
        self._conn: psycopg.Connection[Any] | None = None
        self._poller: psycopg.Connection[Any] | None = None

    @property
    def where(self) -> str:
        return self._where

    # -- connections --------------------------------------------------------------------------------

    def connect(self) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(
                self.url, autocommit=True, connect_timeout=self._timeout, application_name="llamagate"
            )
        except psycopg.Error as exc:
            raise StoreError(f"{self._where}: cannot connect: {_first_line(exc)}") from exc

    @staticmethod
    def _usable(conn: psycopg.Connection[Any] | None) -> bool:
        return conn is not None and not conn.closed and not conn.broken

    def _writer(self) -> psycopg.Connection[Any]:
        if not self._usable(self._conn):
            self._drop("_conn")
            self._conn = self.connect()
        assert self._conn is not None
        return self._conn

    def _drop(self, which: str) -> None:
        conn = getattr(self, which)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        setattr(self, which, None)

    def _error(self, doing: str, exc: psycopg.Error) -> StoreError:
        return StoreError(f"{self._where}: cannot {doing}: {_first_line(exc)}")

    @contextlib.contextmanager
    def _tx(self, doing: str) -> Iterator[_Conn]:
        with self._lock:
            conn = self._writer()
            try:
                with conn.transaction():
                    yield _Conn(conn)
            except psycopg.Error as exc:
                if not self._usable(conn):
                    self._drop("_conn")
                raise self._error(doing, exc) from exc

    def _read(self, doing: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._read_on("_conn", doing, sql, args)

    def _read_on(self, which: str, doing: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """A read on the connection ``which`` (under its lock). One that the read finds dead (the
        database ended the session: a restart, a failover, ``pg_terminate_backend``) is made again and
        the read tried once more: a read may be repeated, and its caller (the key view, an admin change
        that has just been committed, a report) should not fail for a session that a new connection
        replaces at once. A query that fails on a live connection, or twice, raises ``StoreError``."""
        for last in (False, True):
            conn = getattr(self, which)
            if not self._usable(conn):
                self._drop(which)
                conn = self.connect()
                setattr(self, which, conn)
            try:
                return list(_Conn(conn).execute(sql, args).fetchall())
            except psycopg.Error as exc:
                alive = self._usable(conn)
                if not alive:
                    self._drop(which)
                if alive or last:
                    raise self._error(doing, exc) from exc
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _is_duplicate(self, exc: StoreError) -> bool:
        return isinstance(exc.__cause__, errors.UniqueViolation)

    # -- the key view's poll ------------------------------------------------------------------------

    def _poll(self, doing: str, sql: str) -> list[tuple[Any, ...]]:
        with self._read_lock:
            return self._read_on("_poller", doing, sql)

    def key_marker(self) -> int:
        """The keys' change counter: one primary-key lookup (see the module docstring for why a poll)."""
        return int(self._poll("poll for key changes", KEYS_VERSION)[0][0])

    def load_keys(self) -> list[KeyRecord]:
        """Every key that is not revoked (expired ones too: expiry is checked at each request)."""
        return [key_of(r) for r in self._poll("load keys", SELECT_KEYS + " WHERE revoked IS NULL")]

    # -- schema -------------------------------------------------------------------------------------

    def tables(self) -> list[str]:
        rows = self._read(
            "list the database's tables",
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() "
            "ORDER BY table_name",
        )
        return [str(r[0]) for r in rows]

    def migrate(self, known: tuple[Migration, ...]) -> int:
        """Apply the migrations the database lacks, in one transaction under the advisory lock; the
        version it is at after. A database of another application is refused untouched."""
        with self._tx("apply the schema") as conn:
            conn.execute(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
            tables = [
                str(r[0])
                for r in conn.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
                ).fetchall()
            ]
            if tables and "schema_version" not in tables:
                shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
                raise StoreError(
                    f"{self._where}: a database that is not a llamagate store (no schema_version table; "
                    f"tables: {shown}): give llamagate a database (or a schema) of its own"
                )
            return self._apply(conn, known)

    def schema_version(self) -> int:
        return int(self._read("read the schema version", "SELECT MAX(version) FROM schema_version")[0][0])

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._drop("_conn")
            self._drop("_poller")


def open_postgres(url: str) -> PostgresStore:
    """Connect to the database at ``url`` and bring its schema up to date. Raises ``StoreError``."""
    store = PostgresStore(url)
    try:
        store.migrate(migrations())
    except BaseException:
        store.close()
        raise
    return store


def inspect_postgres(url: str) -> str:
    """What ``config check`` says of the database, changing nothing; ``StoreError`` for one ``serve``
    would refuse (unreachable, another application's, a newer llamagate's)."""
    store = PostgresStore(url)
    try:
        tables = store.tables()
        if not tables:
            return f"{store.where}: an empty database (serve initialises it)"
        if "schema_version" not in tables:
            shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
            raise StoreError(f"{store.where}: a database that is not a llamagate store (tables: {shown})")
        have = store.schema_version()
    finally:
        store.close()
    known = len(migrations())
    if have > known:
        raise StoreError(
            f"{store.where}: schema version {have} was written by a newer llamagate "
            f"(this one knows up to {known})"
        )
    later = "" if have == known else f" (serve migrates it to {known})"
    return f"{store.where}: llamagate store, schema {have}{later}"
