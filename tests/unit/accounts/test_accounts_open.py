"""Opening a store file: what is made, and every kind of file that is refused, by name and reason."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.accounts.lockfile import lock_path
from proxy.accounts.migrations import latest
from proxy.accounts.sqlite import APPLICATION_ID, inspect_store, open_store
from proxy.accounts.store import StoreError

REPO = Path(__file__).resolve().parents[3]


def test_a_new_store_is_private_marked_and_in_wal_mode(store_path: Path) -> None:
    store = open_store(store_path)
    try:
        assert stat.S_IMODE(store_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(store_path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(Path(f"{store_path}-wal").stat().st_mode) == 0o600  # SQLite copies the mode
        assert store.schema_version() == latest()
    finally:
        store.close()
    # Marked in the file's own header (not only in the WAL): the next open recognises it before SQLite runs.
    header = store_path.read_bytes()[:100]
    assert int.from_bytes(header[68:72], "big") == APPLICATION_ID
    conn = sqlite3.connect(store_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert inspect_store(store_path).endswith(f"llamagate store, schema {latest()}")


def test_reopening_keeps_the_data_and_tightens_a_wide_mode(store_path: Path) -> None:
    from proxy.accounts.issue import issue_key

    store = open_store(store_path)
    _, record = issue_key("a", frozenset({"inference"}), 1.0)
    store.add_key(record)
    store.close()
    store_path.chmod(0o644)  # as a restored backup may come
    store = open_store(store_path)
    try:
        assert [k.key_id for k in store.list_keys()] == [record.key_id]
        assert stat.S_IMODE(store_path.stat().st_mode) == 0o600
    finally:
        store.close()


def test_an_empty_file_and_an_empty_sqlite_database_are_adopted(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    open_store(empty).close()
    blank = tmp_path / "blank.db"
    sqlite3.connect(blank).execute("VACUUM").connection.close()  # a valid database with no tables
    assert "empty SQLite database" in inspect_store(blank)
    store = open_store(blank)
    assert store.schema_version() == latest()
    store.close()


def refusal(path: Path) -> str:
    with pytest.raises(StoreError) as info:
        open_store(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    with pytest.raises(StoreError) as inspected:  # config check says the same, and changes nothing
        inspect_store(path)
    assert str(inspected.value).startswith(f"{path}: ")
    return message


def test_a_file_that_is_not_sqlite_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 10)
    before = path.read_bytes()
    assert "not an SQLite database" in refusal(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.db"]  # no -wal, no -shm left beside it


def test_another_applications_database_is_refused_untouched(tmp_path: Path) -> None:
    marked = tmp_path / "other.db"
    conn = sqlite3.connect(marked)
    conn.execute("PRAGMA application_id = 1234")
    conn.execute("CREATE TABLE photos (id INTEGER)")
    conn.commit()
    conn.close()
    assert "another application (application_id 0x000004d2)" in refusal(marked)

    unmarked = tmp_path / "unmarked.db"
    conn = sqlite3.connect(unmarked)
    conn.execute("CREATE TABLE photos (id INTEGER)")
    conn.commit()
    conn.close()
    before = unmarked.read_bytes()
    message = refusal(unmarked)
    assert "not a llamagate store" in message and "tables: photos" in message
    assert unmarked.read_bytes() == before
    conn = sqlite3.connect(unmarked)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not switched to WAL
    conn.close()


def test_a_corrupt_store_is_refused(store_path: Path) -> None:
    from proxy.accounts.issue import issue_key

    store = open_store(store_path)
    for i in range(200):
        store.add_key(issue_key(f"t{i}", frozenset({"inference"}), 1.0)[1])
    store.close()
    conn = sqlite3.connect(store_path)
    (leaf,) = conn.execute(
        "SELECT max(pageno) FROM dbstat WHERE name = 'api_keys' AND pagetype = 'leaf'"
    ).fetchone()
    conn.close()
    data = bytearray(store_path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    start = (leaf - 1) * page
    data[start + page - 400 : start + page] = b"\x07" * 400  # cells (at the page's end) garbled
    store_path.write_bytes(bytes(data))
    # Opening alone would not notice (it reads the schema, not this page): the check does.
    message = refusal(store_path)
    assert f"corrupt: On tree page {leaf} cell" in message and "restore a backup" in message


def test_a_damaged_schema_page_is_refused(store_path: Path) -> None:
    open_store(store_path).close()
    data = bytearray(store_path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page + 8 : 2 * page] = b"\xff" * (page - 8)
    store_path.write_bytes(bytes(data))
    assert "corrupt" in refusal(store_path)


def test_a_truncated_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cut.db"
    path.write_bytes(b"SQLite format 3\x00" + b"\x10\x00")
    assert "cut short" in refusal(path)


def test_a_store_from_a_newer_llamagate_is_refused(store_path: Path) -> None:
    open_store(store_path).close()
    conn = sqlite3.connect(store_path)
    conn.execute("INSERT INTO schema_version (version, name, applied) VALUES (99, '0099_future.sql', 0)")
    conn.commit()
    conn.close()
    assert "schema version 99 was written by a newer llamagate" in refusal(store_path)


def test_a_folder_where_the_file_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    assert "not a regular file" in refusal(tmp_path / "dir.db")


def test_the_mark_still_only_in_the_wal_is_recognised(store_path: Path) -> None:
    # A crash after the first commit and before the first checkpoint: the header in the main file still
    # says 0, the mark and the tables are in the -wal file. That is our store, not a foreign database.
    code = f"""
