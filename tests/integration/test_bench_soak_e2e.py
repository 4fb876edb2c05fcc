"""``llamagate bench soak`` end to end, short: a real daemon with the real child, half a minute of load with
the chaos steps scaled down. Asserts the books, not the durations: every request accounted for, none hung,
the gauges back to 0, every chaos step done, and nothing the command started left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from proxy.auth import KEY_PREFIX
from tests.integration.conftest import process_gone

pytestmark = pytest.mark.integration


def test_a_short_soak_accounts_for_every_request(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str
) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "llama": {
                    "binary": str(llama_server_binary),
                    "model": {"path": str(demo_model), "sha256": demo_model_sha256},
                    "threads": 2,
                    "slots": 2,
                    "ctx_per_slot": 1024,
                },
                "supervision": {"memory_headroom_mib": 256, "stop_grace_s": 5, "backoff_initial_s": 0.5},
            }
        )
    )
    out = tmp_path / "soak"
    argv = [sys.executable, "-m", "supervisor", "bench", "soak", "--config", str(config), "--minutes", "0.5"]
    argv += ["--stop-seconds", "3", "--max-tokens", "8", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    # 0 or 1 is the finding (all targets met on this busy machine?); 2 or a traceback is a bug.
    assert done.returncode in (0, 1), done.stderr[-3000:]
    assert "soak:" in done.stdout and (out / "summary.txt").is_file()

    result = json.loads((out / "soak.json").read_text())
    targets = {t["name"]: t for t in result["targets"]}
    requests = result["requests"]
    assert requests["started"] > 0 and requests["lost"] == 0
    assert targets["every request accounted for"]["met"], targets
    assert targets["no request hung"]["met"], requests
    assert targets["gauges back to 0"]["met"], result["gauges_at_end"]
    assert requests["endings"].get("completed", 0) >= 1
    assert result["concurrency"] == 4  # twice the two slots
    assert [c["action"] for c in result["chaos"]] == ["sighup", "sigkill", "sighup", "sigstop", "sighup"]
    assert all(c.get("child_pid") for c in result["chaos"] if c["action"] != "sighup")
    assert result["daemon_exit_code"] == 0
    identity = result["provenance"]["launched"]["llamagate"]
    assert identity["model"]["sha256"] == demo_model_sha256
    assert result["final_child_pid"] is not None
    for pid in (result["daemon_pid"], identity["status"]["child_pid"], result["final_child_pid"]):
        assert process_gone(pid), f"process {pid} started by the benchmark is still running"
    for path in out.rglob("*"):  # no key in the results (the config holds digests only)
        if path.is_file():
            assert KEY_PREFIX not in path.read_text(errors="replace"), path
