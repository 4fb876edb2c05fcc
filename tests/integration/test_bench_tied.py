"""A benchmark (``llamagate bench ...`` or ``python -m tests.benchmarks...``) that is killed while the
real llama-server it started is serving leaves no llama-server behind: SIGKILL (the kernel ends what it
started: PR_SET_PDEATHSIG, also through a private daemon to the daemon's own child) and SIGTERM (handled
like Ctrl-C: it stops what it started and exits 130)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.integration.conftest import process_gone

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 180.0
SIGNALS = pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])


def wait_for(pred: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        if proc.poll() is not None:
            pytest.fail(f"the bench exited ({proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def llama_servers(root: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            # A serving llama-server, not a short check run of the binary (`--version`, `--help`).
            if (
                child.name() == "llama-server"
                and child.status() != psutil.STATUS_ZOMBIE
                and "--port" in child.cmdline()
            ):
                out.append(child)
        except psutil.Error:
            continue
    return out


def port_of(server: psutil.Process) -> int:
    argv = server.cmdline()
    return int(argv[argv.index("--port") + 1])


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def no_llama_server_on(port: int) -> bool:
    """No llama-server anywhere on the machine (orphans included) serves this port."""
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if p.info["name"] == "llama-server" and f"--port {port}" in " ".join(p.info["cmdline"] or []):
                return p.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            continue
    return True


@pytest.fixture
def config(tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str) -> Path:
    path = tmp_path / "cfg.yaml"
    llama = {
        "binary": str(llama_server_binary),
        "model": {"path": str(demo_model), "sha256": demo_model_sha256},
        "threads": 2,
        "slots": 1,
        "ctx_per_slot": 2048,
    }
    path.write_text(yaml.safe_dump({"llama": llama, "supervision": {"memory_headroom_mib": 256}}))
    return path


class Bench:
    """Starts ``python -m MODULE ...``; remembers what it saw started, to clean up after a failed test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.seen: list[psutil.Process] = []

    def start(self, module: str, *args: str) -> subprocess.Popen[bytes]:
        # Its own session: nothing sent to it reaches pytest's process group.
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=REPO,
        )
        self.procs.append(proc)
        return proc

    def server(self, proc: subprocess.Popen[bytes]) -> psutil.Process:
        wait_for(lambda: len(llama_servers(proc.pid)) == 1, "a llama-server to start", proc)
        (server,) = llama_servers(proc.pid)
        parent = server.parent()
        # The server, and the private daemon between the bench and it (never the bench's ancestors).
        self.seen += [server] + ([parent] if parent is not None and parent.pid != proc.pid else [])
        return server

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for p in self.seen:
            with contextlib.suppress(psutil.Error):
                if p.is_running():
                    p.kill()


@pytest.fixture
def bench() -> Iterator[Bench]:
    b = Bench()
    try:
        yield b
    finally:
        b.close()


def killed(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    proc.send_signal(sig)
    rc = proc.wait(DEADLINE_S)
    assert rc == (-signal.SIGKILL if sig is signal.SIGKILL else 130)


@SIGNALS
def test_a_killed_experiment_leaves_no_llama_server(
    tmp_path: Path, config: Path, bench: Bench, sig: signal.Signals
) -> None:
    load = ["--concurrency", "1", "--requests", "100000", "--max-tokens", "16", "--prompts", "shared:256"]
    proc = bench.start(
        "supervisor",
        "bench",
        "experiment",
        "cache-prompt",
        "--config",
        str(config),
        *load,
        "--out",
        str(tmp_path / "o"),
    )
    server = bench.server(proc)
    port = port_of(server)
    wait_for(lambda: healthy(port), "its llama-server to serve", proc)
    killed(proc, sig)
    deadline = time.monotonic() + DEADLINE_S
    while not (process_gone(server.pid) and no_llama_server_on(port)):
        assert time.monotonic() < deadline, "a llama-server outlived the bench that started it"
        time.sleep(0.1)


@SIGNALS
def test_a_killed_bench_with_a_private_daemon_leaves_neither_daemon_nor_llama_server(
    config: Path, bench: Bench, sig: signal.Signals
) -> None:
    proc = bench.start(
        "tests.benchmarks.scrape", "--config", str(config), "--rounds", "1000", "--max-tokens", "8"
    )
    server = bench.server(proc)
    daemon = server.parent()
    assert daemon is not None and daemon.pid != proc.pid  # the bench's child is the daemon, not it
    port = port_of(server)
    wait_for(lambda: healthy(port), "the daemon's llama-server to serve", proc)
    killed(proc, sig)
    deadline = time.monotonic() + DEADLINE_S
    while not (process_gone(daemon.pid) and process_gone(server.pid) and no_llama_server_on(port)):
        assert time.monotonic() < deadline, "the daemon or its llama-server outlived the bench"
        time.sleep(0.1)
