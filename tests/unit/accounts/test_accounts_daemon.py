"""The accounts store in the daemon's life, with fakes for the child (no process, no model): opened from
the config (a bad file is exit 2 naming it, for serve and config check alike), started and closed with
the daemon, its tenant budgets swapped by SIGHUP with the counts kept, and ``store.*`` kept as it is
until the next start."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from proxy.accounts.budgets import Refusal, Ticket
from proxy.accounts.records import UsageRecord
from supervisor.cli import main
from supervisor.config.load import load_config
from supervisor.daemon.service import Daemon
from supervisor.daemon.wiring import DaemonAccounts, open_accounts
from supervisor.errors import Misconfigured
from tests.unit.test_daemon import one_model
from tests.unit.test_process_driver import FakeOs, FakeProbes


def write(path: Path, store: str, tokens_per_minute: int) -> None:
    path.write_text(
        f"store: {{path: {store}}}\n"
        f"tenants: [{{name: default, budgets: {{tokens_per_minute: {tokens_per_minute}}}}}]\n"
    )


def daemon(path: Path) -> Daemon:
    cfg = load_config(path)
    accounts = DaemonAccounts(open_accounts(cfg))
    return Daemon(
        cfg, one_model(cfg), config_path=path, child_os=FakeOs(), probes=FakeProbes(), accounts=accounts
    )


def spend(d: Daemon, tokens: int) -> None:
    accounts = d.accounts.accounts
    assert accounts is not None
    now = time.time()
    ticket = accounts.budgets.check("default", "k", now)
    assert isinstance(ticket, Ticket)
    accounts.budgets.charge(ticket, tokens, now)
    accounts.record(UsageRecord("default", "k", "m", "chat", tokens, 0, 0, 200, 0.1, now))


async def test_sighup_swaps_budgets_keeping_the_counts_and_keeps_the_store_until_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "llamagate.yaml"
    write(path, "a.db", 100)
    d = daemon(path)
    try:
        d.accounts.start()
        accounts = d.accounts.accounts
        assert accounts is not None and accounts.store.where == str(tmp_path / "a.db")
        spend(d, 60)
        assert isinstance(accounts.budgets.check("default", "k", time.time()), Ticket)  # 60 of 100: room

        write(path, "b.db", 50)
        with caplog.at_level(logging.WARNING, logger="llamagate.daemon"):
            await d.reload()
        assert "SIGHUP: store take effect at the next daemon start" in caplog.text
        assert d.cfg.store is not None and str(d.cfg.store.path).endswith("a.db")
        assert d.accounts.accounts is accounts and not (tmp_path / "b.db").exists()
        # The new limit applies at once, to the usage counted before it.
        refused = accounts.budgets.check("default", "k", time.time())
        assert isinstance(refused, Refusal) and refused.limit == 50
    finally:
        await d._close()
    assert d.accounts.accounts is None  # closed with the daemon, its lock given back
    open_accounts(load_config(tmp_path / "llamagate.yaml"))  # b.db: a new start opens the new path


def test_a_store_serve_would_refuse_is_exit_2_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "notes.db"
    bad.write_bytes(b"not a database at all\n")
    path = tmp_path / "llamagate.yaml"
    write(path, str(bad), 100)
    with pytest.raises(Misconfigured, match=rf"^{bad}: not an SQLite database"):
        open_accounts(load_config(path))
    # config check says the same, without changing the file; --offline does not look at the host.
    assert main(["config", "check", "--config", str(path)]) == 2
    assert f"{bad}: not an SQLite database" in capsys.readouterr().out
    assert bad.read_bytes() == b"not a database at all\n"
    assert main(["config", "check", "--offline", "--config", str(path)]) == 0


def test_config_check_describes_a_good_store_and_creates_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "llamagate.yaml"
    write(path, "state/llamagate.db", 100)
    main(["config", "check", "--config", str(path)])
    out = capsys.readouterr().out
    assert f"store: {tmp_path / 'state' / 'llamagate.db'}: absent (serve creates it)" in out
    assert not (tmp_path / "state").exists()


def test_serve_makes_no_temporary_key_when_the_store_holds_an_admin_key(tmp_path: Path) -> None:
    """Keys only in the store, none in the config: an operator who keeps an admin key there needs no
    temporary one (issue 39: serve printed one anyway); with inference keys only, it still makes one."""
    from proxy.accounts.issue import issue_key
    from proxy.accounts.service import Accounts
    from proxy.accounts.sqlite import open_store
    from supervisor.commands.serve import generate_key, store_admin_keys
    from supervisor.config.schema import Config

    accounts = Accounts(open_store(tmp_path / "s.db"), ())
    try:
        held = DaemonAccounts(accounts)
        assert store_admin_keys(held) == 0
        accounts.store.add_key(issue_key("default", frozenset({"inference"}), time.time())[1])
        assert store_admin_keys(held) == 0
        assert generate_key(Config(), store_admin_keys(held)) is not None
        revoked = issue_key("default", frozenset({"inference", "admin"}), time.time())[1]
        accounts.store.add_key(revoked)
        accounts.store.revoke_key(revoked.key_id, time.time())
        assert store_admin_keys(held) == 0  # a revoked admin key is none
        accounts.store.add_key(issue_key("default", frozenset({"admin"}), time.time())[1])
        assert store_admin_keys(held) == 1
        assert generate_key(Config(), store_admin_keys(held)) is None
        assert store_admin_keys(DaemonAccounts(None)) == 0
    finally:
        accounts.close()
