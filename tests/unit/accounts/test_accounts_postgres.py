"""What is the PostgreSQL engine's own (``proxy.accounts.postgres``), against a real, private server
(``postgres_server`` in tests/conftest.py): the URL in messages without its password, an unreachable
server named at start and at ``config check``, another application's database refused untouched,
replicas migrating at once, a key change seen by another process's view, a lost connection recovered.
What both engines do alike runs on both from the shared fixtures (``store`` in conftest.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest

from proxy.accounts.issue import issue_key
from proxy.accounts.keyview import KeyView
from proxy.accounts.migrations import latest
from proxy.accounts.postgres import PostgresStore, display_url, inspect_postgres, open_postgres
from proxy.accounts.store import StoreError
from proxy.settings import Scope
from supervisor.child.spawn import free_port
from supervisor.config.load import parse_config
from supervisor.daemon.wiring import check_store, open_accounts
from supervisor.errors import Misconfigured
from tests.helpers.postgres_server import Postgres
from tests.unit.accounts.conftest import wait_until

INFERENCE: frozenset[Scope] = frozenset({"inference"})
needs_postgres = pytest.mark.needs_tool("initdb", "postgres")


def test_the_url_in_messages_never_carries_the_password() -> None:
    url = "postgresql://gate:s3cret@db.example:6432/accounts?sslmode=require"
    assert display_url(url) == "postgresql://gate@db.example:6432/accounts"
    assert display_url("postgres:///accounts") == "postgresql://localhost/accounts"
    with pytest.raises(StoreError, match=r'store.url: not a PostgreSQL URL libpq accepts: .*"nonsense"'):
        display_url("postgresql://gate:s3cret@host/db?nonsense=1")
    with pytest.raises(StoreError) as info:
        display_url("postgresql://gate:s3cret@[::1/db")  # libpq quotes this URL back
    assert "s3cret" not in str(info.value) and "gate" not in str(info.value)


def test_an_unreachable_server_is_named_at_start_and_by_config_check() -> None:
    port = free_port()  # nothing listens there
    url = f"postgresql://gate:s3cret@127.0.0.1:{port}/accounts"
    with pytest.raises(StoreError) as info:  # refused at once; a silent network: connect_timeout (5 s)
        open_postgres(url)
    message = str(info.value)
    assert message.startswith(f"postgresql://gate@127.0.0.1:{port}/accounts: cannot connect:")
    assert "s3cret" not in message and "refused" in message.lower()
    cfg = parse_config(f"store: {{url: '{url}'}}\n", env={})
    with pytest.raises(Misconfigured, match="cannot connect") as checked:
        check_store(cfg)
    assert "s3cret" not in str(checked.value)
    with pytest.raises(Misconfigured, match="cannot connect"):
        open_accounts(cfg)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("store: {url: 'mysql://db/x'}\n", "store.url: must be a postgresql:// URL"),
        (
            "store: {url: 'postgresql://db/x', path: /x.db}\n",
            "store.url: give store.path (an SQLite file) or store.url (a PostgreSQL database), not both",
        ),
    ],
)
def test_bad_store_urls_are_named_by_path(text: str, problem: str) -> None:
    from supervisor.config.load import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_config(text, env={})
    assert problem in info.value.problems


@needs_postgres
def test_config_check_describes_the_database_and_changes_nothing(postgres_url: str) -> None:
    cfg = parse_config(f"store: {{url: '{postgres_url}'}}\n", env={})
    assert check_store(cfg) == f"{display_url(postgres_url)}: an empty database (serve initialises it)"
    assert check_store(cfg) == f"{display_url(postgres_url)}: an empty database (serve initialises it)"
    open_postgres(postgres_url).close()
    assert (
        inspect_postgres(postgres_url) == f"{display_url(postgres_url)}: llamagate store, schema {latest()}"
    )


@needs_postgres
def test_another_applications_database_is_refused_untouched(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO invoices VALUES (7)")
    with pytest.raises(
        StoreError, match=r"not a llamagate store \(no schema_version table; tables: invoices\)"
    ):
        open_postgres(postgres_url)
    with pytest.raises(StoreError, match="not a llamagate store"):
        inspect_postgres(postgres_url)
    with psycopg.connect(postgres_url) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
        ).fetchall()
        assert tables == [("invoices",)]


@needs_postgres
def test_a_database_from_a_newer_llamagate_is_refused(postgres_url: str) -> None:
    open_postgres(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_version (version, name, applied) VALUES (99, '0099_future.sql', 0)")
    with pytest.raises(StoreError, match="schema version 99 was written by a newer llamagate"):
        open_postgres(postgres_url)


@needs_postgres
def test_replicas_starting_at_once_apply_each_migration_once(postgres_url: str) -> None:
    opened: list[PostgresStore] = []
    failed: list[BaseException] = []
    go = threading.Barrier(4)

    def start() -> None:
        go.wait()
        try:
            opened.append(open_postgres(postgres_url))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert failed == [] and len(opened) == 4
        with psycopg.connect(postgres_url) as conn:
            versions = conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
            assert versions == [(v,) for v in range(1, latest() + 1)]
    finally:
        for store in opened:
            store.close()


@needs_postgres
def test_a_key_made_and_revoked_through_one_store_is_seen_by_anothers_view(postgres_url: str) -> None:
    """Two replicas' stores on one database: the second one's poll sees the first one's changes."""
    one, two = open_postgres(postgres_url), open_postgres(postgres_url)
    view = KeyView(two, poll_s=0.05)
    view.start()
    try:
        key, record = issue_key("team", INFERENCE, time.time())
        one.add_key(record)
        wait_until(lambda: view.authenticate(key, time.time()) is not None, "the key in force on the other")
        one.revoke_key(record.key_id, time.time())
        wait_until(lambda: view.authenticate(key, time.time()) is None, "the revocation on the other")
    finally:
        view.close()
        one.close()
        two.close()


@needs_postgres
def test_a_lost_connection_fails_a_write_once_and_no_read(
    postgres_server: Postgres, postgres_url: str
) -> None:
    store = open_postgres(postgres_url)
    name = postgres_url.rsplit("/", 1)[1]

    def end_the_stores_sessions() -> None:
        with psycopg.connect(postgres_server.url(), autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )

    try:
        _, first = issue_key("team", INFERENCE, 1.0)
        store.add_key(first)
        assert store.key_marker() == 1 and store.get_key(first.key_id) is not None  # both connections open
        end_the_stores_sessions()
        _, second = issue_key("team", INFERENCE, 2.0)
        # A write on a dead connection fails once, naming the database (it is not repeated: it may
        # have been committed before the session ended); the next call reconnects.
        try:
            store.add_key(second)
        except StoreError as exc:
            assert str(exc).startswith(store.where)
        if store.get_key(second.key_id) is None:
            store.add_key(second)
        end_the_stores_sessions()
        # A read on a dead connection is made again on a new one within the same call: the poll's
        # connection and the writer's.
        assert store.key_marker() == 2
        assert store.get_key(first.key_id) is not None
        assert {k.key_id for k in store.load_keys()} == {first.key_id, second.key_id}
    finally:
        store.close()


def test_the_sqlite_engine_is_still_the_default(tmp_path: Path) -> None:
    cfg = parse_config(f"store: {{path: {tmp_path / 's.db'}}}\n", env={})
    assert check_store(cfg) == f"{tmp_path / 's.db'}: absent (serve creates it)"
