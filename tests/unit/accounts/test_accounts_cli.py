"""``llamagate keys`` and ``llamagate usage`` against a real store, as an operator runs them: each test of
what the commands do runs on both engines (``config``: an SQLite file, then a PostgreSQL database); what
is about the file itself takes ``sqlite_config``."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from proxy.accounts.keyview import KeyView
from proxy.accounts.postgres import display_url, open_postgres
from proxy.accounts.records import Batch
from proxy.accounts.sqlbase import SqlStore
from proxy.accounts.sqlite import open_store
from proxy.settings import BudgetSettings
from supervisor.cli import main
from tests.unit.accounts.conftest import ENGINES
from tests.unit.accounts.test_accounts_ledger import T0, record


def write_config(folder: Path, store: str) -> Path:
    path = folder / "config.yaml"
    # The model's digest comes from an unset variable: keys and usage read only store: and tenants:.
    path.write_text(
        "llama:\n  model: {path: m.gguf, sha256: '${LLAMAGATE_TEST_NOT_SET}'}\n"
        "models:\n"
        "  - {name: gemma-3-270m, path: m.gguf, sha256: '${LLAMAGATE_TEST_NOT_SET}'}\n"
        "  - {name: qwen, path: q.gguf, sha256: '${LLAMAGATE_TEST_NOT_SET}'}\n"
        f"store:\n  {store}\n"
        "tenants: [{name: team}, {name: ops}]\n"
    )
    return path


@pytest.fixture
def sqlite_config(tmp_path: Path) -> Path:
    return write_config(tmp_path, "path: state/llamagate.db")


@pytest.fixture(params=ENGINES)
def config(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "postgresql":
        return write_config(tmp_path, f"url: {request.getfixturevalue('postgres_url')}")
    return write_config(tmp_path, "path: state/llamagate.db")


def db(config: Path) -> Path:
    return config.parent / "state" / "llamagate.db"


def _url(config: Path) -> str | None:
    store = yaml.safe_load(config.read_text())["store"]
    return str(store["url"]) if "url" in store else None


def opened(config: Path) -> SqlStore:
    """The store the configuration names, opened as the test's own (beside the commands)."""
    url = _url(config)
    return open_postgres(url) if url is not None else open_store(db(config))


def where(config: Path) -> str:
    url = _url(config)
    return display_url(url) if url is not None else str(db(config))


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


def new_key(capsys: pytest.CaptureFixture[str], config: Path, *extra: str) -> str:
    status, out, err = run(capsys, "keys", "new", "--config", str(config), *extra)
    assert status == 0, err
    return out.splitlines()[0].split()[-1]


def test_keys_new_writes_into_the_store_and_prints_the_key_once(
    capsys: pytest.CaptureFixture[str], config: Path
) -> None:
    before = time.time()
    status, out, _ = run(
        capsys,
        "keys", "new", "--config", str(config), "--tenant", "team", "--admin",
        "--expires", "30d", "--models", "gemma-3-270m,qwen", "--name", "ci runner",
        "--tokens-per-minute", "500", "--requests-per-minute", "20",
    )  # fmt: skip
    assert status == 0
    key = out.splitlines()[0].split()[-1]
    assert out.count(key) == 1 and "digest" not in out
    assert f"Stored in {where(config)} as id {key[3:15]}" in out
    store = opened(config)
    try:
        (record,) = store.list_keys()
        view = KeyView(store)
        view.refresh()
        found = view.authenticate(key, time.time())
    finally:
        store.close()
    assert found is not None and found.principal.scopes == frozenset({"inference", "admin"})
    assert (record.tenant, record.name, record.models) == ("team", "ci runner", ("gemma-3-270m", "qwen"))
    assert record.budgets == BudgetSettings(tokens_per_minute=500, requests_per_minute=20)
    assert record.expires is not None and before + 30 * 86400 <= record.expires <= time.time() + 30 * 86400


