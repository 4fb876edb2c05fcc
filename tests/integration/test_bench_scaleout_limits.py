"""``llamagate bench scaleout --compare limits`` end to end, at toy scale: two replica sets behind the
shipped nginx, one with each replica's own limits and one with the tenant's limit shared through a
redis-server and a PostgreSQL the test starts (tests/helpers/) and passes as ``--redis-url`` and
``--store-url``, as an operator passes theirs; both variants run, the shared set really held its limits
in Redis (its replicas' ``llamagate_cluster_mode`` is ``cluster``, the other set's ``off``), nothing the
command started outlives it, and it left nothing in the two servers: no key in the Redis (beside one of
another tenant's, untouched), no database of its own on the PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import redis
import yaml

from supervisor.child.spawn import popen_tied
from tests.helpers.postgres_server import Postgres
from tests.helpers.redis_server import RedisServer
from tests.integration.conftest import process_gone

pytestmark = [
    pytest.mark.integration,
    pytest.mark.needs_tool("nginx", "nginx-js", "redis-server", "initdb", "postgres"),
]


def _databases(server: Postgres) -> set[str]:
    with psycopg.connect(server.url()) as conn:
        return {row[0] for row in conn.execute("SELECT datname FROM pg_database")}


def test_scaleout_compares_shared_limits_with_per_replica_limits(
    tmp_path: Path,
    llama_server_binary: Path,
    demo_model: Path,
    demo_model_sha256: str,
    redis_server: RedisServer,
    postgres_server: Postgres,
) -> None:
    # Another tenant's lease on the same Redis: the run must neither count it nor delete it.
    other = "llamagate:{bench}:lease:smollm2-135m-instruct"
    with redis.Redis.from_url(redis_server.url) as client:
        client.zadd(other, {"elsewhere#0": 1})
    databases = _databases(postgres_server)
    config = tmp_path / "cfg.yaml"
    llama = {
        "binary": str(llama_server_binary),
        "model": {"path": str(demo_model), "sha256": demo_model_sha256},
    }
    config.write_text(yaml.safe_dump({"llama": llama, "supervision": {"memory_headroom_mib": 256}}))
    out = tmp_path / "scaleout"
    argv = [sys.executable, "-m", "supervisor", "bench", "scaleout", "--compare", "limits", "--config"]
    argv += [str(config), "--replicas", "2", "--duration", "4", "--max-tokens", "4", "--ctx-per-slot", "512"]
    argv += ["--out", str(out), "--redis-url", redis_server.url, "--store-url", postgres_server.url()]
    # Tied to the test: the command's own children are tied to it in turn.
    bench = popen_tied(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=600)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, f"{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "verdict: PASS" in stdout

    report = json.loads((out / "scaleout.json").read_text())
    assert report["compare"] == "limits"
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"per-replica", "shared"}
    assert rows["shared"]["cluster_mode"] == ["cluster", "cluster"]
    assert rows["per-replica"]["cluster_mode"] == ["off", "off"]
    for r in rows.values():
        assert r["completed"] >= 1 and r["failed"] == 0, r
        assert r["submitted"] == r["completed"] + r["rejected"], r

    pids = report["pids"]
    assert set(pids) == {"replicas"} and len(pids["replicas"]) == 4  # it started no server
    for pid in pids["replicas"]:
        assert process_gone(pid), pid

    shared = report["shared_state"]
    tenant = shared["redis_keys"].removeprefix("llamagate:{").removesuffix("}:*")
    assert tenant.startswith("scaleout-") and shared["database"] == "llamagate_" + tenant.replace("-", "_")
    assert shared["left_behind"] == []
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.keys("*") == [other.encode()]
    assert _databases(postgres_server) == databases
