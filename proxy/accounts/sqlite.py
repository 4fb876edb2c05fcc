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

A batch's usage rows go in as few statements as SQLite's parameter limit allows (one multi-row
``INSERT ... VALUES``, up to ``ROWS_PER_STATEMENT`` rows each), not one ``executemany`` step per row: the
sqlite3 module gives up the GIL around every step, and the writer thread then waits up to the
interpreter's switch interval to get it back each time, forcing the event loop to hand it over again
and again. Measured with the proxy benchmark's accounts phase: one step per row doubled the proxy's CPU
per request at a thousand requests a second. The rows are bound as parameters, not sent as one JSON
array over ``json_each``: that was one step too, but SQLite parsing the array cost the writer about
9 us a row against 3 (``tests.benchmarks.store_write``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sqlite3
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from proxy.accounts.lockfile import DaemonLock
from proxy.accounts.migrations import Migration, migrations, statements
from proxy.accounts.records import KeyRecord, LedgerRow
from proxy.accounts.sqlbase import (
    HOURLY_COLUMNS,
    KEYS_VERSION,
    SELECT_KEYS,
    UPSERT_HOURLY,
    USAGE_COLUMNS,
    Conn,
    SqlStore,
    key_of,
)
from proxy.accounts.store import StoreError

__all__ = ["APPLICATION_ID", "SqliteStore", "inspect_store", "open_store", "statements"]

APPLICATION_ID = 0x6C6C6774  # "llgt" in the header's application id field (offset 68)
_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 5.0
# Rows per statement, within SQLite's limit on parameters (32766 since 3.32, 999 before; a row has 12).
ROWS_PER_STATEMENT = 500 if sqlite3.sqlite_version_info >= (3, 32, 0) else 90
_INSERT_USAGE_ROWS = f"INSERT INTO usage_events ({USAGE_COLUMNS}) VALUES "  # noqa: S608 - fixed column list
_INSERT_HOURLY_ROWS = f"INSERT INTO usage_hourly ({HOURLY_COLUMNS}) VALUES "  # noqa: S608 - fixed column list


@functools.lru_cache(maxsize=32)
def _rows_sql(head: str, width: int, count: int, tail: str) -> str:
    row = "(" + ", ".join("?" * width) + ")"
    return head + ", ".join([row] * count) + " " + tail


def _insert_rows(conn: Conn, head: str, rows: Sequence[Sequence[Any]], tail: str = "") -> None:
    """``rows`` (all of one width) in statements of ``ROWS_PER_STATEMENT`` rows, and the rest in
    statements of a power of two rows each (``statement_sizes``)."""
    start = 0
    for count in statement_sizes(len(rows)):
        chunk = rows[start : start + count]
        start += count
        conn.execute(_rows_sql(head, len(chunk[0]), count, tail), list(itertools.chain.from_iterable(chunk)))


def statement_sizes(rows: int) -> Iterator[int]:
    """How many rows each statement of a batch of ``rows`` holds: as many ``ROWS_PER_STATEMENT`` as fit,
    then the rest as a sum of powers of two (485: 256, 128, 64, 32, 4, 1). So a batch of any size is
    made of at most ten statement texts per table, each prepared once and then found in the sqlite3
    module's statement cache; a statement of exactly the rest's size would be a new text for most
    batches (the writer's are as large as what came in since the last one), and SQLite parsing a
    statement of hundreds of rows again cost more than inserting them (7.0 against 4.3 us a row)."""
    while rows >= ROWS_PER_STATEMENT:
        yield ROWS_PER_STATEMENT
        rows -= ROWS_PER_STATEMENT
    size = 1 << (ROWS_PER_STATEMENT.bit_length() - 1)
    while rows:
        if rows >= size:
            yield size
            rows -= size
        size >>= 1


State = Literal["absent", "empty", "unmarked", "ours"]


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


def _connect(path: Path, *, read_only: bool = False, file_read_only: bool = False) -> sqlite3.Connection:
    """``read_only``: this connection writes nothing; ``file_read_only``: the file is opened read-only too
    (SQLite's ``mode=ro``: it asks the filesystem for nothing but reads, so a full disk cannot stop it)."""
    # isolation_level=None: no implicit transactions; every write says BEGIN IMMEDIATE itself.
    target: str | Path = f"file:{path}?mode=ro" if file_read_only else path
    conn = sqlite3.connect(
        target, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False, uri=file_read_only
    )
    if read_only or file_read_only:
        conn.execute("PRAGMA query_only = 1")
    return conn


class SqliteStore(SqlStore):
    """``store.Store`` on one SQLite file. Build it with ``open_store``."""

    def __init__(
        self,
        path: Path,
        lock: DaemonLock | None = None,
        *,
        max_pages: int | None = None,
        read_only: bool = False,
    ) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._daemon_lock = lock
        self._conn = _connect(path, file_read_only=read_only)
        self._reader: sqlite3.Connection | None = None
        self._data_version = -1
        self._marker = 0
        try:
            if not read_only:
                self._conn.execute("PRAGMA synchronous = NORMAL")
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

    # -- schema -------------------------------------------------------------------------------------

    def migrate(self, known: tuple[Migration, ...]) -> int:
        """Apply the migrations this file lacks, in one transaction; the version the file is at after."""
        with self._tx("apply the schema") as conn:
            version = self._apply(conn, known)
            # Marked only together with its tables: a file left unmarked by a crash is adopted next time.
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            return version

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

    def _is_duplicate(self, exc: StoreError) -> bool:
        return isinstance(exc.__cause__, sqlite3.IntegrityError)

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
                    row = conn.execute(KEYS_VERSION).fetchone()
                    self._marker = int(row[0])
                    self._data_version = version
            except sqlite3.Error as exc:
                raise self._error("poll for key changes", exc) from exc
            return self._marker

    def load_keys(self) -> list[KeyRecord]:
        """Every key that is not revoked (expired ones too: expiry is checked at each request)."""
        with self._read_lock:
            try:
                rows = self._poll().execute(SELECT_KEYS + " WHERE revoked IS NULL").fetchall()
            except sqlite3.Error as exc:
                raise self._error("load keys", exc) from exc
        return [key_of(r) for r in rows]

    # -- the writer's batch -------------------------------------------------------------------------

    def _write_usage(self, conn: Conn, rows: Sequence[LedgerRow], sums: list[tuple[Any, ...]]) -> None:
        _insert_rows(conn, _INSERT_USAGE_ROWS, rows)
        if sums:
            _insert_rows(conn, _INSERT_HOURLY_ROWS, sums, UPSERT_HOURLY)

    def close(self) -> None:
        with self._lock, self._read_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            self._conn.close()
        if self._daemon_lock is not None:
            self._daemon_lock.release()
            self._daemon_lock = None


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
    path: str | Path,
    *,
    daemon: bool = False,
    create: bool = True,
    max_pages: int | None = None,
    read_only: bool = False,
) -> SqliteStore:
    """Open the store at ``path``, checked and migrated; an absent one is created (0600, in a folder
    made 0700) unless ``create`` is False. ``daemon``: also take the store's daemon lock, so that a
    second daemon on the same file is refused. ``max_pages`` caps the file's size (SQLite pages), for
    tests that need a real SQLITE_FULL. ``read_only``: for commands that only read (``usage``, ``keys
    list``): the same checks, nothing written (no migration, no checkpoint), so a full disk or a
    read-only file does not stop them. Raises ``StoreError`` for a file that is not a usable store:
    absent, foreign, corrupt or cut short, newer, unreadable."""
    path = Path(path)
    if not create and _probe(path) == "absent":
        raise StoreError(f"{path}: no store there yet (llamagate serve or llamagate keys new creates it)")
    if read_only:
        return _open_read_only(path)
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
    except BaseException as exc:
        if lock is not None:
            lock.release()
        if isinstance(exc, sqlite3.DatabaseError):  # a file cut short fails at its first statement
            raise _corrupt(path, exc) from exc
        raise
    try:
        try:
            if state in ("unmarked", "ours"):
                _check_contents(store._conn, path, state)
            mode = store._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"{path}: cannot use WAL mode (journal_mode stays {mode}): is it on NFS?")
            store.migrate(migrations())
            store.checkpoint()  # the mark into the file's own header, where the next open looks first
        except sqlite3.DatabaseError as exc:
            raise _corrupt(path, exc) from exc
    except BaseException:
        store.close()
        raise
    return store


