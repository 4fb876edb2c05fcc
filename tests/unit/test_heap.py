"""The daemon gives the C heap's free pages back to the system (``supervisor.daemon.heap``)."""

from __future__ import annotations

import asyncio
import signal

import psutil
import pytest

import supervisor.daemon.service as service
from supervisor.daemon.heap import malloc_trim, return_free_heap
from supervisor.daemon.listener import bind_listener
from tests.benchmarks.heap_trim import freed_pages_kept_by_malloc
from tests.unit.test_daemon import make_daemon

pytestmark = pytest.mark.skipif(malloc_trim() is None, reason="not glibc: there is no malloc_trim")

MIB = 1 << 20


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


async def test_the_trim_gives_freed_heap_back_to_the_system() -> None:
    kept = freed_pages_kept_by_malloc(64)  # freed inside the heap: glibc keeps it, RSS stays
    before = rss()
    task = asyncio.create_task(return_free_heap(every_s=0.01))
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while rss() > before - 32 * MIB:
            assert asyncio.get_running_loop().time() < deadline, (
                f"RSS {before / MIB:.1f} -> {rss() / MIB:.1f} MiB: the free heap was not given back"
            )
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(kept) == 257  # the blocks in use are still there


async def test_the_daemon_trims_its_heap_for_its_life(monkeypatch: pytest.MonkeyPatch) -> None:
    running, ended = asyncio.Event(), asyncio.Event()

    async def trimming() -> None:
        running.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    monkeypatch.setattr(service, "return_free_heap", trimming)
    d = make_daemon()
    sock = bind_listener("127.0.0.1", 0)
    run = asyncio.create_task(d.run(sock))
    try:
        await asyncio.wait_for(running.wait(), 10)
        d._signals.put_nowait(signal.SIGTERM)
        await asyncio.wait_for(run, 30)
    finally:
        run.cancel()  # a failed wait leaves no daemon running into the next test
        await asyncio.gather(run, return_exceptions=True)
        sock.close()
    assert ended.is_set()
