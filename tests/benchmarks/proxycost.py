"""Measurements behind ``python -m tests.benchmarks.proxy``: each one a function of base URLs and prepared
requests, run from the benchmark's own process (never inside the proxy's), over the lean client in
``rawhttp``.

- ``latencies``: sequential requests on one keep-alive connection (concurrency 1).
- ``throughput``: N connections in a closed loop for a fixed time.
- ``streams``: N concurrent streamed requests, each timed per event by the harness's stream timer.
- ``cpu_seconds``: user+system CPU of a process, read before and after a phase (psutil).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from supervisor.bench import stats
from supervisor.bench.client import Exchange, time_reply
from supervisor.bench.launcher import PrivateDaemon
from supervisor.bench.stats import distribution
from supervisor.errors import CheckFailed
from tests.benchmarks.rawhttp import Connection, build_request


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def daemon_cpu_seconds(launched: PrivateDaemon) -> tuple[float, float]:
    """CPU seconds so far of the daemon and of its llama-server child."""
    child = launched.child_pid
    return cpu_seconds(launched.proc.pid), cpu_seconds(child) if child else 0.0


def chat_request(url: str, key: str, max_tokens: int, stream: bool, **extra: object) -> bytes:
    body: dict[str, object] = {
        "model": "gemma-3-270m",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
    return build_request(
        "POST", url + "/v1/chat/completions", json.dumps(body).encode(), {"Authorization": f"Bearer {key}"}
    )


async def latencies(url: str, raw: bytes, n: int) -> list[float]:
    conn = await Connection.open(url)
    out = []
    try:
        for _ in range(n):
            reply = await conn.send(raw)
            if reply.status != 200:
                raise CheckFailed(f"{url}: status {reply.status}: {reply.body[:200]!r}")
            out.append(reply.done_at - reply.sent_at)
    finally:
        await conn.close()
    return out


async def reply_headers(url: str, raw: bytes) -> dict[str, str]:
    """The headers of one answer (a 200 expected)."""
    conn = await Connection.open(url)
    try:
        reply = await conn.send(raw)
    finally:
        await conn.close()
    if reply.status != 200:
        raise CheckFailed(f"{url}: status {reply.status}: {reply.body[:200]!r}")
    return dict(reply.headers)


async def throughput(url: str, raw: bytes, concurrency: int, duration_s: float) -> tuple[int, float, int]:
    """(completed requests, elapsed seconds, non-200 answers)."""
    stop_at = time.monotonic() + duration_s
    done = 0
    failed = 0

    async def worker() -> None:
        nonlocal done, failed
        conn = await Connection.open(url)
        try:
            while time.monotonic() < stop_at:
                reply = await conn.send(raw)
                done += 1
                failed += reply.status != 200
        finally:
            await conn.close()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, time.monotonic() - started, failed


@dataclass(frozen=True)
class Streamed:
    """One streamed request, read by the harness's stream timer (``client.time_reply``)."""

    ex: Exchange
    chunks: int  # HTTP chunks of the body: one per SSE event as llama-server and the proxy write them

    @property
    def status(self) -> int:
        return self.ex.status or 0

    @property
    def latency_s(self) -> float:
        """Send to the end of the answer (for a refusal: to the refusal)."""
        return (self.ex.t_end or 0.0) - (self.ex.t_send or 0.0)

    @property
    def ttft_s(self) -> float | None:
        ttft = stats.ttft_ms(self.ex.t_send or 0.0, self.ex.t_first_content)
        return None if ttft is None else ttft / 1000.0

    @property
    def tpot_s(self) -> float | None:
        """The mean gap between streamed tokens after the first (from their arrival times alone: a
        non-admin key's answers carry no token counts)."""
        ex = self.ex
        tpot = stats.tpot_ms(ex.t_first_content, ex.t_last_content, ex.content_events)
        return None if tpot is None or ex.outcome != "ok" else tpot / 1000.0


async def one_stream(url: str, raw: bytes) -> Streamed:
    conn = await Connection.open(url)
    try:
        r = await conn.send(raw)
    finally:
        await conn.close()
    ex = time_reply(r.status, r.headers.get("retry-after"), r.body, r.chunks, r.sent_at, r.done_at)
    return Streamed(ex, len(r.chunks))


async def streams(url: str, raw: bytes, concurrency: int) -> list[Streamed]:
    return list(await asyncio.gather(*(one_stream(url, raw) for _ in range(concurrency))))


def summary_ms(seconds: Sequence[float]) -> dict[str, Any]:
    """n, p50/p95/p99 (the harness's one percentile definition), mean, min and max, in milliseconds."""
    return asdict(distribution([s * 1000.0 for s in seconds]))
