"""``llamagate serve`` under a fake systemd: a datagram socket bound by the test as ``$NOTIFY_SOCKET``.

READY=1 must come only once the child passed the readiness gate and ``/readyz`` says ready; STOPPING=1
when SIGTERM starts the drain; WATCHDOG=1 from the loop while it runs.
"""

from __future__ import annotations

import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.fakes.fake_child import make_fake_binary
from tests.integration.conftest import READY_TIMEOUT_S, Daemon, DaemonFactory

pytestmark = pytest.mark.integration


class FakeSystemd:
    """Receives sd_notify datagrams on an abstract-namespace socket, as systemd's would."""

    def __init__(self) -> None:
        self.name = f"llamagate-test-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.sock.settimeout(0.1)
        self.messages: list[list[str]] = []

    def env(self, watchdog_usec: int = 1_000_000) -> dict[str, str]:
        return {"NOTIFY_SOCKET": "@" + self.name, "WATCHDOG_USEC": str(watchdog_usec)}

    def receive(self) -> list[str] | None:
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        message = data.decode().split("\n")
        self.messages.append(message)
        return message

    def wait_for(
        self,
        pred: Callable[[list[str]], bool],
        what: str,
        daemon: Daemon,
        timeout: float = READY_TIMEOUT_S,
        allow_exit: bool = False,
    ) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.receive()
            if message is not None and pred(message):
                return message
            if message is None and daemon.proc.poll() is not None and not allow_exit:
                pytest.fail(
                    f"daemon exited waiting for {what}; got {self.messages}\n{daemon.log_text()[-3000:]}"
                )
        pytest.fail(f"no {what} within {timeout} s; got {self.messages}\n{daemon.log_text()[-3000:]}")

    def drain(self) -> None:
        while self.receive() is not None:
            pass

    def lines(self) -> list[str]:
        return [line for message in self.messages for line in message]


@pytest.fixture
def systemd() -> Iterator[FakeSystemd]:
    fake = FakeSystemd()
    yield fake
    fake.sock.close()


def test_ready_after_the_gate_then_stopping_on_sigterm(
    daemon_factory: DaemonFactory, systemd: FakeSystemd
) -> None:
    d = daemon_factory(env=systemd.env(), wait_ready=False)
    systemd.wait_for(lambda m: "READY=1" in m, "READY=1", d)
    # The moment systemd hears READY=1, the proxy says ready and the child has passed its gate.
    code, body = d.readyz()
    assert code == 200 and body["ready"] is True and body["state"] == "READY"
    lines = systemd.lines()
    ready_at = lines.index("READY=1")
    assert any(line.startswith("STATUS=STARTING") for line in lines[:ready_at]), lines
    assert lines.count("READY=1") == 1

    # The loop keeps pinging the watchdog (WATCHDOG_USEC=1 s: every 0.5 s).
    before = lines.count("WATCHDOG=1")
    for _ in range(2):
        systemd.wait_for(lambda m: m == ["WATCHDOG=1"], "WATCHDOG=1", d, timeout=30)
    assert systemd.lines().count("WATCHDOG=1") >= before + 2

    # The child never sees the notify socket: only the daemon may speak for the service.
    child_pid = d.child_pid
    assert child_pid is not None
    environ = Path(f"/proc/{child_pid}/environ").read_bytes().split(b"\0")
    assert not any(v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_")) for v in environ)

    d.signal(signal.SIGTERM)
    stopping = systemd.wait_for(lambda m: "STOPPING=1" in m, "STOPPING=1", d, timeout=60, allow_exit=True)
    assert any(line.startswith("STATUS=STOPPING") for line in stopping)
    assert d.wait_exit(60) == 0
    systemd.drain()
    after = systemd.lines()[systemd.lines().index("STOPPING=1") :]
    assert "READY=1" not in after


def test_no_ready_when_the_gate_refuses_the_child(
    daemon_factory: DaemonFactory, systemd: FakeSystemd
) -> None:
    # /health answers 200, but /v1/models reports the wrong per-slot context: the gate must refuse,
    # so systemd must never hear READY=1, however healthy the child looks.
    fake = make_fake_binary(daemon_factory.folder / "fake", "--wrong-ctx")
    overrides = {
        "supervision": {
            "max_restarts": 1,
            "backoff_initial_s": 0.1,
            "backoff_max_s": 0.1,
            "exit_on_failed": True,
        }
    }
    d = daemon_factory(overrides, binary=fake, env=systemd.env(), wait_ready=False)
    assert d.wait_exit(90) == 1
    systemd.drain()
    lines = systemd.lines()
    assert "READY=1" not in lines
    assert any(line.startswith("STATUS=FAILED") for line in lines), lines
    assert "STOPPING=1" in lines
