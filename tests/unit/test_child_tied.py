"""A child started through ``child.spawn.spawn_tied`` dies with the process that started it, even by SIGKILL,
also when the event loop that spawned it does not run on the main thread (PR_SET_PDEATHSIG follows the
forking thread; asyncio forks on the loop's thread)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, threading
from pathlib import Path
from supervisor.child.spawn import spawn_tied

async def main():
    proc = await spawn_tied(["/bin/sleep", "300"], {"PATH": "/bin"}, Path("/"))
    print(proc.pid, flush=True)
    await asyncio.sleep(3600)

if ON_A_THREAD:
    threading.Thread(target=asyncio.run, args=(main(),), name="loop").start()
    threading.Event().wait()
else:
    asyncio.run(main())
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_child_dies_with_sigkilled_parent(script: str) -> None:
    """Run ``script`` (it prints the pid of the child it started, then waits), SIGKILL it, and see the
    child go."""
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert not gone(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone(pid), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()


@pytest.mark.parametrize("on_a_thread", [False, True], ids=["loop-on-main-thread", "loop-on-other-thread"])
def test_the_child_dies_with_a_sigkilled_parent(on_a_thread: bool) -> None:
    assert_child_dies_with_sigkilled_parent(SCRIPT.replace("ON_A_THREAD", repr(on_a_thread)))


POPEN_SCRIPT = """
import threading
from supervisor.child.spawn import popen_tied

proc = popen_tied(["/bin/sleep", "300"])
print(proc.pid, flush=True)
threading.Event().wait()
"""


def test_a_popen_tied_child_dies_with_a_sigkilled_parent() -> None:
    # What bench uses for its bare llama-servers and private daemons.
    assert_child_dies_with_sigkilled_parent(POPEN_SCRIPT)


def test_popen_tied_refuses_a_thread_that_may_end_before_the_process() -> None:
    import threading

    from supervisor.child.spawn import popen_tied

    errors: list[BaseException] = []

    def spawn() -> None:
        try:
            popen_tied(["/bin/true"]).wait(10)
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=spawn)
    worker.start()
    worker.join(30)
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_stop_popen_asks_first_then_kills_after_the_grace() -> None:
    from supervisor.child.spawn import stop_popen

    polite = subprocess.Popen(["/bin/sleep", "300"])
    assert stop_popen(polite, 10) == -signal.SIGTERM
    # A child that ignores the first signal is killed once the grace is over.
    deaf = subprocess.Popen(
        ["/bin/sh", "-c", "trap '' TERM; echo up; exec /bin/sleep 300"], stdout=subprocess.PIPE
    )
    try:
        assert deaf.stdout is not None and deaf.stdout.readline() == b"up\n"
        assert stop_popen(deaf, 0.2) == -signal.SIGKILL
    finally:
        if deaf.stdout is not None:
            deaf.stdout.close()
    assert stop_popen(deaf, 0.2) == -signal.SIGKILL  # already gone: nothing sent, same answer
