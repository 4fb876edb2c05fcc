"""Real SQLite files in tmp_path for the accounts store; a deadline wait for what another thread or
process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.accounts.sqlite import SqliteStore, open_store


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "llamagate.db"


@pytest.fixture
def store(store_path: Path) -> Iterator[SqliteStore]:
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
