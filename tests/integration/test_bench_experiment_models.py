"""An experiment end to end at toy scale: ``bench experiment models`` starts the real llama-server per
model file, measures it, asks a quality set, and writes its tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration


def test_models_experiment_with_quality_set(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str
) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "llama": {"binary": str(llama_server_binary), "threads": 2, "slots": 1, "ctx_per_slot": 1024},
                "supervision": {"memory_headroom_mib": 256},
            }
        )
    )
    qset = tmp_path / "quality.jsonl"
    # One item any model passes (the check matches everything), one none does: a pass rate of 1/2
    # proves answers are fetched and checked.
    qset.write_text(
        '{"prompt": "Say hi.", "expect_regex": "."}\n{"prompt": "Say hi.", "expect": "zq-never"}\n'
    )
    out = tmp_path / "models"
    argv = [sys.executable, "-m", "supervisor", "bench", "experiment", "models", "--config", str(config)]
    argv += ["--model", f"{demo_model}={demo_model_sha256}", "--quality", str(qset), "--concurrency", "1"]
    argv += ["--requests", "2", "--warmup", "0", "--max-tokens", "4", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "experiment.json").read_text())
    (point,) = data["points"]
    assert point["quality"]["passed"] == 1 and point["quality"]["total"] == 2
    assert point["summary"]["submitted"] == 2 and point["summary"]["failed"] == 0
    assert point["extra"]["file_bytes"] == demo_model.stat().st_size
    assert point["rss_after_bytes"] > 0
    assert point["identity"]["model"]["sha256"] == demo_model_sha256
    assert point["budget"]["kv_bytes"] > 0
    assert "| model | file MiB |" in (out / "experiment.md").read_text()
    assert (out / "provenance.json").is_file()
