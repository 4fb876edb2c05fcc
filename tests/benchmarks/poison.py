"""``python -m tests.benchmarks.poison``: what sharing the poison verdicts (``cluster.redis_url``,
``proxy.cluster.poison``) costs, on this host, against a real redis-server on loopback (started and stopped
here, tied like everything a benchmark starts).

Three figures, each over ``--verdicts`` verdicts, as p50, p95 and p99 (linear-interpolation percentiles,
``supervisor.bench.stats``):

- ``check``: the request path's lookup (``Poison.check``, a key and a body that are not refused) with
  ``MAX_BODIES`` bodies refused, shared and alone: the request path asks Redis nothing, so the two are
  the same code; in microseconds;
- ``strike``: a verdict's synchronous script call (the event loop waits for it; verdicts are rare), in
  milliseconds;
- ``reach``: from ``strike`` returning to the other replica (a second ``SharedPoison`` in this process,
  on its own connections) refusing the body, in milliseconds: the window in which a client's immediate
  retry through another replica could still reach a child.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path

from proxy.admission.poison import MAX_BODIES, Poison, PoisonRefusal
from proxy.cluster.limiter import ClusterLimiter
from proxy.cluster.poison import SharedPoison
from proxy.settings import ClusterSettings, PoisonSettings
from supervisor.bench.stats import percentile
from supervisor.errors import UsageError
from tests.benchmarks import cli
from tests.helpers.redis_server import RedisServer
from tests.helpers.system import find_tool

# Strikes never cool a key down here: the figures are the verdict's, not a refusal's.
SETTINGS = PoisonSettings(strikes=1_000_000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verdicts", type=int, default=500, help="verdicts (and checks) timed (500)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")


def _refuses(poison: Poison, raw: bytes) -> bool:
    try:
        poison.check("someone", raw)
    except PoisonRefusal:
        return True
    return False


def _figures(samples: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(samples, q) for q in (50, 95, 99)}


async def _replica(url: str) -> tuple[ClusterLimiter, Poison, SharedPoison]:
    limiter = ClusterLimiter(ClusterSettings(url))
    poison = Poison(SETTINGS)
    share = SharedPoison(limiter, poison)
    poison.share = share
    limiter.start()
    share.start()
    await asyncio.wait_for(share.synced(), 10)
    return limiter, poison, share


async def _measure(url: str, verdicts: int) -> dict[str, dict[str, float | None]]:
    a, b = await _replica(url), await _replica(url)
    try:
        strike_ms: list[float] = []
        reach_ms: list[float] = []
        for i in range(max(verdicts, MAX_BODIES)):  # at least MAX_BODIES: the checks run on a full memory
            raw = f'{{"prompt": "poison {i}"}}'.encode()
            started = time.perf_counter()
            a[1].strike(f"key{i % 10}", raw)
            returned = time.perf_counter()
            deadline = returned + 10
            while True:  # the other replica's listener runs in this loop: let it, until it refuses
                if _refuses(b[1], raw):
                    break
                if time.perf_counter() > deadline:
                    raise UsageError("a verdict did not reach the other replica within 10 s")
                await asyncio.sleep(0)
            if i < verdicts:
                strike_ms.append((returned - started) * 1000)
                reach_ms.append((time.perf_counter() - returned) * 1000)
            if a[0].mode != "cluster":
                raise UsageError("Redis stopped answering during the run")
        alone = Poison(SETTINGS)
        for i in range(MAX_BODIES):
            alone.strike(f"key{i % 10}", f'{{"prompt": "poison {i}"}}'.encode())
        out = {"strike_ms": _figures(strike_ms), "reach_ms": _figures(reach_ms)}
        for name, poison in (("check_shared_us", b[1]), ("check_alone_us", alone)):
            samples = []
            for i in range(verdicts):
                raw = f'{{"prompt": "innocent {i}"}}'.encode()
                started = time.perf_counter()
                poison.check("someone", raw)
                samples.append((time.perf_counter() - started) * 1e6)
            out[name] = _figures(samples)
        return out
    finally:
        for limiter, _, share in (a, b):
            await share.aclose()
            await limiter.aclose()


def handle(args: argparse.Namespace) -> int:
    logging.getLogger("llamagate.cluster").setLevel(logging.WARNING)  # one line per verdict learned
    if args.verdicts < 1:
        raise UsageError("--verdicts must be >= 1")
    binary = find_tool("redis-server")
    if binary is None:
        raise UsageError("redis-server not found: install the Debian package 'redis-server'")
    with tempfile.TemporaryDirectory(prefix="llamagate-poison-") as folder:
        server = RedisServer(Path(folder), binary=binary).start()
        try:
            results = asyncio.run(_measure(server.url, args.verdicts))
        finally:
            server.stop()
    for name, figures in results.items():
        unit = name.rsplit("_", 1)[1]
        shown = "  ".join(f"{k} {v:.3f} {unit}" for k, v in figures.items() if v is not None)
        print(f"{name.rsplit('_', 1)[0]}: {shown}")
    if args.out:
        args.out.write_text(json.dumps({"command": cli.command_line("poison"), "results": results}, indent=2))
    return 0


def main() -> int:
    return cli.run("poison", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
