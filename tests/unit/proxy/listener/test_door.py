"""The front door against raw sockets: a real uvicorn with the guarded protocol on a real port.

The server runs in a thread with its own loop so the test can use blocking sockets the way a hostile
client would. Deadlines in the settings are short; the test only waits for states (closed, answered),
with generous socket timeouts, and never asserts how long something took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from proxy.listener.guard import FrontDoor, uvicorn_config
from proxy.listener.refusals import RateLimitedLog
from proxy.middleware.forwarded import ForwardedFor
from proxy.settings import DoorSettings
from tests.helpers.raw_http import read_until_closed, status_of

WAIT_S = 30.0  # generous: the machine is shared


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def _echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers the client address it sees (what the access log would record) and the door's problem."""
    if scope["type"] != "http":
        return
    door: FrontDoor = scope["state"]["door"]
    if scope["path"] == "/problem":
        body = (door.problem() or "none").encode()
    else:
        body = (scope["client"][0] if scope.get("client") else "-").encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


@dataclass
class Served:
    port: int
    door: FrontDoor
    log: _Records
    settings: list[DoorSettings]

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S)
        return s


@pytest.fixture
def serve_door() -> Iterator[Callable[..., Served]]:
    started: list[tuple[uvicorn.Server, threading.Thread, asyncio.AbstractEventLoop]] = []
    handler = _Records()
    door_log = logging.getLogger("llamagate.door")
    door_log.addHandler(handler)

    def start(**limits: Any) -> Served:
        current = [DoorSettings(**limits)]
        door = FrontDoor(lambda: current[0])

        async def lifespan_app(scope: Any, receive: Any, send: Any) -> None:
            scope.setdefault("state", {})["door"] = door
            await _echo_app(scope, receive, send)

        app = ForwardedFor(lifespan_app, lambda: current[0].forwarded_allow_ips)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        config = uvicorn_config(app, door, log_config=None, access_log=False, lifespan="off")
        server = uvicorn.Server(config)
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)

            async def main() -> None:
                task = asyncio.create_task(server.serve(sockets=[sock]))
                while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn only has a flag
                    await asyncio.sleep(0.01)
                ready.set()
                await task

            loop.run_until_complete(main())
            loop.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert ready.wait(WAIT_S), "server did not start"
        started.append((server, thread, loop))
        return Served(sock.getsockname()[1], door, handler, current)

    try:
        yield start
    finally:
        door_log.removeHandler(handler)
        for server, thread, _loop in started:
            server.should_exit = True
            thread.join(WAIT_S)


def _send(s: socket.socket, data: bytes) -> None:
    # The server may answer and close before all of a huge head is sent: that is the point.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(data)


