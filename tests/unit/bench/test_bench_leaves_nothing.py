"""A benchmark killed while it runs leaves none of the processes it started: SIGKILL (nothing of it
runs: the kernel ends them, PR_SET_PDEATHSIG) and SIGTERM (handled like Ctrl-C: it stops them itself and
exits 130). ``python -m tests.benchmarks.proxy --phases fake`` starts two Python servers and needs no
model; the same with the real llama-server is in tests/integration/test_bench_tied.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[3]
DEADLINE_S = 60.0


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(pred: object, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    assert callable(pred)
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the bench exited ({proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def servers_of(pid: int) -> list[int]:
    """The bench's children that are its servers (fake llama-server, proxy), by pid."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "tests.fakes.fake_llama" in cmdline or "tests.benchmarks.proxy_server" in cmdline:
            out.append(child.pid)
    return out


def start_bench(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    argv = [sys.executable, "-m", "tests.benchmarks.proxy", "--phases", "fake"]
    argv += ["--requests", "10000000", "--out", str(tmp_path / "proxy.json")]
    # A session of its own: nothing sent to it can reach pytest's process group.
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, cwd=REPO
    )
    try:
        wait_for(lambda: len(servers_of(proc.pid)) == 2, "both servers to run", proc)
    except BaseException:
        # Say why the bench stopped, and leave no pipe open for the garbage collector to report later.
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=DEADLINE_S)
        print(err.decode(errors="replace")[-3000:], file=sys.stderr)
        raise
    return proc, servers_of(proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_bench_leaves_no_server_behind(tmp_path: Path, sig: signal.Signals) -> None:
    proc, servers = start_bench(tmp_path)
    try:
        proc.send_signal(sig)
        rc = proc.wait(DEADLINE_S)
        # SIGTERM is Ctrl-C for a bench: it unwinds, stops what it started and exits 130.
        assert rc == (-signal.SIGKILL if sig is signal.SIGKILL else 130)
        wait_for(lambda: all(gone(pid) for pid in servers), "every server to be gone")
        if sig is signal.SIGTERM:
            assert proc.stderr is not None
            assert "interrupted" in proc.stderr.read().decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in servers:
            if not gone(pid):
                psutil.Process(pid).kill()
        if proc.stderr is not None:
            proc.stderr.close()
