"""The daemon's front door with raw sockets: ``llamagate serve`` with the real child, on a real port.

Issue 12 finding 5 and 7: a huge head, an idle or slow connection, more connections than the cap, and
``X-Forwarded-For`` from a client nobody configured as a forwarder. Only states are waited for (an
answer, a close, a log line); no duration is asserted.
"""

from __future__ import annotations

import contextlib
import signal
import socket

import httpx
import pytest

from tests.helpers.raw_http import read_until_closed, status_of
from tests.integration.conftest import DaemonFactory, wait_until

pytestmark = pytest.mark.integration

WAIT_S = 60.0


def test_front_door_limits_on_the_real_daemon(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory({"proxy": {"keep_alive_timeout_s": 1, "head_timeout_s": 2, "max_connections": 6}})

    # A 1 MiB header: 431 before authentication, and the daemon is still ready.
    with socket.create_connection(("127.0.0.1", d.port), timeout=WAIT_S) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        assert status_of(read_until_closed(s)) == 431

    # 100,000 header lines: 431.
    with socket.create_connection(("127.0.0.1", d.port), timeout=WAIT_S) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n" + b"X-A: b\r\n" * 100_000 + b"\r\n")
        assert status_of(read_until_closed(s)) == 431

    # An idle connection is closed by the daemon (recv returns before its generous timeout).
    with socket.create_connection(("127.0.0.1", d.port), timeout=WAIT_S) as s:
        assert read_until_closed(s) == b""

    # A head that never ends is cut.
    with socket.create_connection(("127.0.0.1", d.port), timeout=WAIT_S) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n")
        answer = read_until_closed(s)
        assert answer == b"" or status_of(answer) == 408

    code, body = d.readyz()
    assert code == 200 and body["ready"] is True

    # X-Forwarded-For from loopback is not believed: the access log records the socket's peer.
    spoof = "203.0.113.9"
    auth = {"Authorization": f"Bearer {d.admin_key}"}
    with httpx.Client(timeout=WAIT_S, trust_env=False) as client:
        r = client.get(f"{d.base_url}/v1/models", headers={**auth, "X-Forwarded-For": spoof})
        assert r.status_code == 200
    wait_until(lambda: any(rec.get("route") == "/v1/models" for rec in d.log_records()), "access line")
    clients = {rec.get("client") for rec in d.log_records() if rec.get("route") == "/v1/models"}
    assert clients == {"127.0.0.1"}
    assert spoof not in d.log_text()

    # Limits and trusted forwarders are reloadable (for new connections): a long idle deadline now, so
    # that connections can be held open, and the loopback proxy's header believed.
    d.write_config({"proxy": {"forwarded_allow_ips": ["127.0.0.1"], "keep_alive_timeout_s": 120}})
    d.signal(signal.SIGHUP)
    wait_until(lambda: "configuration reloaded" in d.log_text(), "the reload", WAIT_S)
    with httpx.Client(timeout=WAIT_S, trust_env=False) as client:
        r = client.get(f"{d.base_url}/v1/models", headers={**auth, "X-Forwarded-For": spoof})
        assert r.status_code == 200
    wait_until(
        lambda: any(rec.get("client") == spoof for rec in d.log_records()), "the forwarded address logged"
    )

    # Over the cap: /readyz (on a connection already in) says why, every extra connection gets 503,
    # and one log line says so.
    held: list[socket.socket] = []
    with httpx.Client(timeout=WAIT_S, trust_env=False) as probe:
        try:
            assert probe.get(f"{d.base_url}/readyz").status_code == 200
            while probe.get(f"{d.base_url}/readyz").status_code == 200:
                assert len(held) < 6, "never reached the cap of 6"
                held.append(socket.create_connection(("127.0.0.1", d.port), timeout=WAIT_S))
            r = probe.get(f"{d.base_url}/readyz")
            assert r.status_code == 503 and r.json()["ready"] is False
            assert "connection cap" in r.json()["reason"]
            assert r.headers["retry-after"] == "1"  # as the door's own 503s: a balancer may come back soon
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", d.port), timeout=WAIT_S) as s:
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        s.sendall(b"GET /readyz HTTP/1.1\r\nHost: t\r\n\r\n")
                    answer = read_until_closed(s)
                    assert status_of(answer) == 503 and b"too many open connections" in answer
        finally:
            for s in held:
                s.close()
    d.wait_ready(timeout=WAIT_S)
    lines = [rec for rec in d.log_records() if "refusing connections" in str(rec.get("msg", ""))]
    assert len(lines) == 1, lines
    assert d.stop() == 0