def test_without_a_store_keys_new_prints_config_lines_as_before(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text("tenants: [{name: team}]\n")
    status, out, _ = run(capsys, "keys", "new", "--config", str(plain), "--tenant", "team")
    assert status == 0
    (entry,) = yaml.safe_load(out[out.index("  - id:") :])
    assert entry["tenant"] == "team" and entry["digest"].startswith("sha256:")
    assert not (tmp_path / "state").exists()
    status, _, err = run(
        capsys, "keys", "new", "--config", str(plain), "--tenant", "team", "--expires", "1d", "--name", "x"
    )
    assert status == 2 and "--expires, --name: only for keys in a store" in err


def test_a_tenant_the_config_does_not_have_is_refused(
    capsys: pytest.CaptureFixture[str], sqlite_config: Path
) -> None:
    status, _, err = run(capsys, "keys", "new", "--config", str(sqlite_config), "--tenant", "nobody")
    assert status == 2 and "--tenant nobody:" in err and "tenants: team, ops" in err
    assert not db(sqlite_config).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--expires", "soon"), "--expires 'soon': give a duration like 30d"),
        (("--models", ",,"), "--models ',,': model names separated by commas"),
        (("--tokens-per-day", "0"), "--tokens-per-day '0': a whole number >= 1"),
    ],
)
def test_bad_options_are_named(
    capsys: pytest.CaptureFixture[str], sqlite_config: Path, args: tuple[str, ...], message: str
) -> None:
    status, _, err = run(capsys, "keys", "new", "--config", str(sqlite_config), "--tenant", "team", *args)
    assert status == 2 and message in err


