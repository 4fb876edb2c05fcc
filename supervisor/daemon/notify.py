"""The systemd notify protocol (sd_notify(3)), spoken directly on ``$NOTIFY_SOCKET``.

It is one datagram per message, ``KEY=value`` lines, on an AF_UNIX datagram socket whose address is a
path or, with a leading ``@``, a name in the abstract namespace. No library is needed for that, and
without ``$NOTIFY_SOCKET`` (not under systemd, or ``Type=`` is not ``notify``) every call is a no-op.

Sending never raises: a lost notification must not take the daemon down. systemd's own answer to a
silent daemon is its start timeout and the watchdog, which is what they are for.

The watchdog feeder is ticked by the daemon's supervision loop, not by a timer of its own: a timer
task would go on feeding while the loop that matters is stuck on an await that never returns, and
systemd would never learn that the daemon is wedged.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("llamagate.notify")

NOTIFY_ENV = "NOTIFY_SOCKET"


def socket_address(raw: str) -> str | None:
    """``$NOTIFY_SOCKET`` as an address for ``socket.sendto``; None when it is not one we can use.

    ``@name`` is the abstract namespace (a leading NUL byte on the wire). A relative path is refused
    like sd_notify does: it would resolve against whatever directory the daemon happens to be in.
    """
    if raw.startswith("@") and len(raw) > 1:
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None


class Notifier:
    """Sends sd_notify messages; a no-op when there is no socket to send to."""

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        environ = os.environ if env is None else env
        raw = environ.get(NOTIFY_ENV, "")
        if not raw:
            return cls(None)
        address = socket_address(raw)
        if address is None:
            # vsock: addresses (VMs) and relative paths: not for a daemon on a host.
            log.warning(
                "unsupported NOTIFY_SOCKET address; systemd notifications are off",
                extra={"fields": {"notify_socket": raw}},
            )
        return cls(address)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *lines: str) -> bool:
        """Send one message made of ``lines``; True when the datagram went out."""
        if self._address is None or not lines:
            return False
        payload = "\n".join(lines).encode("utf-8")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # A datagram to a full receive queue would block the event loop; drop it instead.
                self._sock.setblocking(False)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._warned:
                # Once: a missing socket would otherwise log on every watchdog tick.
                log.warning("systemd notification failed", extra={"fields": {"error": str(exc)}})
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *_status_line(status))

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *_status_line(status))

    def reloading(self, status: str | None = None) -> bool:
        """A reload begins (SIGHUP). ``MONOTONIC_USEC`` is what systemd's ``Type=notify-reload``
        requires beside it (sd_notify(3)); ``Type=notify`` accepts it as well."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", *_status_line(status))

    def status(self, text: str) -> bool:
        return self.send(*_status_line(text))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def mainpid(self, pid: int) -> bool:
        return self.send(f"MAINPID={pid}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for more start (or stop) time, e.g. while a large model is still loading."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status_line(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    # One message is KEY=value lines; a newline inside STATUS would start a bogus key.
    return ("STATUS=" + " ".join(text.split()),)


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of ``WatchdogSec=``), or None when there is no watchdog.

    Like sd_watchdog_enabled(3): ``$WATCHDOG_PID``, when set, must be our pid, so a child that
    inherited the variables does not think the watchdog is its business.
    """
    environ = os.environ if env is None else env
    raw_usec = environ.get("WATCHDOG_USEC", "")
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC", extra={"fields": {"watchdog_usec": raw_usec}})
        return None
    if usec <= 0:
        return None
    raw_pid = environ.get("WATCHDOG_PID", "")
    if raw_pid and raw_pid != str(os.getpid() if pid is None else pid):
        return None
    return usec / 1_000_000 / 2


@dataclass
class WatchdogFeeder:
    """Sends WATCHDOG=1 at most once per ``interval_s``, each time the owner's loop calls ``tick``.

    ``tick`` takes the time from the caller (``time.monotonic()`` in the daemon, a number in tests), so
    the feeder has no clock of its own and no timer: if the loop stops ticking, pings stop.
    """

    notifier: Notifier
    interval_s: float
    _last_sent: float | None = None

    @classmethod
    def from_env(cls, notifier: Notifier, env: Mapping[str, str] | None = None) -> WatchdogFeeder | None:
        interval = watchdog_interval(env)
        if interval is None or not notifier.enabled:
            return None
        return cls(notifier, interval)

    def due_in(self, now: float) -> float:
        """Seconds until the next ping is due (0 when due now); the loop must not sleep longer."""
        if self._last_sent is None:
            return 0.0
        return max(0.0, self._last_sent + self.interval_s - now)

    def tick(self, now: float) -> bool:
        """Ping if due; True when a ping was sent."""
        if self.due_in(now) > 0:
            return False
        self._last_sent = now
        return self.notifier.watchdog()

    def on_tick(self, now: float) -> float:
        """The driver's tick hook: ping if due, and say how long the loop may wait before the next call."""
        self.tick(now)
        return self.due_in(now)


def _state_name(state: object) -> str:
    # The daemon may hand over an enum member or its name; systemd only ever sees the name.
    name = getattr(state, "name", state)
    return str(name)


class SystemdReporter:
    """Turns the daemon's life into notify messages: the observer for its state-change hook.

    READY=1 goes out the first time both halves are up: the child passed the readiness gate and the
    proxy listens (so ``/readyz`` answers ready by the time systemd calls the unit started). Later
    restarts of the child only change STATUS=: the daemon, which is what systemd supervises, stays up.
    After STOPPING=1 nothing claims readiness again.
    """

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self._child_ready = False
        self._proxy_listening = False
        self._ready_sent = False
        self._stopping = False

    def on_state_change(self, old: object, new: object, reason: str | None = None) -> None:
        name = _state_name(new)
        self._child_ready = name == "READY"
        text = name if not reason else f"{name}: {reason}"
        if not self._maybe_ready(text):
            self.notifier.status(text)

    def on_proxy_listening(self) -> None:
        self._proxy_listening = True
        self._maybe_ready("READY")

    def on_shutdown(self, reason: str = "draining") -> None:
        if self._stopping:
            return
        self._stopping = True
        self.notifier.stopping(f"STOPPING: {reason}")

    def on_reload(self) -> None:
        """A SIGHUP reload begins: RELOADING=1, so ``systemctl reload`` waits for it to end."""
        if not self._stopping:
            self.notifier.reloading("reloading the configuration")

    def on_reloaded(self, outcome: str) -> None:
        """The reload ended (applied or rejected: the daemon serves either way): READY=1 again, once it
        had been ready before, with the outcome as STATUS."""
        if self._stopping:
            return
        if self._ready_sent:
            self.notifier.ready(f"reload: {outcome}")
        else:
            self.notifier.status(f"reload: {outcome}")

    def close(self) -> None:
        self.notifier.close()

    def _maybe_ready(self, text: str) -> bool:
        if self._stopping or self._ready_sent or not (self._child_ready and self._proxy_listening):
            return False
        self._ready_sent = True
        self.notifier.ready(text)
        return True


class _Observers(Protocol):
    observers: list[Callable[[Any, Any, str | None], None]]
    tick_hooks: list[Callable[[float], float | None]]


def attach(supervisor: _Observers, env: Mapping[str, str] | None = None) -> SystemdReporter:
    """Hook systemd notification into a ``ChildSupervisor`` (its state observers and loop tick hooks).

    The daemon then calls ``on_proxy_listening()`` once uvicorn serves, ``on_shutdown()`` when a stop
    begins and ``close()`` at exit. Without ``$NOTIFY_SOCKET`` everything it does is a no-op.
    """
    notifier = Notifier.from_env(env)
    reporter = SystemdReporter(notifier)
    supervisor.observers.append(reporter.on_state_change)
    feeder = WatchdogFeeder.from_env(notifier, env)
    if feeder is not None:
        supervisor.tick_hooks.append(feeder.on_tick)
    return reporter
