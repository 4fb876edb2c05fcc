"""Two builders of the same lock at once: one builds, the other waits on the flock and gets a hit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fakes.toolchain import FakeProject, fake_project

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from pathlib import Path
from supervisor.artifacts.build import ensure_binary
from supervisor.progress import ConsoleProgress
got = ensure_binary(Path(sys.argv[1]), cache=Path(sys.argv[2]), progress=ConsoleProgress(tty=False))
print(json.dumps({"path": str(got.path), "cache_hit": got.cache_hit, "sha": got.receipt.binary_sha256}))
"""


def _wait_for(what: str, cond: Callable[[], bool], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_two_concurrent_builds_do_not_collide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    proj: FakeProject = fake_project(tmp_path, monkeypatch)
    gate, started, runs = tmp_path / "gate", tmp_path / "started", tmp_path / "runs"
    env = dict(os.environ)
    env.update(
        FAKE_CMAKE_GATE=str(gate),
        FAKE_CMAKE_STARTED=str(started),
        FAKE_CMAKE_RUNS=str(runs),
        PYTHONPATH=str(REPO),
    )
    procs: list[subprocess.Popen[str]] = []
    errs = [tmp_path / "a.err", tmp_path / "b.err"]

    def spawn(err: Path) -> subprocess.Popen[str]:
        with err.open("w") as err_fh:
            p = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(proj.lock), str(proj.cache)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err_fh,
                text=True,
            )
        procs.append(p)
        return p

    def cleanup() -> None:
        gate.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()

    request.addfinalizer(cleanup)

    a = spawn(errs[0])
    _wait_for("builder A to reach the compile step", started.exists)
    b = spawn(errs[1])
    _wait_for("builder B to wait on the lock", lambda: "waiting for it" in errs[1].read_text())
    gate.touch()
    out_a, _ = a.communicate(timeout=60)
    out_b, _ = b.communicate(timeout=60)
    assert a.returncode == 0, errs[0].read_text()
    assert b.returncode == 0, errs[1].read_text()
    ra, rb = json.loads(out_a), json.loads(out_b)
    assert ra["cache_hit"] is False and rb["cache_hit"] is True
    assert ra["path"] == rb["path"] and ra["sha"] == rb["sha"]
    assert len(runs.read_text().splitlines()) == 1  # cmake --build ran once
    assert sorted(p.name for p in (proj.cache / "llama-server").glob(".build-*")) == []


def test_sigterm_during_a_build_kills_cmake_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    proj: FakeProject = fake_project(tmp_path, monkeypatch)
    gate, started = tmp_path / "gate", tmp_path / "started"
    env = dict(os.environ, FAKE_CMAKE_GATE=str(gate), FAKE_CMAKE_STARTED=str(started), PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "build", "--lock", str(proj.lock), "--cache", str(proj.cache)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def cleanup() -> None:
        gate.touch()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()

    request.addfinalizer(cleanup)
    _wait_for("the compile step", lambda: started.exists() and started.read_text() != "")
    cmake_pid = int(started.read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    with pytest.raises(ProcessLookupError):
        os.kill(cmake_pid, 0)  # the fake cmake (a grandchild in its own group) is gone, and reaped
    assert list((proj.cache / "llama-server").glob(".build-*")) == []
    assert [p.name for p in (proj.cache / "llama-server").iterdir() if p.is_dir()] == []