def test_keys_list_shows_every_key_never_a_digest(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    first = new_key(capsys, config, "--tenant", "team", "--name", "laptop")
    second = new_key(capsys, config, "--tenant", "ops", "--admin-only")
    assert run(capsys, "keys", "revoke", second[3:15], "--config", str(config))[0] == 0
    status, table, _ = run(capsys, "keys", "list", "--config", str(config))
    assert status == 0
    header, *rows = table.splitlines()
    assert header.split() == [
        "ID",
        "TENANT",
        "SCOPES",
        "NAME",
        "CREATED",
        "(UTC)",
        "EXPIRES",
        "LAST",
        "USED",
        "STATUS",
    ]
    assert len(rows) == 2 and "sha256" not in table and first not in table
    assert any(r.startswith(first[3:15]) and r.endswith("active") and "laptop" in r for r in rows)
    assert any(r.startswith(second[3:15]) and r.endswith("revoked") for r in rows)
    status, text, _ = run(capsys, "keys", "list", "--config", str(config), "--format", "json")
    keys = {k["id"]: k for k in json.loads(text)["keys"]}
    assert keys[second[3:15]]["scopes"] == ["admin"] and keys[second[3:15]]["status"] == "revoked"
    assert all("digest" not in k for k in keys.values())


def test_revoke_and_rotate(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    old = new_key(capsys, config, "--tenant", "team", "--tokens-per-minute", "300")
    status, out, _ = run(capsys, "keys", "rotate", old[3:15], "--config", str(config), "--grace", "1h")
    assert status == 0 and "The old key works until" in out
    new = out.splitlines()[0].split()[-1]
    store = opened(config)
    try:
        view = KeyView(store)
        view.refresh()
        now = time.time()
        assert view.authenticate(old, now) is not None and view.authenticate(old, now + 3601) is None
        rotated = store.get_key(new[3:15])
        assert rotated is not None and rotated.budgets == BudgetSettings(tokens_per_minute=300)
    finally:
        store.close()
    status, out, _ = run(capsys, "keys", "revoke", new[3:15], "--config", str(config))
    assert status == 0 and f"revoked key {new[3:15]} (tenant team)" in out
    status, out, _ = run(capsys, "keys", "revoke", new[3:15], "--config", str(config))
    assert status == 0 and "was already revoked" in out
    assert run(capsys, "keys", "rotate", new[3:15], "--config", str(config))[0] == 2  # revoked: no
    status, _, err = run(capsys, "keys", "revoke", "0123456789ab", "--config", str(config))
    assert status == 2 and "no key with id 0123456789ab" in err
    status, _, err = run(capsys, "keys", "revoke", "lg_secret", "--config", str(config))
    assert status == 2 and "a key id is 12 lowercase hex digits" in err


def test_keys_budget_changes_only_what_it_is_given(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    key = new_key(
        capsys, config, "--tenant", "team", "--tokens-per-minute", "300", "--tokens-per-day", "9000"
    )
    status, out, _ = run(
        capsys, "keys", "budget", key[3:15], "--config", str(config), "--tokens-per-minute", "none",
        "--requests-per-minute", "5",
    )  # fmt: skip
    assert status == 0, out
    store = opened(config)
    try:
        record = store.get_key(key[3:15])
    finally:
        store.close()
    assert record is not None
    assert record.budgets == BudgetSettings(tokens_per_day=9000, requests_per_minute=5)


def test_read_commands_need_a_store_and_never_make_one(
    capsys: pytest.CaptureFixture[str], sqlite_config: Path, tmp_path: Path
) -> None:
    status, _, err = run(capsys, "keys", "list", "--config", str(sqlite_config))
    assert status == 2 and "no store there yet" in err and not db(sqlite_config).exists()
    plain = tmp_path / "plain.yaml"
    plain.write_text("tenants: [{name: team}]\n")
    status, _, err = run(capsys, "usage", "--config", str(plain))
    assert status == 2 and "no store configured (add 'store: {}'" in err


def test_a_corrupt_store_is_exit_2_naming_the_file(
    capsys: pytest.CaptureFixture[str], sqlite_config: Path
) -> None:
    db(sqlite_config).parent.mkdir()
    db(sqlite_config).write_text("not a database")
    status, _, err = run(capsys, "keys", "new", "--config", str(sqlite_config), "--tenant", "team")
    assert status == 2 and f"{db(sqlite_config)}: not an SQLite database" in err
    assert run(capsys, "usage", "--config", str(sqlite_config))[0] == 2


def test_usage_reports_the_ledger_as_json_csv_and_a_table(
    capsys: pytest.CaptureFixture[str], config: Path
) -> None:
    store = opened(config)
    rows = [
        record(1, tenant="team", model="m1", at=T0),
        record(2, tenant="team", model="m2", at=T0 + 100),
        record(3, tenant="ops", model="m1", at=T0 + 7200),
    ]
    store.write(Batch(usage=tuple(rows)))
    store.close()
    status, out, _ = run(capsys, "usage", "--config", str(config), "--format", "json", "--by", "model")
    assert status == 0
    report = json.loads(out)
    assert report["by"] == "model" and report["since"] is None
    assert [(r["tenant"], r["model"], r["requests"]) for r in report["rows"]] == [
        ("ops", "m1", 1),
        ("team", "m1", 1),
        ("team", "m2", 1),
    ]
    team_m1 = report["rows"][1]
    assert team_m1["prompt_tokens"] == rows[0].prompt_tokens
    assert team_m1["cached_tokens"] == rows[0].cached_tokens
    assert team_m1["completion_tokens"] == rows[0].completion_tokens
    assert team_m1["total_tokens"] == rows[0].prompt_tokens + rows[0].completion_tokens
    assert report["total"]["prompt_tokens"] == sum(r.prompt_tokens for r in rows)

    since = "2027-01-15T10:00"  # T0 + 7200 is 2027-01-15T10:00Z
    status, out, _ = run(
        capsys, "usage", "--config", str(config), "--format", "csv", "--by", "hour", "--since", since
    )
    assert status == 0
    assert list(csv.DictReader(io.StringIO(out))) == [
        {
            "tenant": "ops",
            "hour": "2027-01-15T10:00:00Z",
            "requests": "1",
            "errors": "0",
            "prompt_tokens": str(rows[2].prompt_tokens),
            "cached_tokens": str(rows[2].cached_tokens),
            "completion_tokens": str(rows[2].completion_tokens),
            "total_tokens": str(rows[2].prompt_tokens + rows[2].completion_tokens),
        }
    ]
    status, out, _ = run(capsys, "usage", "--config", str(config), "--tenant", "team", "--key", "k1")
    assert status == 0
    header, line, total = out.splitlines()
    assert header.split()[:2] == ["TENANT", "REQUESTS"] and line.split()[:2] == ["team", "1"]
    assert total.startswith("total: 1 requests")
    status, _, err = run(capsys, "usage", "--config", str(config), "--since", "yesterday")
    assert status == 2 and "--since 'yesterday'" in err


# --- hostile values and bad stores (issue 39) --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--expires", "99999999999999999999w"), "--expires '99999999999999999999w': give a duration"),
        (("--expires", "999999999999w"), "at most 100 years"),
        (("--tokens-per-minute", "9223372036854775808"), "at most 1000000000000"),
        (("--requests-per-minute", "-5"), "a whole number >= 1"),
        (("--models", "gpt-4"), "--models 'gpt-4': 'gpt-4' not served here (served: gemma-3-270m, qwen)"),
        (("--name", "two\nlines"), "--name: give text of at most 200 characters, on one line"),
    ],
)
def test_keys_new_refuses_what_the_admin_route_refuses_and_stores_nothing(
    capsys: pytest.CaptureFixture[str], config: Path, args: tuple[str, ...], message: str
) -> None:
    status, _, err = run(capsys, "keys", "new", "--config", str(config), "--tenant", "team", *args)
    assert status == 2 and message in err, err
    assert "Traceback" not in err
    store = opened(config)
    try:
        assert store.list_keys() == []
    finally:
        store.close()


@pytest.mark.parametrize("since", ["9999-12-31T23:59:59-23:59", "99999999999w", "99999999999999999999w"])
def test_usage_since_outside_the_calendar_is_exit_2(
    capsys: pytest.CaptureFixture[str], config: Path, since: str
) -> None:
    new_key(capsys, config, "--tenant", "team")  # a store exists
    status, _, err = run(capsys, "usage", "--config", str(config), "--since", since)
    assert status == 2 and "--since" in err and "Traceback" not in err


def test_usage_filters_are_checked(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    new_key(capsys, config, "--tenant", "team")
    assert run(capsys, "usage", "--config", str(config), "--key", "no pe")[0] == 2
    assert run(capsys, "usage", "--config", str(config), "--tenant", "a b")[0] == 2


def test_keys_list_shows_a_row_outside_the_calendar(capsys: pytest.CaptureFixture[str], config: Path) -> None:
    from proxy.accounts.issue import issue_key

    _, record = issue_key("team", frozenset({"inference"}), time.time(), expires=1e20)
    store = opened(config)
    try:
        store.add_key(record)
    finally:
        store.close()
    status, out, err = run(capsys, "keys", "list", "--config", str(config), "--format", "json")
    assert status == 0, err
    (row,) = json.loads(out)["keys"]
    assert row["expires"].startswith("invalid (")
    assert run(capsys, "keys", "list", "--config", str(config))[0] == 0
    assert run(capsys, "keys", "revoke", record.key_id, "--config", str(config))[0] == 0


@pytest.mark.parametrize("cut", ["100 bytes", "half"])
def test_a_truncated_store_is_exit_2_from_usage_and_keys_naming_the_file(
    capsys: pytest.CaptureFixture[str], sqlite_config: Path, cut: str
) -> None:
    """A real store cut short (a disk that filled during a copy): a raw sqlite3.DatabaseError with exit 1
    before; now the file and the problem, exit 2, as ``config check`` says it (``serve`` opens it the
    same way: tests/integration/test_accounts_e2e.py)."""
    new_key(capsys, sqlite_config, "--tenant", "team")
    store = opened(sqlite_config)
    try:
        store.write(Batch(usage=tuple(record(i, at=T0 + i) for i in range(2000))))
    finally:
        store.close()
    path = db(sqlite_config)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(100 if cut == "100 bytes" else size // 2)
    for argv in (["usage"], ["keys", "list"], ["keys", "new", "--tenant", "team"]):
        status, _, err = run(capsys, *argv, "--config", str(sqlite_config))
        assert status == 2 and f"{path}: corrupt" in err, (argv, err)
        assert "Traceback" not in err


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root (CI runs as root)")
def test_usage_reads_a_store_on_a_full_filesystem(sqlite_config: Path, tmp_path: Path) -> None:
    """``llamagate usage`` only reads: on a filesystem with no byte left it still answers (it failed with
    "cannot apply the schema" while the running daemon's /admin/usage answered). In a private mount
    namespace (gone with the process): a 4 MiB tmpfs holds the store, kept open by a daemon-like holder
    as ``serve`` keeps it, then filled to its last byte."""
    folder = tmp_path / "full"
    folder.mkdir()
    store_path = folder / "state" / "llamagate.db"
    config = tmp_path / "full.yaml"
    config.write_text(sqlite_config.read_text().replace("state/llamagate.db", str(store_path)))
    holder = (
        "import sys, time\n"
        "from proxy.accounts.sqlite import open_store\n"
        "from proxy.accounts.records import Batch\n"
        "from tests.unit.accounts.test_accounts_ledger import T0, record\n"
        f"store = open_store({str(store_path)!r}, daemon=True)\n"
        "store.write(Batch(usage=(record(0, at=T0),)))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    script = f"""
set -e
mount -t tmpfs -o size=4m tmpfs {folder}
mkfifo {tmp_path}/hold
{sys.executable} -c "$HOLDER" < {tmp_path}/hold > {tmp_path}/holder.out &
exec 3> {tmp_path}/hold
until grep -q ready {tmp_path}/holder.out; do sleep 0.05; done
dd if=/dev/zero of={folder}/filler bs=64k 2>/dev/null || true
df -k {folder} | tail -1
{sys.executable} -m supervisor usage --config {config} --format json
exec 3>&-
wait
"""
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
        env={**os.environ, "HOLDER": holder},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    df_line, _, report = done.stdout.partition("\n")
    assert df_line.split()[3] == "0", df_line  # no free block: the filesystem is full
    assert json.loads(report)["total"]["total_tokens"] == 10  # record(0): 10 prompt tokens
