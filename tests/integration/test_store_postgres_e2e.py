"""The key store and the ledger on PostgreSQL (issue 25, item 2) with two real daemons (each with its
real llama-server and model) on one database of a real, private PostgreSQL server: a key made through
one replica's admin route works on the other, a key revoked through one is refused by the other without a
reload, each replica's answers land in the one ledger, and ``llamagate keys`` / ``usage`` work on it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Daemon, DaemonFactory, until_key_status

pytestmark = [pytest.mark.integration, pytest.mark.needs_tool("initdb", "postgres")]

CHAT = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 3,
    "ignore_eos": True,
}


ANSWERED: list[str] = []  # the replicas' base URLs, once per 200: what the ledger must hold


def chat(d: Daemon, key: str) -> int:
    response = httpx.post(
        d.base_url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"}, timeout=60
    )
    if response.status_code == 200:
        ANSWERED.append(d.base_url)
    return response.status_code


def admin(d: Daemon, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(
        method, d.base_url + path, headers={"authorization": f"Bearer {d.admin_key}"}, timeout=30, **kw
    )


def llamagate(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args, "--config", str(d.config_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_keys_made_and_revoked_through_one_replica_are_in_force_on_the_other(
    daemon_factory: DaemonFactory, postgres_url: str
) -> None:
    ANSWERED.clear()
    config = {"store": {"url": postgres_url}, "tenants": [{"name": "default", "max_concurrency": 2}]}
    one = daemon_factory(config)
    two = daemon_factory(config)

    made = admin(two, "POST", "/admin/keys", json={"tenant": "default", "name": "shared"})
    assert made.status_code == 201, made.text
    key, key_id = made.json()["key"], made.json()["id"]
    seen_s = until_key_status(one, key, 200, timeout_s=10.0)  # made on two, in force on one
    assert chat(one, key) == 200 and chat(two, key) == 200

    revoked = admin(one, "DELETE", f"/admin/keys/{key_id}")
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    assert chat(one, key) == 401  # the replica that revoked it: at once
    gone_s = until_key_status(two, key, 401, timeout_s=10.0)  # the other: within its next poll
    assert chat(two, key) == 401
    print(
        f"made on replica 2, in force on 1 after {seen_s:.3f} s; revoked on 1, 401 on 2 after {gone_s:.3f} s"
    )

    # One ledger for both replicas, read by the commands as by an operator.
    def ledger() -> list[dict[str, Any]]:
        done = llamagate(one, "usage", "--by", "key", "--format", "json")
        assert done.returncode == 0, done.stderr
        return [r for r in json.loads(done.stdout)["rows"] if r.get("key_id") == key_id]

    assert {one.base_url, two.base_url} <= set(ANSWERED)  # both replicas answered with the key
    deadline = time.monotonic() + 10
    while (rows := ledger()) == [] or rows[0]["requests"] < len(ANSWERED):
        assert time.monotonic() < deadline, f"the ledger rows of both replicas: {rows}, answered {ANSWERED}"
    # Every answer of 3 tokens, from either replica, in the one ledger.
    assert (rows[0]["requests"], rows[0]["completion_tokens"]) == (len(ANSWERED), 3 * len(ANSWERED))
    listed = llamagate(two, "keys", "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    (row,) = [k for k in json.loads(listed.stdout)["keys"] if k["id"] == key_id]
    assert row["status"] == "revoked"


def test_an_unreachable_database_fails_the_start_naming_it(daemon_factory: DaemonFactory) -> None:
    from supervisor.child.spawn import free_port

    url = f"postgresql://gate:s3cret@127.0.0.1:{free_port()}/accounts"
    d = daemon_factory({"store": {"url": url}}, wait_ready=False)
    assert d.wait_exit(60) == 2
    log = d.log_text()
    assert f"postgresql://gate@127.0.0.1:{url.split(':')[3].split('/')[0]}/accounts: cannot connect" in log
    assert "s3cret" not in log
