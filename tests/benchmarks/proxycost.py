"""Measurements behind ``python -m tests.benchmarks.proxy``: each one a function of base URLs and prepared
requests, run from the benchmark's own process (never inside the proxy's), over the lean client in
``rawhttp``.

- ``latencies``: sequential requests on one keep-alive connection (concurrency 1).
- ``throughput``: N connections in a closed loop for a fixed time.
- ``streams``: N concurrent streamed requests, each timed per event (TTFT, TPOT, status, Retry-After).
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

from supervisor.bench.stats import distribution
from supervisor.errors import CheckFailed
from tests.benchmarks.rawhttp import Connection, build_request


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


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


@dataclass
class StreamResult:
    status: int
    latency_s: float  # send to last byte (for a refusal: to the answer)
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    chunks: int = 0
    retry_after: str | None = None


async def one_stream(url: str, raw: bytes) -> StreamResult:
    conn = await Connection.open(url)
    try:
        reply = await conn.send(raw)
    finally:
        await conn.close()
    result = StreamResult(
        reply.status, reply.done_at - reply.sent_at, retry_after=reply.headers.get("retry-after")
    )
    token_times = [
        t for t, data in reply.chunks for _ in range(data.count(b'"content":"') - data.count(b'"content":""'))
    ]
    result.chunks = len(reply.chunks)
    result.tokens = len(token_times)
    if token_times:
        result.ttft_s = token_times[0] - reply.sent_at
    if len(token_times) > 1:
        result.tpot_s = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
    return result


async def streams(url: str, raw: bytes, concurrency: int) -> list[StreamResult]:
    return list(await asyncio.gather(*(one_stream(url, raw) for _ in range(concurrency))))


def summary_ms(seconds: Sequence[float]) -> dict[str, Any]:
    """n, p50/p95/p99 (the harness's one percentile definition), mean, min and max, in milliseconds."""
    return asdict(distribution([s * 1000.0 for s in seconds]))
