"""The accounts store for a test: ``store`` is each engine in turn (a real SQLite file in tmp_path, and a
fresh database on a real, private PostgreSQL server: ``postgres_url`` in tests/conftest.py), so every
test written against the ``Store`` interface runs on both; ``sqlite_store`` is the file only, for tests
of what is SQLite's own. A deadline wait for what another thread or process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.accounts.postgres import open_postgres
from proxy.accounts.sqlbase import SqlStore
from proxy.accounts.sqlite import SqliteStore, open_store

ENGINES = ["sqlite", pytest.param("postgresql", marks=pytest.mark.needs_tool("initdb", "postgres"))]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "llamagate.db"


@pytest.fixture
def sqlite_store(store_path: Path) -> Iterator[SqliteStore]:
    opened = open_store(store_path)
    yield opened
    opened.close()


@pytest.fixture(params=ENGINES)
def store(request: pytest.FixtureRequest, store_path: Path) -> Iterator[SqlStore]:
    opened: SqlStore
    if request.param == "postgresql":
        opened = open_postgres(request.getfixturevalue("postgres_url"))
    else:
        opened = open_store(store_path)
    yield opened
    opened.close()


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> float:
    """Poll until ``predicate`` holds; the seconds it took. Fails with ``what`` at the deadline."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)
    return time.monotonic() - start
