"""The usage ledger: charged without touching the disk, written in batches, rolled up per hour, flushed
at the drain, durable across a restart and a SIGKILL, and honest about a full disk."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from proxy.accounts.ledger import Ledger
from proxy.accounts.records import Batch, UsageRecord
from proxy.accounts.sqlbase import SqlStore
from proxy.accounts.sqlite import ROWS_PER_STATEMENT, _rows_sql, open_store, statement_sizes
from proxy.accounts.writer import Retention, StoreWriter
from tests.unit.accounts.conftest import wait_until

REPO = Path(__file__).resolve().parents[3]
HOUR = 3600.0
T0 = 1_800_000_000.0  # an hour boundary (1_800_000_000 = 500_000 * 3600)


def record(i: int, *, tenant: str = "a", model: str = "m", at: float = T0, status: int = 200) -> UsageRecord:
    return UsageRecord(
        tenant=tenant,
        key_id=f"k{i % 3}",
        model=model,
        kind="chat",
        prompt_tokens=10 + i,
        cached_tokens=i % 5,
        completion_tokens=2 * i,
        status=status,
        duration_s=0.5,
        at=at,
        request_id=f"r{i}",
    )


def test_charge_never_writes_the_writer_does_in_batches(store: SqlStore) -> None:
    ledger = Ledger(batch_size=100)
    writer = StoreWriter(store, ledger, interval_s=3600)  # only a full batch wakes it
    writer.start()
    try:
        for i in range(99):
            ledger.charge(record(i))
        assert store.usage_records() == []  # not a write per request
        ledger.charge(record(99))  # the 100th: a full batch
        wait_until(lambda: len(store.usage_records()) == 100, "the full batch written")
        assert ledger.stats().written == 100 and ledger.pending == 0
    finally:
        writer.close()


def test_the_writer_writes_on_its_interval_and_flush_writes_the_rest(store: SqlStore) -> None:
    ledger = Ledger(batch_size=1000)
    writer = StoreWriter(store, ledger, interval_s=0.05)
    writer.start()
    try:
        ledger.charge(record(1))
        wait_until(lambda: len(store.usage_records()) == 1, "a lone record written by the interval")
    finally:
        writer.close()
    ledger.charge(record(2))
    assert writer.flush(5.0)
    assert [r.request_id for r in store.usage_records()] == ["r1", "r2"]


def test_the_hourly_rollup_and_the_report_groups(store: SqlStore) -> None:
    rows = [
        record(1, tenant="a", model="m1", at=T0 + 10),
        record(2, tenant="a", model="m2", at=T0 + 20, status=429),
        record(3, tenant="a", model="m1", at=T0 + HOUR + 5),
        record(4, tenant="b", model="m1", at=T0 + 25 * HOUR),
    ]
    store.write(Batch(usage=tuple(rows[:2])))
    store.write(Batch(usage=tuple(rows[2:])))  # the rollup adds up across batches
    by_tenant = {r.tenant: r for r in store.usage()}
    a = [r for r in rows if r.tenant == "a"]
    assert by_tenant["a"].requests == 3 and by_tenant["a"].errors == 1
    assert by_tenant["a"].prompt_tokens == sum(r.prompt_tokens for r in a)
    assert by_tenant["a"].cached_tokens == sum(r.cached_tokens for r in a)
    assert by_tenant["a"].completion_tokens == sum(r.completion_tokens for r in a)
    assert [(r.tenant, r.model, r.requests) for r in store.usage(by="model")] == [
        ("a", "m1", 2),
        ("a", "m2", 1),
        ("b", "m1", 1),
    ]
    assert [(r.period, r.requests) for r in store.usage(by="hour", tenant="a")] == [
        (int(T0), 2),
        (int(T0 + HOUR), 1),
    ]
    assert [(r.tenant, r.period) for r in store.usage(by="day")] == [
        ("a", int(T0 // 86400 * 86400)),
        ("b", int((T0 + 25 * HOUR) // 86400 * 86400)),
    ]
    assert {r.key_id for r in store.usage(by="key", tenant="a")} == {"k0", "k1", "k2"}
    assert [r.requests for r in store.usage(since=T0 + HOUR + 1800)] == [1, 1]  # from its hour's start
    assert [(r.tenant, r.requests) for r in store.usage(key_id="k1")] == [("a", 1), ("b", 1)]


def test_a_batch_larger_than_one_statement_is_written_whole(store: SqlStore) -> None:
    """SQLite writes a batch in statements of ``ROWS_PER_STATEMENT`` rows (its parameter limit): a batch
    of two and a bit statements, and a rollup of more groups than one statement holds, lose nothing."""
    count = 2 * ROWS_PER_STATEMENT + 7
    rows = [record(i, model=f"m{i % 700}", at=T0 + i) for i in range(count)]
    store.write(Batch(usage=tuple(rows)))
    assert sorted(r.request_id for r in store.usage_records()) == sorted(r.request_id for r in rows)
    by_model = store.usage(by="model")
    assert len(by_model) == 700 and sum(r.requests for r in by_model) == count
    assert sum(r.completion_tokens for r in by_model) == sum(r.completion_tokens for r in rows)
    store.write(Batch(usage=tuple(rows[:3])))  # the rollup's upsert adds to the groups it finds
    assert sum(r.requests for r in store.usage(by="model")) == count + 3


def test_batches_of_any_size_are_written_whole_from_a_few_statement_texts(tmp_path: Path) -> None:
    """SQLite's batches are statements of ``ROWS_PER_STATEMENT`` rows and of powers of two for the rest:
    batches of every size from 1 to past two statements are written whole, from at most ten statement
    texts per table (each prepared once, then taken from the statement cache: a text of the rest's own
    size would be parsed again for nearly every batch)."""
    store = open_store(tmp_path / "llamagate.db")
    try:
        _rows_sql.cache_clear()
        sizes = [*range(1, 70), *range(ROWS_PER_STATEMENT - 40, 2 * ROWS_PER_STATEMENT + 40, 7)]
        start = 0
        for size in sizes:
            store.write(Batch(usage=tuple(record(i, at=T0 + i) for i in range(start, start + size))))
            start += size
        assert len(store.usage_records()) == start
        assert sum(r.requests for r in store.usage(by="model")) == start
        assert _rows_sql.cache_info().currsize <= 2 * 10  # the ledger's and the rollup's statements
    finally:
        store.close()
    for rows in (0, 1, 7, 255, 256, ROWS_PER_STATEMENT, ROWS_PER_STATEMENT + 1, 3 * ROWS_PER_STATEMENT - 1):
        got = list(statement_sizes(rows))
        assert sum(got) == rows and all(n == ROWS_PER_STATEMENT or n & (n - 1) == 0 for n in got), got


def test_retention_prunes_rows_and_rollups_by_their_own_age(store: SqlStore) -> None:
    day = 86400.0
    store.write(Batch(usage=(record(1, at=T0), record(2, at=T0 + 40 * day))))
    ledger = Ledger()
    now = T0 + 41 * day
    writer = StoreWriter(
        store, ledger, retention=Retention(usage_days=31, rollup_days=400), clock=lambda: now
    )
    assert writer.cycle()  # the first cycle prunes
    assert [r.request_id for r in store.usage_records()] == ["r2"]  # the row is past 31 days
    assert sum(r.requests for r in store.usage()) == 2  # its hour's sum is not past 400 days


def test_what_was_charged_survives_close_and_reopen(store_path: Path) -> None:
    from proxy.accounts.service import Accounts

    accounts = Accounts(open_store(store_path, daemon=True), interval_s=3600)
    accounts.start()
    for i in range(250):
        accounts.record(record(i))
    assert accounts.close()  # the drain: everything pending is written before the store closes
    reopened = open_store(store_path)
    try:
        assert len(reopened.usage_records()) == 250
        assert reopened.usage()[0].completion_tokens == sum(2 * i for i in range(250))
    finally:
        reopened.close()


def test_a_sigkill_loses_nothing_that_was_written(store_path: Path) -> None:
    code = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from proxy.accounts.ledger import Ledger
from proxy.accounts.sqlite import ROWS_PER_STATEMENT, open_store
from proxy.accounts.writer import StoreWriter
from tests.unit.accounts.test_accounts_ledger import record
store = open_store({str(store_path)!r}, daemon=True)
ledger = Ledger(batch_size=50)
writer = StoreWriter(store, ledger, interval_s=3600)
for i in range(120):
    ledger.charge(record(i))
    if i % 50 == 49:
        writer.cycle()  # a batch committed, as the writer thread does
print("written", ledger.stats().written, "pending", ledger.pending, flush=True)
time.sleep(60)
"""
    with subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().split() == ["written", "100", "pending", "20"]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    store = open_store(store_path)
    try:
        # The two committed batches are there; the 20 charged after the last cycle are the lost batch.
        assert [r.request_id for r in store.usage_records()] == [f"r{i}" for i in range(100)]
    finally:
        store.close()


