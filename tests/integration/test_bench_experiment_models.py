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
    assert "| model | type | file MiB |" in (out / "experiment.md").read_text()
    assert (out / "provenance.json").is_file()


def test_models_experiment_compares_a_derived_type_with_its_source(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str, demo_q8_0: Path
) -> None:
    """Q4_1 (the demo model) and the Q8_0 derived from it: size, memory idle and at its peak under load
    against the budget, speed, the derivation's quality note, a chart, and the load average at both ends."""
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "llama": {"binary": str(llama_server_binary), "threads": 2, "slots": 1, "ctx_per_slot": 1024},
                "supervision": {"memory_headroom_mib": 256},
            }
        )
    )
    out = tmp_path / "models"
    argv = [sys.executable, "-m", "supervisor", "bench", "experiment", "models", "--config", str(config)]
    argv += ["--model", f"{demo_model}={demo_model_sha256}", "--model", str(demo_q8_0)]
    argv += ["--concurrency", "1", "--requests", "2", "--warmup", "0", "--max-tokens", "8", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "experiment.json").read_text())
    q4, q8 = data["points"]
    assert (q4["extra"]["type"], q8["extra"]["type"]) == ("Q4_1", "Q8_0")  # the demo model is Q4_1
    derived = json.loads(demo_q8_0.with_name(demo_q8_0.name + ".derived.json").read_text())
    assert q8["identity"]["model"]["sha256"] == derived["sha256"] and q4["extra"]["derived"] is None
    assert q8["extra"]["derived"]["source"]["sha256"] == demo_model_sha256
    for p in (q4, q8):
        peak = p["extra"]["rss_peak"]
        assert p["summary"]["submitted"] == 2 and p["summary"]["failed"] == 0
        assert p["extra"]["rss_samples"] >= 2 and p["extra"]["rss_idle"]["rss_bytes"] > 0
        assert (
            peak["rss_bytes"] == p["extra"]["rss_peak_bytes"]
            and peak["file_bytes"] > 0
            and peak["anon_bytes"] > 0
        )
        assert p["prompt_tokens_per_s_median"] > 0 and p["decode_tokens_per_s_median"] > 0
        assert set(p["extra"]["load_average"]) == {"start", "end"}
        check = p["extra"]["budget_check"]
        assert check["predicted_bytes"] == p["budget"]["required_bytes"]
        assert check["measured_peak_rss_bytes"] == peak["rss_bytes"]
        # Within 15 %, or the record says by how much it is off and why.
        assert check["within_tolerance"] == (abs(check["off_by_fraction"]) <= 0.15)
        assert check["within_tolerance"] or "off the peak RSS under load" in check["why"]
    md = (out / "experiment.md").read_text()
    assert "| Q8_0 |" in md and "carries Q4_1's quality" in md and "not quality" in md
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert set(json.loads((out / "provenance.json").read_text())["load_average"]) == {"start", "end"}
