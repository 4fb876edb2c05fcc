"""The daemon fixture: ``llamagate serve --config X`` as a real subprocess on a free port.

    def test_something(daemon_factory):
        d = daemon_factory({"llama": {"slots": 3}})          # waits for /readyz 200
        client = OpenAI(base_url=d.base_url + "/v1", api_key=d.inference_key)
        d.child_pid, d.admin_status(), d.readyz(), d.log_text()
        d.stop()                                               # SIGTERM, returns the exit code

Overrides are deep-merged into a config that already names the real binary and demo model (from the
session fixtures in ``tests/conftest.py``), a free port, and two keys: ``admin_key`` (inference and
admin) and ``inference_key`` (inference only), both for tenant ``default``. ``binary=`` swaps in another
binary, e.g. ``make_fake_binary`` from ``tests/fakes/fake_child.py``. Every daemon still running at the
end of the test is stopped (SIGTERM, then SIGKILL after 30 s).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from supervisor.artifacts.files import sha256_file
from supervisor.child.spawn import free_port
from supervisor.config.keys import ADMIN, new_key_config

READY_TIMEOUT_S = 180.0  # a cold page cache and a busy 2-core machine make the first load slow


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    base_url: str
    port: int
    admin_key: str
    inference_key: str
    config_path: Path
    config: dict[str, Any]
    log_path: Path
    stdout_path: Path
    _client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0, trust_env=False))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def readyz(self) -> tuple[int, dict[str, Any]]:
        r = self._client.get(f"{self.base_url}/readyz")
        return r.status_code, r.json()

    def admin_identity(self) -> dict[str, Any]:
        r = self._client.get(
            f"{self.base_url}/admin/identity", headers={"Authorization": f"Bearer {self.admin_key}"}
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def admin_status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.admin_identity()["status"]
        return status

    @property
    def child_pid(self) -> int | None:
        pid = self.admin_status().get("child_pid")
        return int(pid) if pid is not None else None

    @property
    def child_port(self) -> int | None:
        port = self.admin_status().get("child_port")
        return int(port) if port is not None else None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_for(
        self, pred: Callable[[int, dict[str, Any]], bool], what: str, timeout: float = READY_TIMEOUT_S
    ) -> dict[str, Any]:
        """Poll /readyz until ``pred(status_code, body)``; fail with the log tail on deadline or exit."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"daemon exited ({self.proc.returncode}) waiting for {what}:\n{self.log_text()[-4000:]}"
                )
            try:
                code, body = self.readyz()
                last = (code, body)
                if pred(code, body):
                    return body
            except (httpx.HTTPError, ValueError) as exc:
                last = exc
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}; last /readyz: {last}\n{self.log_text()[-4000:]}")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        return self.wait_for(lambda code, body: code == 200 and body.get("ready") is True, "READY", timeout)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"daemon did not exit within {timeout} s:\n{self.log_text()[-4000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def write_config(self, overrides: Mapping[str, Any]) -> None:
        """Change the config file (deep merge); send SIGHUP to apply it."""
        self.config = deep_merge(self.config, overrides)
        self.config_path.write_text(yaml.safe_dump(self.config))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._client.close()


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def process_gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


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
                "model": {"path": str(self.model), "sha256": self.model_sha256, "alias": "gemma-3-270m"},
                "threads": 2,
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
        n = len(self.daemons)
        folder = self.folder / f"daemon{n}"
        folder.mkdir(parents=True)
        port = free_port()
        admin_key, admin = new_key_config("default", ADMIN)
        inference_key, inference = new_key_config("default")
        config = deep_merge(self.base_config(port, admin, inference, binary or self.binary), overrides or {})
        config_path = folder / "llamagate.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log_path, stdout_path = folder / "daemon.log", folder / "stdout.txt"
        argv = [
            sys.executable,
            "-m",
            "supervisor",
            "--log-format",
            "json",
            "serve",
            "--config",
            str(config_path),
        ]
        with log_path.open("wb") as log_fh, stdout_path.open("wb") as out_fh:
            proc = subprocess.Popen(
                argv,
                stdout=out_fh,
                stderr=log_fh,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=new_session,
            )
        daemon = Daemon(
            proc,
            f"http://127.0.0.1:{port}",
            port,
            admin_key,
            inference_key,
            config_path,
            config,
            log_path,
            stdout_path,
        )
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
