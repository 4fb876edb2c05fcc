"""The C heap's free pages go back to the system every ``TRIM_EVERY_S`` (glibc's ``malloc_trim``).

Why: glibc's malloc keeps the pages that freed blocks leave inside its heaps, and only gives back
what sits at the very top of one. The proxy's requests allocate and free a little C memory each
(sockets, parsers, the buffers of bodies larger than pymalloc's 512 bytes), so over tens of thousands
of requests the daemon's RSS crept up although nothing stayed allocated: 20,000 short one-shot
requests, +8.1 % after the first 2,000 with nothing of Python's growing (``tracemalloc``), +2.8 % with
this trim and flat from request 10,000 on (docs/benchmarks.md, "Writing only what will be read").
``malloc_trim(0)`` hands every whole free page of every arena back (``madvise``); the blocks in use do
not move.

The trim runs in a worker thread: ctypes releases the GIL for the call, so the event loop goes on
serving while glibc walks its arenas (it takes each arena's lock in turn, so a request that allocates
at that moment waits for that arena only). Not glibc (musl, macOS): nothing to call, nothing runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# The period the 20,000-request run measured. A trim costs little, in a worker thread: about 5 ms to
# give back 64 MiB freed in 4 KiB pieces, 0.2 ms to walk the same heap again with nothing new freed
# (``python -m tests.benchmarks.heap_trim`` on the 2-core host; docs/benchmarks.md).
TRIM_EVERY_S = 20.0


def malloc_trim() -> Callable[[], int] | None:
    """``malloc_trim(0)`` of this process's C library (1 if it gave memory back), or None if it has
    none (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library the interpreter itself runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


async def return_free_heap(every_s: float = TRIM_EVERY_S) -> None:
    """Trim the heap every ``every_s`` until cancelled (the daemon's life)."""
    trim = malloc_trim()
    if trim is None:
        log.debug("no malloc_trim in this C library: the heap is not trimmed")
        return
    while True:
        await asyncio.sleep(every_s)
        started = time.perf_counter()
        released = await asyncio.to_thread(trim)
        ms = round((time.perf_counter() - started) * 1000, 2)
        log.debug("heap trimmed", extra={"fields": {"released": bool(released), "ms": ms}})
