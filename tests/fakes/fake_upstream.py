"""Fakes for the proxy's tests: an upstream source with a settable snapshot, the fast fake llama-server
(``fake_llama``, which the proxy cost benchmark runs too), and an in-process uvicorn runner on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import uvicorn
from starlette.types import ASGIApp

from proxy.models.lane import ModelEntry
from proxy.source import UpstreamSnapshot
from tests.fakes.fake_llama import FakeLlama

__all__ = ["FakeLlama", "StaticSource", "eventually", "one_model", "serve", "snapshot_for"]


async def eventually(predicate: Callable[[], bool], deadline_s: float = 5.0) -> None:
    """Wait until ``predicate()`` holds; fail with TimeoutError after ``deadline_s``."""
    async with asyncio.timeout(deadline_s):
        while not predicate():  # noqa: ASYNC110 - polling state owned by other tasks, with a deadline
            await asyncio.sleep(0.005)


def snapshot_for(base_url: str | None, secret: str | None, **changes: object) -> UpstreamSnapshot:
    snap = UpstreamSnapshot(
        state="READY",
        ready=True,
        reason=None,
        base_url=base_url,
        secret=secret,
        model_alias="gemma-3-270m",
        slots=4,
        ctx_per_slot=4096,
        generation=1,
        retry_after_s=2.0,
    )
    return dataclasses.replace(snap, **changes)  # type: ignore[arg-type]


class StaticSource:
    """An ``UpstreamSource`` whose snapshot a test sets directly; it announces every ``update``
    (``proxy.source.AnnouncesChanges``), as the daemon's sources announce their child's transitions."""

    def __init__(self, snap: UpstreamSnapshot) -> None:
        self.snap = snap
        self._next_change = asyncio.Event()

    def snapshot(self) -> UpstreamSnapshot:
        return self.snap

    def update(self, **changes: object) -> None:
        self.snap = dataclasses.replace(self.snap, **changes)  # type: ignore[arg-type]
        self._next_change.set()
        self._next_change = asyncio.Event()

    async def changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._next_change.wait(), timeout_s)

    def identity(self) -> Mapping[str, object]:
        return {"llama_cpp_commit": "0c1e570", "model_sha256": "a5fd3b62", "slots": self.snap.slots}


@asynccontextmanager
async def serve(app: ASGIApp) -> AsyncIterator[str]:
    """Run ``app`` on a real uvicorn listener on a free loopback port in this loop; yields the base URL."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    await eventually(lambda: server.started or task.done(), 10.0)
    if task.done():
        task.result()
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def one_model(source: StaticSource, *aliases: str) -> list[ModelEntry]:
    """What ``create_app`` serves for a test's one fake child: one model, named as its snapshot says."""
    return [ModelEntry(source.snap.model_alias, aliases, source)]
