"""``python -m tests.benchmarks.proxy_opcodes``: what the accounts store costs the event loop, counted in
bytecode instructions per request instead of timed.

The CPU figures of ``tests.benchmarks.proxy --phases accounts`` move by 10 % from one round to the next
on a small shared host, more than the cost they compare. The number of bytecode instructions the loop's
thread runs per request hardly moves at all (busy host or quiet), so a change to the request path can be
weighed here, and found where it costs: the same two proxies as the accounts phase (*off*: a config key,
no store, no budgets; *on*: the store, its key, budgets on every request), each answering ``--requests``
requests over 32 connections while it counts (``proxy_server --count-opcodes``), non-streamed and
streamed. It prints, per kind, instructions per request of each side, their ratio, and the functions
whose count differs most.

What it leaves out, by design: C code (uvicorn's header checks, SQLite, the garbage collector) and the
writer's and the key view's threads. The CPU ratio itself is the accounts phase's; this is its map.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy.auth import new_key
from supervisor.bench.provenance import llamagate_identity
from supervisor.errors import StartupError
from tests.benchmarks import cli
from tests.benchmarks import proxycost as pc
from tests.benchmarks.proxy import _fake, _processes, _proxy, _store_with_key

CONNECTIONS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1600, help="requests counted per side and kind")
    parser.add_argument("--top", type=int, default=15, help="functions shown per kind (default 15)")
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")


async def _count(proc: subprocess.Popen[str], out: Path, url: str, raw: bytes, requests: int) -> list[Any]:
    await pc.throughput(url, raw, CONNECTIONS, 2.0)  # warm: imports, caches, the store's first pages
    _remove(out)
    os.kill(proc.pid, signal.SIGUSR1)
    await asyncio.sleep(0.2)  # the handler runs between two of the loop's steps
    await asyncio.gather(*(pc.latencies(url, raw, requests // CONNECTIONS) for _ in range(CONNECTIONS)))
    os.kill(proc.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while (rows := _read(out)) is None:
        if time.monotonic() > deadline:
            raise StartupError(f"the proxy wrote no opcode counts to {out}")
        await asyncio.sleep(0.1)
    return rows


def _remove(out: Path) -> None:
    out.unlink(missing_ok=True)


def _read(out: Path) -> list[Any] | None:
    """The counts once the proxy has written them whole (a half-written file does not parse yet)."""
    try:
        rows: list[Any] = json.loads(out.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return rows


def _short(where: str) -> str:
    for prefix in (str(cli.REPO) + "/", "site-packages/"):
        if prefix in where:
            where = where.split(prefix, 1)[1]
    return where


async def _measure(
    args: argparse.Namespace, folder: Path, procs: list[subprocess.Popen[Any]]
) -> dict[str, Any]:
    secret = secrets.token_urlsafe(16)
    key, entry = new_key("bench", frozenset({"inference"}))
    store, store_key = _store_with_key(folder)
    fake, fake_url = _fake(secret)
    procs.append(fake)
    sides: dict[str, tuple[subprocess.Popen[str], str, str, Path]] = {}
    for name, db in (("off", None), ("on", store)):
        counts = folder / f"opcodes-{name}.json"
        proc, url = _proxy(
            fake_url,
            secret,
            entry.key_id,
            entry.digest,
            "asyncio",
            db,
            ("--count-opcodes", str(counts)),
            slots=256,
            max_concurrency=256,
        )
        procs.append(proc)
        sides[name] = (proc, url, key if db is None else store_key, counts)
    n = args.requests // CONNECTIONS * CONNECTIONS
    results: dict[str, Any] = {"requests": n, "connections": CONNECTIONS}
    for kind, stream in (("whole", False), ("stream", True)):
        per: dict[str, dict[str, float]] = {}
        totals: dict[str, float] = {}
        for name, (proc, url, k, counts) in sides.items():
            rows = await _count(proc, counts, url, pc.chat_request(url, k, 16, stream), n)
            per[name] = {_short(where): count / n for count, where in rows}
            totals[name] = sum(per[name].values())
        diff = sorted(
            ((per["on"].get(f, 0.0) - per["off"].get(f, 0.0), f) for f in set(per["on"]) | set(per["off"])),
            reverse=True,
        )
        results[kind] = {
            "opcodes_per_request": totals,
            "ratio": totals["on"] / totals["off"],
            "most_added": [{"function": f, "opcodes": round(d, 1)} for d, f in diff[: args.top]],
        }
        off, on = totals["off"], totals["on"]
        print(f"{kind}: off {off:.0f}, on {on:.0f} opcodes per request (on / off {on / off:.3f})")
        for d, f in diff[: args.top]:
            print(f"  {d:8.1f}  {f}")
    return results


def handle(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {"command": cli.command_line("proxy_opcodes")}
    results["llamagate"] = llamagate_identity()
    with tempfile.TemporaryDirectory(prefix="llamagate-bench-opcodes-") as folder, _processes() as procs:
        results.update(asyncio.run(_measure(args, Path(folder), procs)))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def main() -> int:
    return cli.run("proxy_opcodes", __doc__, add_arguments, handle)


if __name__ == "__main__":
    raise SystemExit(main())
