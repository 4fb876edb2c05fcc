"""Waiting for "nothing left to do": shared by the admission gate (idle = no permit held or queued) and
the door and each lane (idle = no HTTP request being handled), whose drains all need a deadline."""

from __future__ import annotations

import asyncio


class IdleWaiters:
    """Futures woken together when the owner sees its count reach zero."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    async def wait(self, timeout_s: float) -> bool:
        """True once ``wake`` is called; False if ``timeout_s`` passes first. The caller checks for an
        already idle state before calling, so a wake that happened earlier is not missed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
