"""Offered load: closed loop (N users, each sends its next request when the last one ends) or open
loop (Poisson arrivals at R requests/s, seeded, independent of how fast the server answers).

The generator only decides WHEN request ``seq`` is submitted; ``send`` does the request and records
it. In open loop the submit time is the scheduled arrival, not the moment the event loop got round to
it, so a client that falls behind cannot hide server latency (coordinated omission).

A closed-loop user whose request was rejected pauses for the time ``send`` returns (the server's
Retry-After) before its next request, as the OpenAI SDK does; without the pause, a user turned away in
a millisecond would hammer the door in a tight loop and measure the client instead of the server. In
closed loop the request budget counts ADMITTED requests, so a point past the envelope still yields as
many latency samples as one inside it (the rejections are records too); in open loop it counts
arrivals.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

LoadMode = Literal["concurrency", "rate"]


@dataclass(frozen=True)
class LoadSpec:
    mode: LoadMode
    value: float  # users (concurrency) or requests per second (rate)
    requests: int | None = None  # measured requests; or
    duration_s: float | None = None  # stop submitting after this long
    warmup: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode == "concurrency" and (self.value < 1 or self.value != int(self.value)):
            raise ValueError(f"concurrency must be a whole number >= 1, got {self.value:g}")
        if self.mode == "rate" and self.value <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.value:g}")
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of a request count or a duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError("request count must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be > 0 s")
        if self.warmup < 0:
            raise ValueError("warm-up count must be >= 0")

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "concurrency" else f"r={self.value:g}/s"


@dataclass(frozen=True)
class Plan:
    seq: int
    warmup: bool
    t_submit: float  # monotonic seconds


@dataclass(frozen=True)
class Sent:
    """What ``send`` tells the generator: was the request turned away, and how long to pause."""

    rejected: bool = False
    pause_s: float = 0.0


Send = Callable[[Plan], Coroutine[Any, Any, Sent]]
Clock = Callable[[], float]
# A closed-loop request budget counts admitted requests; this bounds the rejections it may take to
# reach it, so a server that turns everyone away (not ready, misconfigured) cannot stall a run.
MAX_SUBMISSIONS_PER_BUDGET = 10


async def _closed(
    users: int, first: int, count: int | None, deadline: float | None, warmup: bool, send: Send, clock: Clock
) -> int:
    """``count`` admitted requests (rejections do not use up the budget) or until ``deadline``."""
    next_seq = first
    reserved = 0  # admitted or in flight
    cap = None if count is None else first + MAX_SUBMISSIONS_PER_BUDGET * count

    def more() -> bool:
        if deadline is not None and clock() >= deadline:
            return False
        return count is None or (reserved < count and next_seq < (cap or 0))

    async def user() -> None:
        nonlocal next_seq, reserved
        while more():
            seq = next_seq
            next_seq += 1
            reserved += 1
            sent = await send(Plan(seq, warmup, clock()))
            if sent.rejected:
                reserved -= 1
            if sent.pause_s > 0:
                await asyncio.sleep(sent.pause_s)

    async with asyncio.TaskGroup() as group:
        for _ in range(users):
            group.create_task(user())
    return next_seq - first


async def _open(
    rate: float, first: int, count: int | None, duration_s: float | None, seed: int, send: Send, clock: Clock
) -> int:
    rng = random.Random(seed)  # noqa: S311 (reproducible arrivals, not secret)
    start = clock()
    arrival = start
    submitted = 0
    async with asyncio.TaskGroup() as group:
        while count is None or submitted < count:
            arrival += rng.expovariate(rate)
            if duration_s is not None and arrival - start > duration_s:
                break
            delay = arrival - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            group.create_task(send(Plan(first + submitted, False, arrival)))
            submitted += 1
    return submitted


async def generate(load: LoadSpec, send: Send, clock: Clock = time.monotonic) -> int:
    """Warm-up (recorded, flagged) then the measured load; returns how many requests were submitted.

    Warm-up runs closed-loop at the run's concurrency (one user for a rate run) so every slot the
    load will use has served once before measuring starts.
    """
    warm_users = int(load.value) if load.mode == "concurrency" else 1
    submitted = 0
    if load.warmup:
        submitted += await _closed(min(warm_users, load.warmup), 0, load.warmup, None, True, send, clock)
    if load.mode == "concurrency":
        deadline = None if load.duration_s is None else clock() + load.duration_s
        submitted += await _closed(int(load.value), submitted, load.requests, deadline, False, send, clock)
    else:
        submitted += await _open(
            load.value, submitted, load.requests, load.duration_s, load.seed, send, clock
        )
    return submitted
