"""The daemon fixture: ``llamagate serve --config X`` as a real subprocess on a free port.

    def test_something(daemon_factory):
        d = daemon_factory({"llama": {"slots": 3}})          # waits for /readyz 200
        client = OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key)
        d.child_pid, d.admin_status(), d.readyz(), d.log_text()
        d.stop()                                               # SIGTERM, returns the exit code

The daemon is the benchmarks' own ``PrivateDaemon`` (``supervisor.bench.launcher``: one launcher of a
private ``llamagate serve``), tied to the test process (it dies with it, even by SIGKILL). Overrides are
deep-merged into a config that already names the real binary and demo model (from the session fixtures
in ``tests/conftest.py``), a free port, and two keys: ``admin_key`` (inference and admin) and
``inference_key`` (inference only), both for tenant ``default``. ``binary=`` swaps in another binary,
e.g. ``make_fake_binary`` from ``tests/fakes/fake_child.py``. Every daemon still running at the end of
the test is stopped (SIGTERM, then SIGKILL after 30 s).
"""

from __future__ import annotations

import functools
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.artifacts.files import sha256_file
from supervisor.bench.launcher import PrivateDaemon, deep_merge
from supervisor.child.spawn import free_port
from supervisor.child.spawn import port_open as port_is_open
from supervisor.config.keys import ADMIN, new_key_config
from supervisor.errors import StartupError

READY_TIMEOUT_S = 180.0  # a cold page cache and a busy 2-core machine make the first load slow

__all__ = [
    "READY_TIMEOUT_S",
    "Daemon",
    "DaemonFactory",
    "key_status",
    "port_is_open",
    "process_gone",
    "until_key_status",
    "wait_until",
]


class Daemon(PrivateDaemon):
    """A private daemon with the two keys of the fixture's config, whose waits fail the test."""

    @property
    def admin_key(self) -> str:
        return self.keys["admin"]

    @property
    def inference_key(self) -> str:
        return self.keys["inference"]

    @functools.cached_property
    def _client(self) -> httpx.Client:
        """For a test that wants a whole response (headers too); closed with the daemon."""
        return httpx.Client(timeout=10.0, trust_env=False)

    def wait_for(
        self, pred: Callable[[int, dict[str, Any]], bool], what: str, timeout: float = READY_TIMEOUT_S
    ) -> dict[str, Any]:
        """Poll /readyz until ``pred(status_code, body)``; fail with the log tail on deadline or exit."""
        try:
            return super().wait_for(pred, what, timeout)
        except StartupError as exc:
            pytest.fail(str(exc))

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        return super().wait_ready(timeout)

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"daemon did not exit within {timeout} s:\n{self.log_text()[-4000:]}")

    def stop(self, grace_s: float = 60.0) -> int:
        """SIGTERM, and the exit code: the test fails when the daemon does not exit within ``grace_s``."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait_exit(grace_s)

    def close(self) -> None:
        super().stop(30.0)
        if "_client" in self.__dict__:
            self._client.close()


def process_gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def key_status(base_url: str, key: str) -> int:
    """``GET /v1/models`` with ``key``: authenticated like every inference route and answered by the proxy
    itself (no slot, no generation), so its status shows at once whether the key is in force there."""
    return httpx.get(
        base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
    ).status_code


def until_key_status(d: Daemon, key: str, status: int, timeout_s: float = 30.0) -> float:
    """Seconds until ``key`` gets ``status`` on ``d`` (``key_status``, asked every 20 ms), or the test
    fails."""
    started = time.monotonic()
    while (got := key_status(d.base_url, key)) != status:
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{d.base_url}: still {got}, not {status}, {timeout_s} s on")
        time.sleep(0.02)
    return time.monotonic() - started


def wait_until(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


class DaemonFactory:
    def __init__(self, folder: Path, binary: Path, model: Path, model_sha256: str) -> None:
        self.folder = folder
        self.binary = binary
        self.model = model
        self.model_sha256 = model_sha256
        self.daemons: list[Daemon] = []

    def base_config(self, port: int, admin: Any, inference: Any, binary: Path) -> dict[str, Any]:
        return {
            "proxy": {"host": "127.0.0.1", "port": port, "drain_timeout_s": 10},
            "llama": {
                "binary": str(binary),
                "model": {
                    "path": str(self.model),
                    "sha256": self.model_sha256,
                    "alias": "smollm2-135m-instruct",
                },
                # One thread per child: the suite runs two workers on two cores, and two children
                # of two OpenMP threads each spin at their barriers waiting for a descheduled peer.
                "threads": 1,
                "slots": 2,
                "ctx_per_slot": 4096,
            },
            "supervision": {"stop_grace_s": 5, "memory_headroom_mib": 256, "backoff_initial_s": 0.5},
            "tenants": [{"name": "default", "max_concurrency": 2, "max_queue": 8}],
            "keys": [admin, inference],
            "logging": {"format": "json", "level": "DEBUG"},
        }

    def __call__(
        self,
        overrides: Mapping[str, Any] | None = None,
        *,
        wait_ready: bool = True,
        binary: Path | None = None,
        env: Mapping[str, str] | None = None,
        new_session: bool = False,
    ) -> Daemon:
        folder = self.folder / f"daemon{len(self.daemons)}"
        folder.mkdir(parents=True)
        admin_key, admin = new_key_config("default", ADMIN)
        inference_key, inference = new_key_config("default")
        base = self.base_config(free_port(), admin, inference, binary or self.binary)
        base["llama"]["state_dir"] = str(folder / "states")  # its own conversation states on disk
        config = deep_merge(base, overrides or {})
        keys = {"admin": admin_key, "inference": inference_key}
        daemon = Daemon.start(config, folder, keys, env=env, new_session=new_session)
        self.daemons.append(daemon)
        if wait_ready:
            daemon.wait_ready()
        return daemon

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.close()


@pytest.fixture(scope="session")
def demo_model_sha256(demo_model: Path) -> str:
    return sha256_file(demo_model)


@pytest.fixture
def daemon_factory(
    tmp_path: Path, llama_server_binary: Path, demo_model: Path, demo_model_sha256: str
) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(tmp_path, llama_server_binary, demo_model, demo_model_sha256)
    try:
        yield factory
    finally:
        factory.close()
