"""The store on one SQLite file (the standard library's ``sqlite3``), in WAL mode.

Opening checks the file before trusting it, and refuses with a ``StoreError`` naming the file and what
is wrong: not a regular file, unreadable, not SQLite, another application's database (llamagate marks
its own with ``PRAGMA application_id``), corrupt (``PRAGMA quick_check``), written by a newer llamagate,
or (root only) owned by another user, whose daemon could not write the journal files root would leave.
A new file is created 0600 in a folder made 0700; SQLite gives its ``-wal`` and ``-shm`` files the same
mode as the database.

WAL: readers never wait for the writer, so the key view's poll and a ``llamagate keys list`` run
beside the daemon's batches; writers take turns (``busy_timeout``). ``synchronous=NORMAL``: a commit
survives the process being killed (the WAL is in the kernel's cache), and only a power loss can undo
the last commits, never corrupt the file.

Two connections: one for every write and for reports (behind a lock), one read-only for the key view's
poll, so that the poll sees every commit of the other (``PRAGMA data_version`` changes only for commits
made by another connection) and never waits behind a batch.

A batch's usage rows go in as one statement over a JSON array (``json_each``), not one ``executemany``
step per row: the sqlite3 module gives up the GIL around every step, and the writer thread then waits up
to the interpreter's switch interval to get it back each time, forcing the event loop to hand it over
again and again. Measured with the proxy benchmark's accounts phase: one step per row doubled the
proxy's CPU per request at a thousand requests a second; one statement per batch costs it a few
percent. SQLite without its JSON functions (compiled out; built in since 3.38) falls back to
``executemany``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from proxy.accounts.lockfile import DaemonLock
from proxy.accounts.migrations import SCHEMA_VERSION_TABLE, Migration, migrations
from proxy.accounts.records import (
    Batch,
    GroupBy,
    KeyRecord,
    UsageRecord,
    UsageRow,
    WindowEntry,
)
from proxy.accounts.store import StoreError
from proxy.settings import BudgetSettings, Scope

APPLICATION_ID = 0x6C6C6774  # "llgt" in the header's application id field (offset 68)
_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 5.0
_HOUR = 3600
_DAY = 86400

_SELECT_KEYS = (
    "SELECT key_id, digest, tenant, scopes, name, models, tokens_per_minute, tokens_per_day, "
    "requests_per_minute, created, expires, revoked, last_used FROM api_keys"
)
_KEY_BY_ID = _SELECT_KEYS + " WHERE key_id = ?"
_INSERT_KEY = (
    "INSERT INTO api_keys (key_id, digest, tenant, scopes, name, models, tokens_per_minute, tokens_per_day, "
    "requests_per_minute, created, expires, revoked, last_used) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_GROUPS: dict[str, tuple[str, str]] = {
    # by: (the selected group columns, in the order of UsageRow's fields key_id, model, period)
    "tenant": ("tenant, NULL, NULL, NULL", "tenant"),
    "key": ("tenant, key_id, NULL, NULL", "tenant, key_id"),
    "model": ("tenant, NULL, model, NULL", "tenant, model"),
    "hour": ("tenant, NULL, NULL, hour", "tenant, hour"),
    "day": (f"tenant, NULL, NULL, hour - (hour % {_DAY})", f"tenant, hour - (hour % {_DAY})"),
}

# The order of UsageRecord's fields.
_USAGE_COLUMNS = (
    "tenant, key_id, model, kind, prompt_tokens, cached_tokens, completion_tokens, status, duration_s, at, "
    "request_id"
)
_INSERT_USAGE = f"INSERT INTO usage_events ({_USAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
_INSERT_USAGE_JSON = (
    f"INSERT INTO usage_events ({_USAGE_COLUMNS}) SELECT "  # noqa: S608 - fixed column list
    + ", ".join(f"json_extract(value, '$[{i}]')" for i in range(11))
    + " FROM json_each(?)"
)
_HOURLY_COLUMNS = (
    "hour, tenant, key_id, model, kind, requests, errors, prompt_tokens, cached_tokens, completion_tokens, "
    "duration_s"
)
_UPSERT_HOURLY = (
    "ON CONFLICT (hour, tenant, key_id, model, kind) DO UPDATE SET "
    "requests = usage_hourly.requests + excluded.requests, "
    "errors = usage_hourly.errors + excluded.errors, "
    "prompt_tokens = usage_hourly.prompt_tokens + excluded.prompt_tokens, "
    "cached_tokens = usage_hourly.cached_tokens + excluded.cached_tokens, "
    "completion_tokens = usage_hourly.completion_tokens + excluded.completion_tokens, "
    "duration_s = usage_hourly.duration_s + excluded.duration_s"
)
_INSERT_HOURLY = f"INSERT INTO usage_hourly ({_HOURLY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "  # noqa: S608
_INSERT_HOURLY_JSON = (
    f"INSERT INTO usage_hourly ({_HOURLY_COLUMNS}) SELECT "  # noqa: S608 - fixed column list
    + ", ".join(f"json_extract(value, '$[{i}]')" for i in range(11))
    # "WHERE true": SQLite's upsert after a SELECT needs it, to tell ON CONFLICT from a join's ON.
    + " FROM json_each(?) WHERE true "
)

State = Literal["absent", "empty", "unmarked", "ours"]


def statements(sql: str) -> Iterator[str]:
    """The statements of a migration file, split where SQLite itself says a statement is complete (so a
    ';' inside a string or a comment does not split)."""
    buf = ""
    for piece in sql.split(";"):
        buf += piece + ";"
        if sqlite3.complete_statement(buf):
            text = buf.strip()
            if _strip_comments(text) != ";":
                yield text
            buf = ""
    if _strip_comments(buf[:-1]).strip():
        raise ValueError(f"incomplete SQL statement at the end of a migration: {buf[:60]!r}")


def _strip_comments(text: str) -> str:
    return "".join(line.split("--", 1)[0] for line in text.splitlines()).strip()


def _probe(path: Path) -> State:
    """What is at ``path``, from the file's first 100 bytes (SQLite's header), without opening it as a
    database: a file that is not ours must not be touched, not even by SQLite's journal recovery."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"{path}: not a regular file (a folder?): store.path names the database file")
    if os.geteuid() == 0 and st.st_uid != 0:
        # Root would leave -wal/-shm files (and rows in them) that the file's owner, the daemon's user,
        # cannot write: the daemon would then fail on its next write.
        raise StoreError(
            f"{path}: owned by uid {st.st_uid}, not by root: run this command as that user "
            f"(e.g. sudo -u '#{st.st_uid}' llamagate ...), so the files SQLite creates stay writable for it"
        )
    try:
        with path.open("rb") as f:
            head = f.read(100)
    except OSError as exc:
        mode = stat.S_IMODE(st.st_mode)
        raise StoreError(
            f"{path}: cannot read: {exc.strerror or exc} (mode {mode:04o}, owner uid {st.st_uid}; "
            f"this process runs as uid {os.geteuid()})"
        ) from exc
    if not head:
        return "empty"
    if not head.startswith(_MAGIC):
        raise StoreError(f"{path}: not an SQLite database (no SQLite header), so not a llamagate store")
    if len(head) < 100:
        raise StoreError(f"{path}: corrupt: the SQLite header is cut short ({len(head)} of 100 bytes)")
    app_id = int.from_bytes(head[68:72], "big")
    if app_id == APPLICATION_ID:
        return "ours"
    if app_id != 0:
        raise StoreError(
            f"{path}: an SQLite database of another application (application_id {app_id:#010x}), "
            "not a llamagate store"
        )
    return "unmarked"


