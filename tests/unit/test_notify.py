"""sd_notify protocol: real datagram sockets bound by the test, no systemd needed."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.daemon.notify import (
    Notifier,
    SystemdReporter,
    WatchdogFeeder,
    attach,
    socket_address,
    watchdog_interval,
)


class Listener:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)

    def messages(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return out


@pytest.fixture
def path_listener() -> Iterator[tuple[Listener, Notifier]]:
    # Short directory of our own: AF_UNIX paths are limited to 108 bytes, pytest's tmp_path can exceed it.
    with tempfile.TemporaryDirectory(prefix="lgn") as d:
        path = str(Path(d) / "notify")
        listener = Listener(path)
        notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
        yield listener, notifier
        notifier.close()
        listener.sock.close()


def test_address_forms() -> None:
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@abstract/name") == "\0abstract/name"
    assert socket_address("relative/path") is None
    assert socket_address("@") is None
    assert socket_address("vsock:2:1234") is None


def test_no_socket_is_a_silent_no_op() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert notifier.ready("x") is False
    assert WatchdogFeeder.from_env(notifier, {"WATCHDOG_USEC": "1000000"}) is None


def test_path_socket_receives_ready_with_status(path_listener: tuple[Listener, Notifier]) -> None:
    listener, notifier = path_listener
    assert notifier.ready("READY: serving\nmodel") is True
    assert notifier.stopping() is True
    assert notifier.mainpid(4242) is True
    assert notifier.extend_timeout(1.5) is True
    # The newline inside the status text must not start a bogus KEY= line.
    assert listener.messages() == [
        "READY=1\nSTATUS=READY: serving model",
        "STOPPING=1",
        "MAINPID=4242",
        "EXTEND_TIMEOUT_USEC=1500000",
    ]


def test_abstract_namespace_socket() -> None:
    name = f"llamagate-test-{secrets.token_hex(8)}"
    listener = Listener("\0" + name)
    try:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.watchdog() is True
        assert notifier.status("STARTING: loading model") is True
        notifier.close()
        assert listener.messages() == ["WATCHDOG=1", "STATUS=STARTING: loading model"]
    finally:
        listener.sock.close()


def test_missing_socket_warns_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    with tempfile.TemporaryDirectory(prefix="lgn") as d:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": str(Path(d) / "gone")})
        with caplog.at_level(logging.WARNING, logger="llamagate.notify"):
            assert notifier.watchdog() is False
            assert notifier.watchdog() is False
        notifier.close()
    assert [r.getMessage() for r in caplog.records] == ["systemd notification failed"]


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    # WATCHDOG_PID names the process the watchdog is for; an inherited one is not ours.
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(mine) == 1.0
    assert watchdog_interval({**mine, "WATCHDOG_PID": str(os.getpid() + 1)}) is None


def test_feeder_pings_at_the_interval_with_injected_clock(path_listener: tuple[Listener, Notifier]) -> None:
    listener, notifier = path_listener
    feeder = WatchdogFeeder.from_env(notifier, {"WATCHDOG_USEC": "20000000"})
    assert feeder is not None and feeder.interval_s == 10.0
    start = 1000.0
    sent_at = [t for t in (0.0, 1.0, 9.9, 10.0, 12.0, 19.99, 20.0, 35.0) if feeder.tick(start + t)]
    assert sent_at == [0.0, 10.0, 20.0, 35.0]
    assert listener.messages() == ["WATCHDOG=1"] * 4
    # The loop uses due_in to cap its sleep so it never oversleeps a ping.
    assert feeder.due_in(start + 40.0) == pytest.approx(5.0)
    assert feeder.due_in(start + 50.0) == 0.0


def test_wedged_loop_stops_feeding(path_listener: tuple[Listener, Notifier]) -> None:
    listener, notifier = path_listener
    feeder = WatchdogFeeder(notifier, interval_s=5.0)
    assert feeder.tick(0.0)
    # No tick for a long time (the loop is stuck): nothing is sent on its own.
    assert listener.messages() == ["WATCHDOG=1"]
    assert feeder.due_in(60.0) == 0.0
    assert listener.messages() == []


def test_reporter_ready_needs_child_gate_and_proxy(path_listener: tuple[Listener, Notifier]) -> None:
    listener, notifier = path_listener
    reporter = SystemdReporter(notifier)
    reporter.on_state_change("STOPPED", "STARTING", "loading model")
    reporter.on_state_change("STARTING", "READY", None)
    assert listener.messages() == ["STATUS=STARTING: loading model", "STATUS=READY"]
    reporter.on_proxy_listening()
    assert listener.messages() == ["READY=1\nSTATUS=READY"]
    # A child restart later changes the status only; the daemon stays started.
    reporter.on_state_change("READY", "BACKOFF", "child exited with status 1")
    reporter.on_state_change("BACKOFF", "STARTING", None)
    reporter.on_state_change("STARTING", "READY", None)
    assert listener.messages() == [
        "STATUS=BACKOFF: child exited with status 1",
        "STATUS=STARTING",
        "STATUS=READY",
    ]
    reporter.on_shutdown("SIGTERM, draining")
    reporter.on_shutdown("again")
    assert listener.messages() == ["STOPPING=1\nSTATUS=STOPPING: SIGTERM, draining"]


def test_reporter_never_claims_ready_after_stopping(path_listener: tuple[Listener, Notifier]) -> None:
    listener, notifier = path_listener
    reporter = SystemdReporter(notifier)
    reporter.on_proxy_listening()
    reporter.on_shutdown()
    reporter.on_state_change("STARTING", "READY", None)
    assert listener.messages() == ["STOPPING=1\nSTATUS=STOPPING: draining", "STATUS=READY"]


def test_reporter_accepts_enum_states(path_listener: tuple[Listener, Notifier]) -> None:
    import enum

    class State(enum.Enum):
        STARTING = "starting"
        READY = "ready"

    listener, notifier = path_listener
    reporter = SystemdReporter(notifier)
    reporter.on_proxy_listening()
    reporter.on_state_change(State.STARTING, State.READY, None)
    assert listener.messages() == ["READY=1\nSTATUS=READY"]


class FakeSupervisor:
    """The two lists ``ChildSupervisor`` offers for observers and loop tick hooks."""

    def __init__(self) -> None:
        self.observers: list[Callable[[Any, Any, str | None], None]] = []
        self.tick_hooks: list[Callable[[float], float | None]] = []


def test_attach_wires_status_and_watchdog_into_the_loop() -> None:
    name = f"llamagate-test-{secrets.token_hex(8)}"
    listener = Listener("\0" + name)
    sup = FakeSupervisor()
    reporter = attach(sup, {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "4000000"})
    try:
        (observer,) = sup.observers
        (hook,) = sup.tick_hooks
        # The loop asks the hook how long it may wait: never longer than the ping interval.
        assert hook(100.0) == 2.0
        assert hook(101.0) == 1.0
        assert hook(102.5) == 2.0
        observer("STARTING", "READY", None)
        reporter.on_proxy_listening()
        reporter.on_shutdown("SIGTERM")
        assert listener.messages() == [
            "WATCHDOG=1",
            "WATCHDOG=1",
            "STATUS=READY",
            "READY=1\nSTATUS=READY",
            "STOPPING=1\nSTATUS=STOPPING: SIGTERM",
        ]
    finally:
        reporter.close()
        listener.sock.close()


def test_attach_without_systemd_adds_no_watchdog() -> None:
    sup = FakeSupervisor()
    reporter = attach(sup, {"WATCHDOG_USEC": "4000000"})
    assert sup.tick_hooks == [] and len(sup.observers) == 1
    reporter.on_proxy_listening()
    reporter.on_shutdown()
    reporter.close()


def test_a_sighup_reload_is_reloading_then_ready_again(path_listener: tuple[Listener, Notifier]) -> None:
    """sd_notify(3): RELOADING=1 with MONOTONIC_USEC when a reload begins, READY=1 when it is done (the
    daemon serves after a rejected reload as well); nothing claims readiness before the first READY."""
    listener, notifier = path_listener
    reporter = SystemdReporter(notifier)
    reporter.on_reload()
    reporter.on_reloaded("applied")
    first, second = listener.messages()
    assert first.startswith("RELOADING=1\nMONOTONIC_USEC=") and second == "STATUS=reload: applied"
    reporter.on_state_change("STARTING", "READY", None)
    reporter.on_proxy_listening()
    listener.messages()
    reporter.on_reload()
    reporter.on_reloaded("reload rejected: no room")
    reloading, ready = listener.messages()
    lines = reloading.split("\n")
    assert lines[0] == "RELOADING=1" and int(lines[1].removeprefix("MONOTONIC_USEC=")) > 0
    assert ready == "READY=1\nSTATUS=reload: reload rejected: no room"
    reporter.on_shutdown()
    listener.messages()
    reporter.on_reload()
    reporter.on_reloaded("applied")
    assert listener.messages() == []
