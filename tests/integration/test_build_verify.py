"""The real thing: the llama-server built from llama-build.lock, verified with a real one-token decode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.artifacts.lock import load_lock
from supervisor.artifacts.receipt import read_receipt

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "llama-build.lock"


def _llamagate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
        cwd=REPO,
        check=False,
    )


@pytest.fixture(scope="module")
def cache_root(llama_server_binary: Path) -> Path:
    """The cache the session's binary came from (``<root>/llama-server/<digest16>/llama-server``)."""
    if not (llama_server_binary.parent / "receipt.json").is_file():
        pytest.skip("LLAMAGATE_TEST_BINARY points at a binary outside llamagate's cache (no receipt)")
    return llama_server_binary.parent.parent.parent


def test_real_build_passes_verify_with_a_smoke_decode(
    llama_server_binary: Path, cache_root: Path, demo_model: Path
) -> None:
    done = _llamagate("verify", "--lock", str(LOCK), "--cache", str(cache_root), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    lock = load_lock(LOCK)
    assert report["ok"] is True
    assert report["binary"] == str(llama_server_binary)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["version"]["found"] == lock.version_line
    assert (
        checks["binary"]["found"] == read_receipt(llama_server_binary.parent / "receipt.json").binary_sha256
    )
    # The default demo model, SmolLM2 135M Instruct Q4_1, by its pinned digest.
    assert checks["model"]["found"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert checks["serve"]["ok"] and "one token decoded" in checks["serve"]["detail"]


def test_text_output_prints_path_and_identity(llama_server_binary: Path, cache_root: Path) -> None:
    done = _llamagate("verify", "--lock", str(LOCK), "--cache", str(cache_root), "--no-serve")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"llama-server: {llama_server_binary}" in done.stdout
    assert "llama.cpp commit: 0c1e57098bba43ac29e6e3b677cdceebdd22334f" in done.stdout


def test_second_build_is_a_cache_hit(llama_server_binary: Path, cache_root: Path) -> None:
    done = _llamagate("build", "--lock", str(LOCK), "--cache", str(cache_root), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["cache_hit"] is True
    assert result["path"] == str(llama_server_binary)


def test_one_byte_changed_in_a_copy_of_the_cache_fails_verify(
    llama_server_binary: Path, cache_root: Path, tmp_path: Path
) -> None:
    install = llama_server_binary.parent
    copy_root = tmp_path / "cache"
    copied = copy_root / "llama-server" / install.name
    shutil.copytree(install, copied)
    target = copied / llama_server_binary.name
    with target.open("r+b") as fh:
        fh.seek(4096)
        byte = fh.read(1)
        fh.seek(4096)
        fh.write(bytes([byte[0] ^ 0xFF]))
    done = _llamagate("verify", "--lock", str(LOCK), "--cache", str(copy_root), "--no-serve")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL  binary" in done.stdout
    assert "verify: FAILED (binary)" in done.stderr
    # The shared cache itself is untouched.
    assert _llamagate("verify", "--lock", str(LOCK), "--cache", str(cache_root), "--no-serve").returncode == 0


def test_demo_model_with_a_wrong_sha256_is_refused(cache_root: Path, demo_model: Path) -> None:
    done = _llamagate(
        "verify", "--lock", str(LOCK), "--cache", str(cache_root), "--no-serve",
        "--model", str(demo_model), "--model-sha256", "0" * 64,
    )  # fmt: skip
    assert done.returncode == 1
    assert "FAIL  model" in done.stdout and "b179c9523d0e6a0f" in done.stdout


def test_sigkill_of_verify_during_the_smoke_decode_leaves_no_child(cache_root: Path, tmp_path: Path) -> None:
    # The smoke test's llama-server must die with `llamagate verify`, as the daemon's child does.
    import psutil

    from tests.integration.conftest import process_gone, wait_until

    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "verify", "--lock", str(LOCK), "--cache", str(cache_root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        children: list[psutil.Process] = []

        def child_started() -> bool:
            children[:] = [
                c for c in psutil.Process(proc.pid).children() if c.name().startswith("llama-server")
            ]
            return bool(children)

        wait_until(child_started, "verify to start llama-server", timeout=120)
        proc.kill()
        proc.wait(30)
        wait_until(lambda: process_gone(children[0].pid), "the smoke child to die with verify")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