def _get(s: socket.socket, path: str = "/", extra: bytes = b"") -> bytes:
    s.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {head!r}"
        head += chunk
    header, _, body = head.partition(b"\r\n\r\n")
    length = int(
        next(
            v
            for k, _, v in (line.partition(b": ") for line in header.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
    )
    while len(body) < length:
        body += s.recv(65536)
    return body


def test_a_one_mib_header_gets_431_and_is_not_read_whole(serve_door: Callable[..., Served]) -> None:
    served = serve_door()
    with served.connect() as s:
        _send(s, b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        answer = read_until_closed(s)
    assert status_of(answer) == 431
    assert b"request head larger than 32768 bytes" in answer
    assert served.door.refused == {"head_size": 1}


def test_a_hundred_thousand_headers_get_431(serve_door: Callable[..., Served]) -> None:
    served = serve_door()
    with served.connect() as s:
        _send(s, b"GET / HTTP/1.1\r\nHost: t\r\n" + b"X-A: b\r\n" * 100_000 + b"\r\n")
        answer = read_until_closed(s)
    assert status_of(answer) == 431
    assert b"more than 100 header lines" in answer


def test_many_small_headers_under_the_count_but_over_the_size_get_431(
    serve_door: Callable[..., Served],
) -> None:
    served = serve_door(max_head_bytes=2048, max_headers=100)
    with served.connect() as s:
        _send(
            s,
            b"GET / HTTP/1.1\r\nHost: t\r\n"
            + b"X-A: "
            + b"b" * 40
            + b"\r\n" * 1
            + (b"X-B: " + b"c" * 40 + b"\r\n") * 60
            + b"\r\n",
        )
        assert status_of(read_until_closed(s)) == 431


def test_a_long_request_line_gets_414(serve_door: Callable[..., Served]) -> None:
    served = serve_door()
    with served.connect() as s:
        _send(s, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status_of(read_until_closed(s)) == 414


def test_an_ordinary_request_within_the_limits_is_served_and_kept_alive(
    serve_door: Callable[..., Served],
) -> None:
    served = serve_door(keep_alive_timeout_s=30)
    with served.connect() as s:
        assert _get(s, extra=b"X-A: " + b"b" * 4000 + b"\r\n") == b"127.0.0.1"
        assert _get(s) == b"127.0.0.1"  # the same connection serves a second request
    assert served.door.refused == {}


def test_an_upgrade_request_is_served_as_plain_http(serve_door: Callable[..., Served]) -> None:
    served = serve_door(keep_alive_timeout_s=30)
    with served.connect() as s:
        assert _get(s, extra=b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n") == b"127.0.0.1"
    assert served.door.refused == {}


def test_a_silent_new_connection_is_closed_after_the_idle_deadline(serve_door: Callable[..., Served]) -> None:
    served = serve_door(keep_alive_timeout_s=0.5)
    with served.connect() as s:
        assert read_until_closed(s) == b""  # closed by the server, without a word (nothing was asked)
    assert served.door.open == 0 or _wait(lambda: served.door.open == 0)


def test_an_idle_keep_alive_connection_is_closed_after_a_response(serve_door: Callable[..., Served]) -> None:
    served = serve_door(keep_alive_timeout_s=0.5)
    with served.connect() as s:
        assert _get(s) == b"127.0.0.1"
        assert read_until_closed(s) == b""


def test_a_head_sent_a_byte_at_a_time_is_cut_at_the_head_deadline(serve_door: Callable[..., Served]) -> None:
    # Each byte resets no timer: the head deadline runs from the first byte. The pause between bytes is
    # shorter than the idle deadline, so only the head deadline can end this.
    served = serve_door(head_timeout_s=1.0, keep_alive_timeout_s=5.0)
    head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"z" * 10_000
    answer = b""
    closed = False
    with served.connect() as s:
        s.settimeout(0.2)
        for i in range(len(head)):
            try:
                s.send(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:  # a byte sent after the close: the kernel answers RST
                closed = True
                break
            answer += chunk
            if not chunk:
                break
        else:
            pytest.fail("the whole slow head was accepted")
        s.settimeout(WAIT_S)
        answer += read_until_closed(s)
    # The 408 is written before the close; a byte sent after it may turn the close into a reset that
    # discards it, so either way the connection ended, and the door counted it as a head timeout.
    assert closed or status_of(answer) == 408
    assert served.door.refused == {"head_timeout": 1}


def test_over_the_connection_cap_one_503_each_and_a_single_log_line(
    serve_door: Callable[..., Served],
) -> None:
    served = serve_door(max_connections=3, keep_alive_timeout_s=30)
    held = [served.connect() for _ in range(3)]
    try:
        for s in held:
            assert _get(s) == b"127.0.0.1"  # all three are in and served
        with held[0] as s:
            pass
        held = held[1:]
        assert _wait(lambda: served.door.open == 2)
        extra = served.connect()  # the third place is free again
        held.append(extra)
        assert _get(extra) == b"127.0.0.1"
        # At the cap /readyz's source says why, on a connection that is already in.
        assert _get(held[0], "/problem").startswith(b"the proxy is at its connection cap")
        answers = []
        for _ in range(10):
            with served.connect() as s:
                _send(s, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                answers.append(read_until_closed(s))
        assert [status_of(a) for a in answers] == [503] * 10
        assert all(b"retry-after: 1\r\n" in a for a in answers)
        lines = [m for m in served.log.messages if "refusing connections" in m]
        assert len(lines) == 1, served.log.messages
        assert served.door.refused == {"connection_cap": 10}
    finally:
        for s in held:
            s.close()
    assert _wait(lambda: served.door.problem() is None)


def test_x_forwarded_for_is_ignored_unless_the_peer_is_trusted(serve_door: Callable[..., Served]) -> None:
    served = serve_door(keep_alive_timeout_s=30)
    spoof = b"X-Forwarded-For: 203.0.113.9\r\n"
    with served.connect() as s:
        assert _get(s, extra=spoof) == b"127.0.0.1"
    served.settings[0] = replace(served.settings[0], forwarded_allow_ips=("127.0.0.1",))  # a reload
    with served.connect() as s:
        assert _get(s, extra=spoof) == b"203.0.113.9"


def _wait(pred: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


# --- without sockets ----------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_log_writes_one_line_per_interval_and_counts_the_rest() -> None:
    clock, records = _Clock(), _Records()
    logger = logging.getLogger("test.door.ratelimit")
    logger.addHandler(records)
    logger.propagate = False
    try:
        rl = RateLimitedLog(logger, 60.0, clock)
        assert rl.event("k", "refused") is True
        assert [rl.event("k", "refused") for _ in range(500)] == [False] * 500
        assert rl.event("other", "another reason") is True  # reasons are limited apart
        clock.now += 60.0
        assert rl.event("k", "refused") is True
    finally:
        logger.removeHandler(records)
    assert records.messages == [
        "refused",
        "another reason",
        "refused (500 more since the last such line)",
    ]


def test_accept_failures_become_one_line_and_a_readiness_problem() -> None:
    clock, records = _Clock(), _Records()
    logger = logging.getLogger("test.door.accept")
    logger.addHandler(records)
    logger.propagate = False
    passed: list[dict[str, Any]] = []
    door = FrontDoor(DoorSettings, clock=clock, logger=logger)
    handle = door.exception_handler(lambda loop, ctx: passed.append(ctx))
    loop = asyncio.new_event_loop()
    try:
        exc = OSError(24, "Too many open files")
        for _ in range(2048):  # what one tick of asyncio's accept loop reports after EMFILE
            handle(loop, {"message": "socket.accept() out of system resource", "exception": exc})
        handle(loop, {"message": "something else"})
    finally:
        loop.close()
        logger.removeHandler(records)
    assert len(records.messages) == 1
    assert "Too many open files" in records.messages[0]
    assert passed == [{"message": "something else"}]
    assert door.problem() == "the proxy cannot accept new connections (out of file descriptors)"
    clock.now += 60
    assert door.problem() is None


def test_an_accept_retry_that_fires_after_the_listener_closed_is_not_reported() -> None:
    """CI saw it: descriptors ran out, asyncio scheduled its accept retry (``call_later(...,
    _start_serving, ...)``), the server stopped and closed the socket, and the retry raised ``ValueError:
    Invalid file descriptor: -1`` into the log as a traceback per listener. The same timer is made here
    the way asyncio makes it, on a closed socket; an unrelated callback error still goes through."""
    passed: list[dict[str, Any]] = []
    door = FrontDoor(DoorSettings)
    loop = asyncio.new_event_loop()
    try:
        loop.set_exception_handler(door.exception_handler(lambda _loop, ctx: passed.append(ctx)))
        sock = socket.socket()
        sock.close()
        start_serving = loop._start_serving  # type: ignore[attr-defined]  # the retry asyncio schedules
        loop.call_soon(start_serving, asyncio.Protocol, sock, None, None, 100)

        def unrelated() -> None:
            raise ValueError("not a listener")

        loop.call_soon(unrelated)
        loop.run_until_complete(asyncio.sleep(0))
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    assert [str(ctx.get("exception")) for ctx in passed] == ["not a listener"]


_FD_SERVER = textwrap.dedent(
    """
    import asyncio, logging, resource, socket, sys
    import uvicorn
    from proxy.listener.guard import FrontDoor, uvicorn_config
    from proxy.settings import DoorSettings

    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s %(message)s")
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    door = FrontDoor(lambda: DoorSettings(keep_alive_timeout_s=60))

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = (door.problem() or "none").encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(door.exception_handler(None))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
        sock.setblocking(False)
        door.guard(sock)
        server = uvicorn.Server(uvicorn_config(app, door, log_config=None, access_log=False, lifespan="off"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        print(sock.getsockname()[1], flush=True)
        await task

    asyncio.run(main())
    """
)


def test_out_of_file_descriptors_logs_one_line_and_readiness_says_so(tmp_path: Path) -> None:
    """The daemon's case: fds exhausted. asyncio alone logs a traceback per accept attempt (thousands a
    second); with the door's exception handler there is one line, and a connection already in learns
    why new ones are not served."""
    err = tmp_path / "stderr.txt"
    with err.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-c", _FD_SERVER],
            stdout=subprocess.PIPE,
            stderr=fh,
            cwd=Path(__file__).resolve().parents[4],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])},
        )
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        first = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        held.append(first)
        assert _get(first, "/problem") == b"none"
        for _ in range(120):  # more than the server's 64 descriptors
            held.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S))
        assert _wait(lambda: _get(first, "/problem") != b"none")
        assert _get(first, "/problem") == b"the proxy cannot accept new connections (out of file descriptors)"
        # A connection beyond the descriptors is answered (503, or closed if the answer raced its
        # request), not left waiting in the backlog: the door's reserve descriptor accepts and refuses it.
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as late:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                late.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            answer = read_until_closed(late)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(WAIT_S)
        if proc.stdout is not None:
            proc.stdout.close()
    text = err.read_text()
    assert text.count("cannot accept new connections") == 1, text[:2000]
    assert "Traceback" not in text