def test_a_full_disk_keeps_charging_counts_and_loses_nothing_written(
    store_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(store_path)
    ledger = Ledger(batch_size=200, max_pending=5000)
    writer = StoreWriter(store, ledger, interval_s=0.02)
    try:
        store.write(Batch(usage=tuple(record(i) for i in range(100))))
        store.limit_pages(store.page_count())  # no room for one more page: SQLITE_FULL, as on a full disk
        with caplog.at_level(logging.WARNING, logger="llamagate.accounts"):
            # A whole batch waits before the writer starts, so its first write is 200 records, which need
            # new pages. Started first, on a loaded host it took the few records charged by its first tick,
            # and those fitted in the last page's free space: written, where the test wants none.
            for i in range(100, 300):
                ledger.charge(record(i))
            writer.start()
            for i in range(300, 2100):
                ledger.charge(record(i))  # the request path: never raises, never waits
            wait_until(lambda: ledger.stats().write_errors >= 3, "failed writes, retried")
            stats = ledger.stats()
            assert stats.pending == 2000 and stats.written == 0 and stats.dropped == 0
            assert stats.unwritten >= 200  # at least the first batch failed; counted once per record
            failures = [r for r in caplog.records if "database or disk is full" in r.getMessage()]
            assert len(failures) == 1  # one line for the episode, not one per retry
            assert len(store.usage_records()) == 100  # nothing already written was lost
            store.limit_pages(1_000_000)  # room again
            wait_until(lambda: ledger.pending == 0, "the backlog written")
        assert any("writes work again" in r.getMessage() for r in caplog.records)
        assert [r.request_id for r in store.usage_records()] == [
            f"r{i}" for i in range(2100)
        ]  # in order, once
        assert ledger.stats().written == 2000
    finally:
        writer.close()
        store.close()


def test_memory_stays_bounded_while_the_store_refuses(caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger(batch_size=10, max_pending=25)
    with caplog.at_level(logging.ERROR, logger="llamagate.accounts"):
        for i in range(40):
            ledger.charge(record(i))
    batch, fresh = ledger.take()
    ledger.failed(batch, fresh)
    stats = ledger.stats()
    assert stats.pending == 25 and stats.dropped == 15 and stats.unwritten == 10
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    again, fresh_again = ledger.take()
    assert again == batch and fresh_again == 0  # a failed batch comes back first, in its order


def test_charge_is_safe_from_many_threads(store: SqlStore) -> None:
    ledger = Ledger(batch_size=64)
    writer = StoreWriter(store, ledger, interval_s=0.01)
    writer.start()
    try:

        def client(n: int) -> None:
            for i in range(500):
                ledger.charge(record(n * 1000 + i))

        threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert writer.flush(10.0)
    finally:
        writer.close()
    assert len(store.usage_records()) == 2000