import os, sqlite3
from proxy.accounts.migrations import migrations, SCHEMA_VERSION_TABLE
from proxy.accounts.sqlite import statements, APPLICATION_ID
c = sqlite3.connect({str(store_path)!r}, isolation_level=None)
c.execute("PRAGMA journal_mode = WAL")
c.execute("PRAGMA wal_autocheckpoint = 0")
c.execute("BEGIN")
c.execute(SCHEMA_VERSION_TABLE)
for m in migrations():
    for s in statements(m.sql):
        c.execute(s)
    c.execute("INSERT INTO schema_version VALUES (?, ?, 0)", (m.version, m.name))
c.execute(f"PRAGMA application_id = {{APPLICATION_ID}}")
c.execute("COMMIT")
os.kill(os.getpid(), 9)
"""
    store_path.parent.mkdir(parents=True)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
    assert run.returncode == -signal.SIGKILL
    assert int.from_bytes(store_path.read_bytes()[68:72], "big") == 0
    assert Path(f"{store_path}-wal").stat().st_size > 0
    store = open_store(store_path)
    assert store.schema_version() == latest()
    store.close()


def test_a_new_store_is_marked_in_its_own_header_even_if_killed_at_once(store_path: Path) -> None:
    code = (
        "import os\nfrom proxy.accounts.sqlite import open_store\n"
        f"open_store({str(store_path)!r})\nos.kill(os.getpid(), 9)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
    assert run.returncode == -signal.SIGKILL
    assert int.from_bytes(store_path.read_bytes()[68:72], "big") == APPLICATION_ID


def _as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        user=65534,
        group=65534,
        env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A folder any user can reach (tmp_path's parents are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="llamagate-store-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_an_unreadable_file_is_refused_by_name(public_dir: Path) -> None:
    path = public_dir / "locked.db"
    open_store(path).close()
    path.chmod(0o000)
    if os.geteuid() != 0:
        assert "cannot read: Permission denied" in refusal(path)
        return
    # Root reads any file: the refusal is what the service user meets, so ask as an unprivileged user.
    run = _as_nobody(f"from proxy.accounts.sqlite import open_store\nopen_store({str(path)!r})\n")
    assert run.returncode == 1, run.stderr
    assert f"StoreError: {path}: cannot read: Permission denied (mode 0000" in run.stderr


def test_root_refuses_a_store_of_another_user(store_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root may open another user's file")
    open_store(store_path).close()
    os.chown(store_path, 65534, 65534)
    message = refusal(store_path)
    assert "owned by uid 65534, not by root" in message and "sudo -u" in message


def test_a_second_daemon_on_the_same_file_is_refused(store_path: Path) -> None:
    first = open_store(store_path, daemon=True)
    try:
        with pytest.raises(StoreError, match=f"in use by another llamagate daemon \\(pid {os.getpid()}\\)"):
            open_store(store_path, daemon=True)
        # A command beside the daemon is fine: WAL lets it read and write.
        command = open_store(store_path)
        command.close()
    finally:
        first.close()
    open_store(store_path, daemon=True).close()  # the lock went with the first daemon


def test_the_lock_of_a_killed_daemon_does_not_block_the_next(store_path: Path) -> None:
    code = (
        "import sys, time\nfrom proxy.accounts.sqlite import open_store\n"
        f"s = open_store({str(store_path)!r}, daemon=True)\nprint('open', flush=True)\ntime.sleep(60)\n"
    )
    with subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "open\n"
            with pytest.raises(StoreError, match=f"pid {proc.pid}"):
                open_store(store_path, daemon=True)
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert lock_path(store_path).exists()
    open_store(store_path, daemon=True).close()


def test_a_read_command_does_not_create_a_store(store_path: Path) -> None:
    with pytest.raises(StoreError, match="no store there yet"):
        open_store(store_path, create=False)
    assert not store_path.parent.exists()
    assert "absent (serve creates it)" in inspect_store(store_path)


def test_an_online_backup_opens_as_a_store(store_path: Path, tmp_path: Path) -> None:
    # docs/operations.md: `sqlite3 FILE ".backup COPY"` while the daemon writes; the same SQLite backup API.
    from proxy.accounts.issue import issue_key

    daemon = open_store(store_path, daemon=True)
    try:
        _, record = issue_key("a", frozenset({"inference"}), 1.0)
        daemon.add_key(record)
        copy = tmp_path / "backup.db"
        source = sqlite3.connect(store_path)
        target = sqlite3.connect(copy)
        source.backup(target)
        source.close()
        target.close()
    finally:
        daemon.close()
    restored = open_store(copy)
    try:
        assert [k.key_id for k in restored.list_keys()] == [record.key_id]
    finally:
        restored.close()


def test_a_store_of_schema_1_is_upgraded_and_its_rows_keep_their_meaning(store_path: Path) -> None:
    """Schema 2 adds ``usage_events.usage_source``: a row written before it was the child's own report."""
    import sqlite3

    from proxy.accounts.migrations import SCHEMA_VERSION_TABLE, migrations
    from proxy.accounts.sqlite import APPLICATION_ID, statements

    store_path.parent.mkdir(parents=True)
    first = migrations()[0]
    conn = sqlite3.connect(store_path, isolation_level=None)
    conn.execute(SCHEMA_VERSION_TABLE)
    for statement in statements(first.sql):
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version VALUES (?, ?, 0)", (first.version, first.name))
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(
        "INSERT INTO usage_events (at, tenant, key_id, model, kind, prompt_tokens, cached_tokens,"
        " completion_tokens, status, duration_s, request_id)"
        " VALUES (1.0, 't', 'k', 'm', 'chat', 5, 0, 2, 200, 0.1, 'r')"
    )
    conn.close()
    store = open_store(store_path)
    try:
        assert store.schema_version() == latest() >= 2
        (row,) = store.usage_records()
        assert (row.prompt_tokens, row.usage_source) == (5, "reported")
    finally:
        store.close()
