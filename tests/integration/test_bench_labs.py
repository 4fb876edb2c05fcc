"""The labs against the real parts, at toy scale: ``model quantize`` with the lock's real llama-quantize
on the demo model, and ``bench experiment kv-reuse`` against the real llama-server (run to the end, and
killed while it serves: SIGTERM and SIGKILL leave no llama-server)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from supervisor.artifacts.files import sha256_fresh
from supervisor.artifacts.quantize import file_type
from supervisor.budget.gguf_info import read_shape
from tests.integration.conftest import process_gone
from tests.integration.test_bench_tied import (
    DEADLINE_S,
    SIGNALS,
    Bench,
    healthy,
    killed,
    no_llama_server_on,
    port_of,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def config(tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str) -> Path:
    path = tmp_path / "cfg.yaml"
    llama = {
        "binary": str(llama_server_binary),
        "model": {"path": str(demo_model), "sha256": demo_model_sha256},
        "threads": 2,
    }
    path.write_text(yaml.safe_dump({"llama": llama, "supervision": {"memory_headroom_mib": 256}}))
    return path


@pytest.fixture
def bench() -> Iterator[Bench]:
    b = Bench()
    try:
        yield b
    finally:
        b.close()


def test_model_quantize_derives_a_real_q5_k_m_of_the_demo_model(
    tmp_path: Path, llama_quantize_binary: Path, demo_model: Path, demo_model_sha256: str
) -> None:
    out = tmp_path / "demo-q5_k_m.gguf"
    argv = [sys.executable, "-m", "supervisor", "model", "quantize", str(demo_model), "--type", "Q5_K_M"]
    done = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "demo-q5_k_m.gguf.derived.json").read_text())
    # The real tool made a real file of the asked type, of the same model, recorded by its sha256.
    assert file_type(out) == "Q5_K_M" and read_shape(out) == read_shape(demo_model)
    assert record["sha256"] == sha256_fresh(out) and f"sha256: {record['sha256']}" in done.stdout
    assert record["source"] == {"path": str(demo_model), "sha256": demo_model_sha256, "type": "Q4_1"}
    assert record["llama_quantize"]["binary_sha256"] == sha256_fresh(llama_quantize_binary)
    assert "--allow-requantize" in record["llama_quantize"]["argv"]
    assert "carries Q4_1's quality, not Q5_K_M's" in done.stdout
    again = subprocess.run([*argv, "--out", str(out), "--json"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and json.loads(again.stdout)["cache_hit"] is True


def test_kv_reuse_reuses_in_one_request_and_recomputes_the_whole_text_otherwise(
    tmp_path: Path, config: Path, demo_model_sha256: str
) -> None:
    out = tmp_path / "kv"
    argv = [sys.executable, "-m", "supervisor", "bench", "experiment", "kv-reuse", "--tokens", "4,8,16"]
    done = subprocess.run(
        [*argv, "--config", str(config), "--out", str(out)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "kv-reuse.json").read_text())
    p = data["prompt_tokens"]
    answers = {(a["way"], a["n"]): a for a in data["answers"]}
    assert len(answers) == 6
    reused, recomputed = answers[("reused", 16)], answers[("recomputed", 16)]
    # llama-server's own counts: one pass over the prompt then 16 decodes, against 16 passes over the
    # whole text so far with nothing taken from its cache.
    assert reused["requests"] == 1 and reused["tokens_evaluated"] == p + 16
    assert recomputed["requests"] == 16 and recomputed["tokens_from_cache"] == 0
    assert recomputed["tokens_evaluated"] == sum(p + k + 1 for k in range(16))
    assert len(recomputed["step_ms"]) == 16
    assert all(a["cpu_seconds"] is not None and a["cpu_seconds"] >= 0 for a in answers.values())
    assert set(data["first_difference_step"]) == {"4", "8", "16"}
    # The work is exact on any host: linear with the cache, quadratic without.
    work = data["growth"]["tokens_evaluated"]
    assert (work["reused"]["verdict"], work["recomputed"]["verdict"]) == ("linear", "quadratic")
    for metric in ("seconds", "cpu_seconds"):
        for way in ("reused", "recomputed"):
            assert isinstance(data["growth"][metric][way]["loglog_exponent"], float)
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert "| recomputed |" in (out / "kv-reuse.md").read_text()
    provenance = json.loads((out / "provenance.json").read_text())
    served = provenance["launched"]["identity"]["served"]
    assert served["model"]["sha256"] == demo_model_sha256 and len(served["binary"]["sha256"]) == 64
    assert served["serving"]["slots"] == 1
    assert set(provenance["load_average"]) == {"start", "end"}


@SIGNALS
def test_a_killed_kv_reuse_leaves_no_llama_server(
    tmp_path: Path, config: Path, bench: Bench, sig: signal.Signals
) -> None:
    # N = 2000 recomputed takes far longer than the test: the server is still serving when it is killed.
    proc = bench.start(
        "supervisor",
        "bench",
        "experiment",
        "kv-reuse",
        "--tokens",
        "2000",
        "--config",
        str(config),
        "--out",
        str(tmp_path / "o"),
    )
    server = bench.server(proc)
    port = port_of(server)
    deadline = time.monotonic() + DEADLINE_S
    while not healthy(port):
        assert proc.poll() is None and time.monotonic() < deadline, "its llama-server never served"
        time.sleep(0.1)
    killed(proc, sig)
    deadline = time.monotonic() + DEADLINE_S
    while not (process_gone(server.pid) and no_llama_server_on(port)):
        assert time.monotonic() < deadline, "a llama-server outlived the kv-reuse experiment"
        time.sleep(0.1)
