"""``llamagate bench overload`` end to end, at toy scale: it starts a real llama-server and a real llamagate
from one config, sweeps both, compares, and leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from supervisor.bench.records import read_records
from tests.integration.conftest import process_gone

pytestmark = pytest.mark.integration


def test_overload_compares_both_targets_from_one_config(
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
                    "ctx_per_slot": 1024,
                },
                "supervision": {"memory_headroom_mib": 256, "stop_grace_s": 5},
            }
        )
    )
    out = tmp_path / "overload"
    argv = [sys.executable, "-m", "supervisor", "bench", "overload", "--config", str(config), "--slots", "1"]
    argv += ["--concurrency", "1,2", "--requests", "3", "--warmup", "0", "--max-tokens", "4", "--pause", "0"]
    argv += ["--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    # 0 or 1 is the finding (does the claim hold on this busy machine?); 2 or a traceback is a bug.
    assert done.returncode in (0, 1), done.stderr[-3000:]
    assert "llamagate admitted/submitted" in done.stdout

    sweep = json.loads((out / "sweep.json").read_text())
    assert set(sweep["series"]) == {"llamagate", "llama-server"}
    for name, series in sweep["series"].items():
        assert [p["label"] for p in series["points"]] == ["c=1", "c=2"]
        for p in series["points"]:
            records = read_records(out / p["folder"] / "records.jsonl")
            assert len(records) == p["summary"]["submitted"], name
            assert p["summary"]["completed"] == 3, name  # the budget counts admitted requests
            assert p["summary"]["failed"] == 0, [r.error for r in records if r.failed]
    gated = {p["label"]: p["summary"] for p in sweep["series"]["llamagate"]["points"]}
    direct = {p["label"]: p["summary"] for p in sweep["series"]["llama-server"]["points"]}
    # One slot, two users: llamagate (no queue) turns the second away; bare llama-server queues it.
    assert gated["c=2"]["rejected"] >= 1
    assert direct["c=2"]["rejected"] == 0 and direct["c=2"]["completed"] == 3

    provenance = json.loads((out / "provenance.json").read_text())
    launched = provenance["launched"]
    served_direct = launched["llama-server"]["identity"]["served"]
    served_gate = launched["llamagate"]["identity"]
    assert served_direct["binary"]["sha256"] == served_gate["binary"]["sha256"]
    assert served_direct["model"]["sha256"] == served_gate["model"]["sha256"] == demo_model_sha256
    assert served_direct["serving"]["slots"] == served_gate["serving"]["slots"] == 1
    assert provenance["overload"]["tenant"] == {"max_concurrency": 1, "max_queue": 0}

    # Everything the command started is gone (a zombie would be reaped by its parent, already gone).
    for pid in (
        launched["llama-server"]["pid"],
        launched["llamagate"]["pid"],
        served_gate["status"]["child_pid"],
    ):
        assert process_gone(pid), f"process {pid} started by the benchmark is still running"
    assert (out / "overload.md").is_file() and (out / "claim.json").is_file()