def _prepare_folder(folder: Path) -> None:
    if folder.is_dir():
        return
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError as exc:
        raise StoreError(f"{folder}: not a folder: the store's folder must be one") from exc
    except OSError as exc:
        raise StoreError(f"{folder}: cannot create the store's folder: {exc.strerror or exc}") from exc


def _create(path: Path) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # another process made it between our look and now: it is probed again on connect
    except OSError as exc:
        raise StoreError(f"{path}: cannot create: {exc.strerror or exc}") from exc
    os.close(fd)


def _connect(path: Path, *, read_only: bool = False) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions; every write says BEGIN IMMEDIATE itself.
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    if read_only:
        conn.execute("PRAGMA query_only = 1")
    return conn


def _csv(values: Iterable[str]) -> str:
    return ",".join(sorted(values))


def _split(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.split(",") if v)


def _scopes(text: str) -> frozenset[Scope]:
    out: set[Scope] = set()
    for scope in _split(text):
        if scope == "inference":
            out.add("inference")
        elif scope == "admin":
            out.add("admin")
    return frozenset(out)


def _key(row: tuple[Any, ...]) -> KeyRecord:
    return KeyRecord(
        key_id=row[0],
        digest=row[1],
        tenant=row[2],
        scopes=_scopes(row[3]),
        name=row[4],
        models=_split(row[5]),
        budgets=BudgetSettings(row[6], row[7], row[8]),
        created=row[9],
        expires=row[10],
        revoked=row[11],
        last_used=row[12],
    )


