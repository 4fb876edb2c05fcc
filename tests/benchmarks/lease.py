"""``python -m tests.benchmarks.lease``: the latency a shared lease (``cluster.redis_url``) adds to a
request's admission: the Redis round trip of the lease script, on this host, against a real
redis-server on loopback (started and stopped here, tied like everything a benchmark starts).

Two phases, each ``--requests`` admissions through ``ClusterLimiter.acquire`` (the call the request path
makes) and ``release``: one request at a time (the round trip alone), then ``--concurrency`` requests at
once on a tenant whose limit never binds (the round trip under contention of the event loop and Redis;
the limit holding is what the tests check, not what this times). Each admission's wait is reported as
p50, p95 and p99 in milliseconds (linear-interpolation percentiles, ``supervisor.bench.stats``).
Without a lease the admission waits for nothing: these figures are the whole difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from proxy.cluster.limiter import ClusterLimiter
from proxy.settings import ClusterSettings, TenantSettings
from supervisor.bench.stats import percentile
from supervisor.errors import UsageError
from tests.benchmarks import cli
from tests.helpers.redis_server import RedisServer
from tests.helpers.system import find_tool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="admissions per phase (2000)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once in phase two (8)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")


async def _phase(limiter: ClusterLimiter, requests: int, concurrency: int) -> list[float]:
    # A limit that never binds (releases are sent off the request path, so a few are always on their way).
    tenant = TenantSettings("bench", max_concurrency=100_000, max_queue=concurrency)
    waits: list[float] = []
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            started = time.perf_counter()
            lease = await limiter.acquire("model", tenant, 1)
            waits.append((time.perf_counter() - started) * 1000)
            lease.release()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return waits


async def _measure(url: str, requests: int, concurrency: int) -> dict[str, dict[str, float | None]]:
    limiter = ClusterLimiter(ClusterSettings(url))
    try:
        await _phase(limiter, 100, 1)  # warm: connection, script cache
        out = {}
        for name, n in (("sequential", 1), (f"concurrent_{concurrency}", concurrency)):
            waits = await _phase(limiter, requests, n)
            if limiter.mode != "cluster":
                raise UsageError(f"Redis stopped answering during the {name} phase")
            out[name] = {f"p{q}_ms": percentile(waits, q) for q in (50, 95, 99)}
        return out
    finally:
        await limiter.aclose()


def handle(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.concurrency < 1:
        raise UsageError("--requests and --concurrency must be >= 1")
    binary = find_tool("redis-server")
    if binary is None:
        raise UsageError("redis-server not found: install the Debian package 'redis-server'")
    with tempfile.TemporaryDirectory(prefix="llamagate-lease-") as folder:
        server = RedisServer(Path(folder), binary=binary).start()
        try:
            results = asyncio.run(_measure(server.url, args.requests, args.concurrency))
        finally:
            server.stop()
    for name, figures in results.items():
        shown = "  ".join(f"{k.removesuffix('_ms')} {v:.3f} ms" for k, v in figures.items() if v is not None)
        print(f"lease admission, {name}: {shown}")
    if args.out:
        args.out.write_text(json.dumps({"command": cli.command_line("lease"), "results": results}, indent=2))
    return 0


def main() -> int:
    return cli.run("lease", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
