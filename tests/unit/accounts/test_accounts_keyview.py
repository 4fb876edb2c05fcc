"""Store keys: made, revoked, rotated, re-budgeted; and the in-memory view the request path reads,
which follows every change, from this process or another, without being told."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.accounts.issue import issue_key, successor
from proxy.accounts.keyview import KeyView
from proxy.accounts.sqlbase import SqlStore
from proxy.accounts.sqlite import SqliteStore, open_store
from proxy.accounts.store import StoreError
from proxy.auth import KeyTable, key_digest
from proxy.settings import BudgetSettings, KeyEntry, Scope
from tests.unit.accounts.conftest import wait_until

REPO = Path(__file__).resolve().parents[3]
INFERENCE: frozenset[Scope] = frozenset({"inference"})


def test_a_key_is_stored_as_its_digest_only(sqlite_store: SqliteStore, store_path: Path) -> None:
    key, record = issue_key("team", INFERENCE, 100.0, name="ci", models=("gemma",))
    store = sqlite_store
    store.add_key(record)
    store.close()
    data = b"".join(p.read_bytes() for p in store_path.parent.iterdir())
    assert key.encode() not in data and key.split("_", 2)[2].encode() not in data  # the secret part, whole
    assert record.digest.encode() in data
    # The same key format and digest as config keys: a config KeyTable accepts it too.
    table = KeyTable([KeyEntry(record.key_id, record.digest, "team", INFERENCE)])
    assert table.authenticate(f"Bearer {key}".encode(), None).key_id == record.key_id
    assert record.digest == key_digest(key)


def test_the_view_answers_like_an_unknown_key_for_revoked_and_expired(store: SqlStore) -> None:
    now = 1_000.0
    live, live_rec = issue_key("a", INFERENCE, now)
    gone, gone_rec = issue_key("a", INFERENCE, now)
    old, old_rec = issue_key("a", INFERENCE, now, expires=now + 60)
    for record in (live_rec, gone_rec, old_rec):
        store.add_key(record)
    store.revoke_key(gone_rec.key_id, now)
    view = KeyView(store)
    assert view.refresh()
    found = view.authenticate(live, now)
    assert found is not None and found.principal.tenant == "a" and found.principal.scopes == INFERENCE
    assert view.authenticate(gone, now) is None
    assert view.authenticate(old, now + 59) is not None
    assert view.authenticate(old, now + 60) is None  # expiry needs no poll: checked at the request
    unknown, _ = issue_key("a", INFERENCE, now)
    assert view.authenticate(unknown, now) is None
    wrong_secret = live[:16] + ("A" if live[16] != "A" else "B") + live[17:]
    assert view.authenticate(wrong_secret, now) is None
    assert view.authenticate("sk-not-ours", now) is None


def test_models_and_budgets_travel_with_the_key(store: SqlStore) -> None:
    key, record = issue_key(
        "a", INFERENCE, 1.0, models=("m1", "m2"), budgets=BudgetSettings(tokens_per_minute=50)
    )
    store.add_key(record)
    view = KeyView(store)
    view.refresh()
    found = view.authenticate(key, 2.0)
    assert found is not None
    assert found.principal.models == ("m1", "m2")  # what the router checks a request's model against
    assert found.budgets == BudgetSettings(tokens_per_minute=50)
    store.set_key_budgets(record.key_id, BudgetSettings(tokens_per_day=9))
    assert view.refresh()
    assert view.authenticate(key, 2.0).budgets == BudgetSettings(tokens_per_day=9)  # type: ignore[union-attr]


def test_rotation_revokes_now_or_after_a_grace(store: SqlStore) -> None:
    now = 5_000.0
    old_key, old = issue_key("a", frozenset({"inference", "admin"}), now, name="svc")
    store.add_key(old)
    new_key, new = successor(old, now)
    store.replace_key(old.key_id, new, now, grace_s=600)
    view = KeyView(store)
    view.refresh()
    assert view.authenticate(new_key, now) is not None
    assert view.authenticate(old_key, now + 599) is not None
    assert view.authenticate(old_key, now + 600) is None
    assert store.get_key(new.key_id) == new
    third_key, third = successor(new, now)
    store.replace_key(new.key_id, third, now)
    view.refresh()
    assert view.authenticate(new_key, now) is None and view.authenticate(third_key, now) is not None
    with pytest.raises(StoreError, match="is revoked: only an active key rotates"):
        store.replace_key(new.key_id, successor(new, now)[1], now)


def test_a_key_id_that_exists_is_refused(store: SqlStore) -> None:
    _, record = issue_key("a", INFERENCE, 1.0)
    store.add_key(record)
    with pytest.raises(StoreError, match=f"a key with id {record.key_id} exists already"):
        store.add_key(record)


def test_the_view_reads_the_keys_only_when_the_marker_moved(store: SqlStore) -> None:
    view = KeyView(store)
    assert view.refresh() and view.reloads == 1
    assert not view.refresh() and view.reloads == 1
    from proxy.accounts.records import Batch, UsageRecord

    # The writer's batches commit too, but do not touch keys: no reload for them.
    store.write(Batch(usage=(UsageRecord("a", "k", "m", "chat", 1, 0, 1, 200, 0.1, 1.0),)))
    assert not view.refresh() and view.reloads == 1
    store.add_key(issue_key("a", INFERENCE, 1.0)[1])
    assert view.refresh() and view.reloads == 2 and len(view) == 1


def test_last_use_is_written_in_batches_not_per_request(store: SqlStore) -> None:
    from proxy.accounts.records import Batch

    _, record = issue_key("a", INFERENCE, 1.0)
    store.add_key(record)
    view = KeyView(store)
    view.refresh()
    for t in (10.0, 20.0, 30.0, 30.5):
        view.touch(record.key_id, t)
    assert store.get_key(record.key_id).last_used is None  # type: ignore[union-attr]
    touches = view.take_touches()
    assert touches == ((record.key_id, 30.0),)  # a use within a second of the last one is not written
    view.touch(record.key_id, 30.7)  # after the writer took them: recorded again
    assert view.take_touches() == ((record.key_id, 30.7),)
    store.write(Batch(last_used=touches))
    assert store.get_key(record.key_id).last_used == 30.0  # type: ignore[union-attr]
    store.write(Batch(last_used=((record.key_id, 25.0),)))  # an older touch never moves it back
    assert store.get_key(record.key_id).last_used == 30.0  # type: ignore[union-attr]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_key_made_and_revoked_by_another_process_is_seen_by_the_poll(
    tmp_path: Path, store_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"store: {{path: {store_path}}}\ntenants: [{{name: team}}]\n")
    daemon = open_store(store_path, daemon=True)
    view = KeyView(daemon)
    view.start()  # from here on only its poll thread reads the store
    try:
        made = _cli("keys", "new", "--tenant", "team", "--config", str(config))
        assert made.returncode == 0, made.stderr
        key = made.stdout.splitlines()[0].split()[-1]
        wait_until(lambda: view.authenticate(key, time.time()) is not None, "the new key")
        seen = time.time()
        record = daemon.get_key(key[3:15])
        assert record is not None
        revoked = _cli("keys", "revoke", record.key_id, "--config", str(config))
        assert revoked.returncode == 0, revoked.stderr
        wait_until(lambda: view.authenticate(key, time.time()) is None, "the revocation")
        gone = time.time()
        after = daemon.get_key(record.key_id)
        assert after is not None and after.revoked is not None
    finally:
        view.close()
        daemon.close()
    # The latency from the command's commit (its record's time) to the view: reported, not asserted.
    print(f"in force {seen - record.created:.3f} s after keys new, {gone - after.revoked:.3f} s after revoke")


def test_a_store_that_cannot_be_read_keeps_the_last_keys(store: SqlStore) -> None:
    class Broken:
        polls = 0

        def key_marker(self) -> int:
            self.polls += 1
            raise StoreError("/x.db: cannot poll for key changes: disk I/O error")

    key, record = issue_key("a", INFERENCE, 1.0)
    store.add_key(record)
    view = KeyView(store, poll_s=0.01)
    view.start()
    broken = Broken()
    view._store = broken  # type: ignore[assignment]
    try:
        wait_until(lambda: broken.polls >= 3, "three failed polls")
        assert view.authenticate(key, 2.0) is not None
        assert view._thread is not None and view._thread.is_alive()
    finally:
        view.close()