class SqliteStore:
    """``store.Store`` on one SQLite file. Build it with ``open_store``."""

    def __init__(self, path: Path, lock: DaemonLock | None = None, *, max_pages: int | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._daemon_lock = lock
        self._conn = _connect(path)
        self._reader: sqlite3.Connection | None = None
        self._data_version = -1
        self._marker = 0
        try:
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._json = _has_json(self._conn)
            if max_pages is not None:
                self.limit_pages(max_pages)
        except sqlite3.Error:
            self._conn.close()
            raise

    @property
    def where(self) -> str:
        return str(self.path)

    # -- transactions -------------------------------------------------------------------------------

    def _error(self, doing: str, exc: sqlite3.Error) -> StoreError:
        return StoreError(f"{self.path}: cannot {doing}: {exc}")

    @contextlib.contextmanager
    def _tx(self, doing: str) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise self._error(doing, exc) from exc
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        # SQLite may already have rolled back on its own (SQLITE_FULL does, for some statements).
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    def _read(self, doing: str, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise self._error(doing, exc) from exc

    @staticmethod
    def _bump(conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE store_meta SET value = value + 1 WHERE name = 'keys_version'")

    # -- schema -------------------------------------------------------------------------------------

    def migrate(self, known: tuple[Migration, ...]) -> int:
        """Apply the migrations this file lacks, in one transaction; the version the file is at after."""
        with self._tx("apply the schema") as conn:
            conn.execute(SCHEMA_VERSION_TABLE)
            have = int(conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0])
            if have > len(known):
                raise StoreError(
                    f"{self.path}: schema version {have} was written by a newer llamagate (this one knows "
                    f"up to {len(known)}): upgrade llamagate, or restore a backup made by this version"
                )
            for m in known[have:]:
                for statement in statements(m.sql):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_version (version, name, applied) VALUES (?, ?, ?)",
                    (m.version, m.name, time.time()),
                )
            # Marked only together with its tables: a file left unmarked by a crash is adopted next time.
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            return max(have, len(known))

    def limit_pages(self, pages: int) -> int:
        """Cap the file at ``pages`` SQLite pages (never below its current size); a write beyond fails
        with SQLITE_FULL, exactly as on a full disk. The cap in force is returned."""
        with self._lock:
            row = self._conn.execute(f"PRAGMA max_page_count = {int(pages)}").fetchone()
            return int(row[0])

    def page_count(self) -> int:
        with self._lock:
            return int(self._conn.execute("PRAGMA page_count").fetchone()[0])

    def checkpoint(self) -> None:
        with self._lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            except sqlite3.Error as exc:
                raise self._error("checkpoint the journal", exc) from exc

    def schema_version(self) -> int:
        return int(self._read("read the schema version", "SELECT MAX(version) FROM schema_version")[0][0])

    # -- keys ---------------------------------------------------------------------------------------

    def add_key(self, key: KeyRecord) -> None:
        b = key.budgets
        try:
            with self._tx("add a key") as conn:
                conn.execute(
                    _INSERT_KEY,
                    (
                        key.key_id,
                        key.digest,
                        key.tenant,
                        _csv(key.scopes),
                        key.name,
                        ",".join(key.models),
                        b.tokens_per_minute,
                        b.tokens_per_day,
                        b.requests_per_minute,
                        key.created,
                        key.expires,
                        key.revoked,
                        key.last_used,
                    ),
                )
                self._bump(conn)
        except StoreError as exc:
            if isinstance(exc.__cause__, sqlite3.IntegrityError):
                raise StoreError(f"{self.path}: a key with id {key.key_id} exists already") from exc
            raise

    def get_key(self, key_id: str) -> KeyRecord | None:
        rows = self._read("read a key", _KEY_BY_ID, (key_id,))
        return _key(rows[0]) if rows else None

    def list_keys(self) -> list[KeyRecord]:
        rows = self._read("list keys", _SELECT_KEYS + " ORDER BY tenant, created")
        return [_key(r) for r in rows]

    def revoke_key(self, key_id: str, now: float) -> KeyRecord | None:
        """Revoke a key (again: a no-op); None when there is no such key."""
        with self._tx("revoke a key") as conn:
            cur = conn.execute(
                "UPDATE api_keys SET revoked = ? WHERE key_id = ? AND revoked IS NULL", (now, key_id)
            )
            if cur.rowcount:
                self._bump(conn)
            row = conn.execute(_KEY_BY_ID, (key_id,)).fetchone()
        return _key(row) if row else None

    def replace_key(self, old_id: str, new: KeyRecord, now: float, grace_s: float = 0.0) -> KeyRecord:
        """Rotation in one transaction: ``new`` is added, and the old key is revoked now (``grace_s`` 0)
        or expires ``grace_s`` from now (so clients can move to the new key without an outage)."""
        with self._tx("rotate a key") as conn:
            row = conn.execute(_KEY_BY_ID, (old_id,)).fetchone()
            if row is None:
                raise StoreError(f"{self.path}: no key with id {old_id}")
            old = _key(row)
            if old.status(now) != "active":
                status = old.status(now)
                raise StoreError(f"{self.path}: key {old_id} is {status}: only an active key rotates")
            b = new.budgets
            conn.execute(
                _INSERT_KEY,
                (
                    new.key_id,
                    new.digest,
                    new.tenant,
                    _csv(new.scopes),
                    new.name,
                    ",".join(new.models),
                    b.tokens_per_minute,
                    b.tokens_per_day,
                    b.requests_per_minute,
                    new.created,
                    new.expires,
                    None,
                    None,
                ),
            )
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
            row = conn.execute(_KEY_BY_ID, (key_id,)).fetchone()
        return _key(row) if row else None

    def _poll(self) -> sqlite3.Connection:
        if self._reader is None:
            self._reader = _connect(self.path, read_only=True)
        return self._reader

    def key_marker(self) -> int:
        """The keys' change counter. ``PRAGMA data_version`` answers from memory whether any other
        connection committed since the last call, so an idle store costs no read at all."""
        with self._read_lock:
            try:
                conn = self._poll()
                version = int(conn.execute("PRAGMA data_version").fetchone()[0])
                if version != self._data_version:
                    row = conn.execute("SELECT value FROM store_meta WHERE name = 'keys_version'").fetchone()
                    self._marker = int(row[0])
                    self._data_version = version
            except sqlite3.Error as exc:
                raise self._error("poll for key changes", exc) from exc
            return self._marker

    def load_keys(self) -> list[KeyRecord]:
        """Every key that is not revoked (expired ones too: expiry is checked at each request)."""
        with self._read_lock:
            try:
                rows = self._poll().execute(_SELECT_KEYS + " WHERE revoked IS NULL").fetchall()
            except sqlite3.Error as exc:
                raise self._error("load keys", exc) from exc
        return [_key(r) for r in rows]

    # -- the writer's batch -------------------------------------------------------------------------

    def write(self, batch: Batch) -> None:
        if not batch:
            return
        hourly: dict[tuple[int, str, str, str, str], list[float]] = {}
        for u in batch.usage:
            group = (int(u.at // _HOUR) * _HOUR, u.tenant, u.key_id, u.model, u.kind)
            sums = hourly.setdefault(group, [0, 0, 0, 0, 0, 0.0])
            sums[0] += 1
            sums[1] += 1 if u.status >= 400 else 0
            sums[2] += u.prompt_tokens
            sums[3] += u.cached_tokens
            sums[4] += u.completion_tokens
            sums[5] += u.duration_s
        rows = batch.usage  # a UsageRecord is a tuple of the columns of _USAGE_COLUMNS, in order
        sums_rows = [(*group, *(int(v) for v in sums[:5]), sums[5]) for group, sums in hourly.items()]
        with self._tx("write the usage ledger") as conn:
            if rows and self._json:
                conn.execute(_INSERT_USAGE_JSON, (json.dumps(rows),))
                conn.execute(_INSERT_HOURLY_JSON + _UPSERT_HOURLY, (json.dumps(sums_rows),))
            elif rows:
                conn.executemany(_INSERT_USAGE, rows)
                conn.executemany(_INSERT_HOURLY + _UPSERT_HOURLY, sums_rows)
            # Windows carry absolute amounts, so writing one again (a retried batch) changes nothing.
            conn.executemany(
                "INSERT INTO budget_windows (subject, name, budget, at, amount, expires) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (subject, name, budget, at) DO UPDATE SET "
                "amount = excluded.amount, expires = excluded.expires",
                [(w.subject, w.name, w.budget, w.at, w.amount, w.expires) for w in batch.windows],
            )
            conn.executemany(
                "UPDATE api_keys SET last_used = ? WHERE key_id = ? AND (last_used IS NULL OR last_used < ?)",
                [(at, key_id, at) for key_id, at in batch.last_used],
            )

    def load_windows(self, now: float) -> list[WindowEntry]:
        rows = self._read(
            "load budget windows",
            "SELECT subject, name, budget, at, amount, expires FROM budget_windows WHERE expires > ? "
            "ORDER BY at",
            (now,),
        )
        return [WindowEntry(*r) for r in rows]

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
        selected, grouped = _GROUPS[by]
        where: list[str] = ["1 = 1"]
        args: list[object] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if key_id is not None:
            where.append("key_id = ?")
            args.append(key_id)
        if since is not None:
            where.append("hour >= ?")
            args.append(int(since // _HOUR) * _HOUR)
        rows = self._read(
            "report usage",
            f"SELECT {selected}, SUM(requests), SUM(errors), SUM(prompt_tokens), SUM(cached_tokens), "  # noqa: S608 - fixed column lists
            f"SUM(completion_tokens) FROM usage_hourly WHERE {' AND '.join(where)} "
            f"GROUP BY {grouped} ORDER BY {grouped}",
            tuple(args),
        )
        return [
            UsageRow(r[0], r[1], r[2], None if r[3] is None else int(r[3]), *(int(v) for v in r[4:]))
            for r in rows
        ]

    def usage_records(self, *, tenant: str | None = None, since: float | None = None) -> list[UsageRecord]:
        where: list[str] = ["1 = 1"]
        args: list[object] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if since is not None:
            where.append("at >= ?")
            args.append(since)
        rows = self._read(
            "read usage rows",
            "SELECT tenant, key_id, model, kind, prompt_tokens, cached_tokens, completion_tokens, status, "  # noqa: S608
            f"duration_s, at, request_id FROM usage_events WHERE {' AND '.join(where)} ORDER BY at",
            tuple(args),
        )
        return [UsageRecord(*r) for r in rows]

    def close(self) -> None:
        with self._lock, self._read_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            self._conn.close()
        if self._daemon_lock is not None:
            self._daemon_lock.release()
            self._daemon_lock = None


def _has_json(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("SELECT json_extract(value, '$[0]') FROM json_each('[[1]]')").fetchall()
    except sqlite3.OperationalError:
        return False
    return True


def _check_contents(conn: sqlite3.Connection, path: Path, state: State) -> None:
    """Refuse what is not a sound llamagate store. Runs before anything is written (WAL mode included):
    a foreign database is left exactly as it was."""
    if state == "unmarked":
        # The file's own header says 0, but in WAL mode the mark may still sit in the -wal file (a crash
        # before the first checkpoint): ask SQLite, which reads both.
        app_id = int(conn.execute("PRAGMA application_id").fetchone()[0])
        if app_id not in (0, APPLICATION_ID):
            raise StoreError(
                f"{path}: an SQLite database of another application (application_id {app_id:#010x}), "
                "not a llamagate store"
            )
        if app_id == 0:
            tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            if tables:
                shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
                raise StoreError(
                    f"{path}: an SQLite database that is not a llamagate store "
                    f"(no llamagate mark; tables: {shown})"
                )
            return
    # Opening reads little of the file; a damaged page elsewhere would surface later, at some write.
    problems = [r[0] for r in conn.execute("PRAGMA quick_check")]
    if problems != ["ok"]:
        lines = [ln for p in problems for ln in p.splitlines() if ln and not ln.startswith("*** in database")]
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        first = lines[0] if lines else problems[0]
        raise StoreError(f"{path}: corrupt: {first}{more}; restore a backup (docs/operations.md)")


def open_store(
    path: str | Path, *, daemon: bool = False, create: bool = True, max_pages: int | None = None
) -> SqliteStore:
    """Open the store at ``path``, checked and migrated; an absent one is created (0600, in a folder
    made 0700) unless ``create`` is False. ``daemon``: also take the store's daemon lock, so that a
    second daemon on the same file is refused. ``max_pages`` caps the file's size (SQLite pages), for
    tests that need a real SQLITE_FULL. Raises ``StoreError``."""
    path = Path(path)
    if not create and _probe(path) == "absent":
        raise StoreError(f"{path}: no store there yet (llamagate serve or llamagate keys new creates it)")
    _prepare_folder(path.parent)
    lock = DaemonLock.acquire(path) if daemon else None
    try:
        state = _probe(path)
        if state == "absent":
            owner = path.parent.stat().st_uid
            if os.geteuid() == 0 and owner != 0:
                raise StoreError(
                    f"{path}: absent, and its folder belongs to uid {owner}: create the store as that user "
                    f"(e.g. sudo -u '#{owner}' llamagate ...), so that its daemon can write it"
                )
            _create(path)
            state = _probe(path)
        elif state == "ours":
            path.chmod(0o600)  # a file copied in (a restored backup) may have come with a wider mode
        store = SqliteStore(path, lock, max_pages=max_pages)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        try:
            if state in ("unmarked", "ours"):
                _check_contents(store._conn, path, state)
            mode = store._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"{path}: cannot use WAL mode (journal_mode stays {mode}): is it on NFS?")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: corrupt or not a database: {exc}") from exc
        store.migrate(migrations())
        store.checkpoint()  # the mark into the file's own header, where the next open looks first
    except BaseException:
        store.close()
        raise
    return store


def inspect_store(path: str | Path) -> str:
    """What ``config check`` says about the store without creating or changing anything: a short
    description, or ``StoreError`` for a file ``serve`` would refuse."""
    path = Path(path)
    state = _probe(path)
    if state == "absent":
        folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
        if folder is None or not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise StoreError(f"{path}: absent, and its folder cannot be created ({folder} is not writable)")
        return f"{path}: absent (serve creates it)"
    if state == "empty":
        return f"{path}: empty (serve initialises it)"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open: {exc}") from exc
    try:
        _check_contents(conn, path, state)
        if int(conn.execute("PRAGMA application_id").fetchone()[0]) == 0:
            return f"{path}: an empty SQLite database (serve initialises it)"
        have = int(conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path}: corrupt or not a database: {exc}") from exc
    finally:
        conn.close()
    known = len(migrations())
    if have > known:
        raise StoreError(
            f"{path}: schema version {have} was written by a newer llamagate (this one knows up to {known})"
        )
    later = "" if have == known else f" (serve migrates it to {known})"
    return f"{path}: llamagate store, schema {have}{later}"