def _schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0])


def _refuse_newer(path: Path, have: int) -> None:
    known = len(migrations())
    if have > known:
        raise StoreError(
            f"{path}: schema version {have} was written by a newer llamagate (this one knows up to {known})"
        )


def _corrupt(path: Path, exc: sqlite3.DatabaseError) -> StoreError:
    return StoreError(f"{path}: corrupt or not a database: {exc}; restore a backup (docs/operations.md)")


def _open_read_only(path: Path) -> SqliteStore:
    """``open_store(read_only=True)``: checked like ``inspect_store`` (``config check``), then opened for
    reading only. A store not initialised yet, or at an older schema, reads as it is."""
    state = _probe(path)
    if state in ("empty", "unmarked"):
        raise StoreError(f"{path}: not initialised yet, nothing to read (llamagate serve initialises it)")
    try:
        store = SqliteStore(path, read_only=True)
    except sqlite3.DatabaseError as exc:
        raise _corrupt(path, exc) from exc
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open: {exc}") from exc
    try:
        try:
            _check_contents(store._conn, path, state)
            have = _schema_version(store._conn)
        except sqlite3.DatabaseError as exc:
            raise _corrupt(path, exc) from exc
        _refuse_newer(path, have)
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
        have = _schema_version(conn)
    except sqlite3.DatabaseError as exc:
        raise _corrupt(path, exc) from exc
    finally:
        conn.close()
    _refuse_newer(path, have)
    known = len(migrations())
    later = "" if have == known else f" (serve migrates it to {known})"
    return f"{path}: llamagate store, schema {have}{later}"
