"""``llamagate bench scaleout --compare limits`` end to end, at toy scale: two replica sets behind the
shipped nginx, one with each replica's own limits and one with the tenant's limit shared through the
redis-server and the PostgreSQL the command starts; both variants run, the shared set really held its
limits in Redis (its replicas' ``llamagate_cluster_mode`` is ``cluster``, the other set's ``off``), and
nothing the command started outlives it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from supervisor.child.spawn import popen_tied
from tests.integration.conftest import process_gone

pytestmark = [
    pytest.mark.integration,
    pytest.mark.needs_tool("nginx", "nginx-js", "redis-server", "initdb", "postgres"),
]


def test_scaleout_compares_shared_limits_with_per_replica_limits(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str
) -> None:
    config = tmp_path / "cfg.yaml"
    llama = {
        "binary": str(llama_server_binary),
        "model": {"path": str(demo_model), "sha256": demo_model_sha256},
    }
    config.write_text(yaml.safe_dump({"llama": llama, "supervision": {"memory_headroom_mib": 256}}))
    out = tmp_path / "scaleout"
    argv = [sys.executable, "-m", "supervisor", "bench", "scaleout", "--compare", "limits", "--config"]
    argv += [str(config), "--replicas", "2", "--duration", "4", "--max-tokens", "4", "--ctx-per-slot", "512"]
    argv += ["--out", str(out)]
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
    assert set(pids) == {"redis-server", "postgres", "replicas"} and len(pids["replicas"]) == 4
    for pid in (pids["redis-server"], pids["postgres"], *pids["replicas"]):
        assert process_gone(pid), pid
